//! A real axum server on loopback that injects faults from a per-path script and logs
//! the headers of every request it receives.

use std::collections::{HashMap, VecDeque};
use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::{Duration, SystemTime};

use axum::Router;
use axum::body::Body;
use axum::extract::connect_info::Connected;
use axum::extract::{ConnectInfo, Request, State};
use axum::response::Response;
use axum::serve::{IncomingStream, Listener};
use futures::StreamExt;
use http::{HeaderMap, Method, StatusCode, header};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};

/// What the server does with one request.
#[derive(Debug, Clone)]
pub(crate) enum Fault {
    /// Answer with this status and a tiny body.
    Status(u16),
    /// Answer with `status` and `Retry-After: <secs>`.
    RetryAfterSecs(u16, u64),
    /// Answer with `status` and `Retry-After: <HTTP date now + d>`.
    RetryAfterDate(u16, Duration),
    /// Answer `409` with a problem document carrying `code` (and `Retry-After: 1` for
    /// the in-progress code, as idemkit servers do).
    Problem409(&'static str),
    /// Sleep, then answer 200.
    Delay(Duration),
    /// Read the request, then reset the connection without answering.
    Reset,
    /// `409` problem headers (`Content-Length: 200`), 10 bytes of body, then nothing more.
    Stalled409,
    /// A `409` problem document of this many bytes (in-progress code first, then padding).
    Big409(usize),
    /// `409` problem headers and part of the body, then the connection breaks.
    Broken409,
}

/// One received request.
#[derive(Debug, Clone)]
pub(crate) struct Received {
    pub(crate) method: Method,
    pub(crate) path: String,
    pub(crate) headers: HeaderMap,
    /// When the server received it.
    pub(crate) at: std::time::Instant,
}

#[derive(Default)]
struct Shared {
    log: Mutex<Vec<Received>>,
    scripts: Mutex<HashMap<String, VecDeque<Fault>>>,
    /// Answer for a path whose script ran out (default 200).
    fallback: Mutex<HashMap<String, Fault>>,
}

/// Handle to a running fault server.
#[derive(Clone)]
pub(crate) struct FaultServer {
    addr: SocketAddr,
    shared: Arc<Shared>,
}

impl FaultServer {
    pub(crate) async fn start() -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let shared = Arc::new(Shared::default());
        let app = Router::new().fallback(handle).with_state(shared.clone());
        tokio::spawn(async move {
            axum::serve(
                FaultListener(listener),
                app.into_make_service_with_connect_info::<ConnHandle>(),
            )
            .await
            .unwrap();
        });
        Self { addr, shared }
    }

    pub(crate) fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.addr)
    }

    /// Scripts the next answers for `path`.
    pub(crate) fn script(&self, path: &str, faults: impl IntoIterator<Item = Fault>) {
        self.shared
            .scripts
            .lock()
            .unwrap()
            .insert(path.to_owned(), faults.into_iter().collect());
    }

    /// Answer for `path` once its script is used up.
    pub(crate) fn always(&self, path: &str, fault: Fault) {
        self.shared
            .fallback
            .lock()
            .unwrap()
            .insert(path.to_owned(), fault);
    }

    /// Requests received on `path`, in order.
    pub(crate) fn received(&self, path: &str) -> Vec<Received> {
        self.shared
            .log
            .lock()
            .unwrap()
            .iter()
            .filter(|r| r.path == path)
            .cloned()
            .collect()
    }

    /// The values of `name` on every request to `path`.
    pub(crate) fn header_values(&self, path: &str, name: &str) -> Vec<Option<String>> {
        self.received(path)
            .iter()
            .map(|r| r.headers.get(name).map(|v| v.to_str().unwrap().to_owned()))
            .collect()
    }
}

async fn handle(
    State(shared): State<Arc<Shared>>,
    ConnectInfo(conn): ConnectInfo<ConnHandle>,
    request: Request,
) -> Response {
    let path = request.uri().path().to_owned();
    shared.log.lock().unwrap().push(Received {
        method: request.method().clone(),
        path: path.clone(),
        headers: request.headers().clone(),
        at: std::time::Instant::now(),
    });
    let fault = shared
        .scripts
        .lock()
        .unwrap()
        .get_mut(&path)
        .and_then(VecDeque::pop_front)
        .or_else(|| shared.fallback.lock().unwrap().get(&path).cloned())
        .unwrap_or(Fault::Status(200));
    let builder = Response::builder();
    match fault {
        Fault::Status(s) => builder.status(s).body(Body::from("ok")).unwrap(),
        Fault::RetryAfterSecs(s, secs) => builder
            .status(s)
            .header(header::RETRY_AFTER, secs.to_string())
            .body(Body::empty())
            .unwrap(),
        Fault::RetryAfterDate(s, d) => builder
            .status(s)
            .header(
                header::RETRY_AFTER,
                httpdate::fmt_http_date(SystemTime::now() + d),
            )
            .body(Body::empty())
            .unwrap(),
        Fault::Problem409(code) => {
            let retryable = code == idemkit_client::CODE_IN_PROGRESS;
            let body = serde_json::json!({
                "type": format!("https://example.invalid/problems/{code}"),
                "title": "conflict",
                "status": 409,
                "detail": "scripted",
                "code": code,
                "retryable": retryable,
            });
            let builder = builder
                .status(StatusCode::CONFLICT)
                .header(header::CONTENT_TYPE, "application/problem+json");
            let builder = if retryable {
                builder.header(header::RETRY_AFTER, "1")
            } else {
                builder
            };
            builder.body(Body::from(body.to_string())).unwrap()
        }
        Fault::Delay(d) => {
            tokio::time::sleep(d).await;
            builder.status(200).body(Body::from("late")).unwrap()
        }
        Fault::Stalled409 => {
            let chunks = futures::stream::once(async {
                Ok::<_, io::Error>(bytes::Bytes::from_static(b"{\"code\":\"i"))
            })
            .chain(futures::stream::pending());
            builder
                .status(StatusCode::CONFLICT)
                .header(header::CONTENT_TYPE, "application/problem+json")
                .header(header::CONTENT_LENGTH, "200")
                .body(Body::from_stream(chunks))
                .unwrap()
        }
        Fault::Big409(len) => {
            let head = format!("{{\"code\":\"{}\",\"pad\":\"", idemkit_client::CODE_IN_PROGRESS);
            let mut body = head.into_bytes();
            body.resize(len - 2, b'x');
            body.extend_from_slice(b"\"}");
            builder
                .status(StatusCode::CONFLICT)
                .header(header::CONTENT_TYPE, "application/problem+json")
                .header(header::RETRY_AFTER, "0")
                .body(Body::from(body))
                .unwrap()
        }
        Fault::Broken409 => {
            // The failure comes after the headers and the first bytes have gone out.
            let chunks = futures::stream::once(async { Ok(bytes::Bytes::from_static(b"{\"code\":\"idem")) })
                .chain(futures::stream::once(async {
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    Err(io::Error::from(io::ErrorKind::ConnectionReset))
                }));
            builder
                .status(StatusCode::CONFLICT)
                .header(header::CONTENT_TYPE, "application/problem+json")
                .body(Body::from_stream(chunks))
                .unwrap()
        }
        Fault::Reset => {
            conn.0.store(true, Ordering::SeqCst);
            builder.status(200).body(Body::from("never sent")).unwrap()
        }
    }
}

/// Lets a handler reset its own connection.
#[derive(Clone)]
struct ConnHandle(Arc<AtomicBool>);

impl Connected<IncomingStream<'_, FaultListener>> for ConnHandle {
    fn connect_info(stream: IncomingStream<'_, FaultListener>) -> Self {
        Self(stream.io().reset.clone())
    }
}

struct FaultListener(TcpListener);

impl Listener for FaultListener {
    type Io = FaultIo;
    type Addr = SocketAddr;

    async fn accept(&mut self) -> (FaultIo, SocketAddr) {
        loop {
            if let Ok((stream, addr)) = self.0.accept().await {
                let io = FaultIo {
                    stream,
                    reset: Arc::new(AtomicBool::new(false)),
                };
                return (io, addr);
            }
        }
    }

    fn local_addr(&self) -> io::Result<SocketAddr> {
        self.0.local_addr()
    }
}

/// A TCP stream that, once its handle is tripped, refuses to write and closes with
/// RST (zero linger) instead of sending the response.
struct FaultIo {
    stream: TcpStream,
    reset: Arc<AtomicBool>,
}

impl FaultIo {
    fn tripped(&self) -> Option<io::Error> {
        if self.reset.load(Ordering::SeqCst) {
            let _ = self.stream.set_zero_linger();
            Some(io::Error::from(io::ErrorKind::ConnectionReset))
        } else {
            None
        }
    }
}

impl AsyncRead for FaultIo {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.stream).poll_read(cx, buf)
    }
}

impl AsyncWrite for FaultIo {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        if let Some(err) = self.tripped() {
            return Poll::Ready(Err(err));
        }
        Pin::new(&mut self.stream).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        if let Some(err) = self.tripped() {
            return Poll::Ready(Err(err));
        }
        Pin::new(&mut self.stream).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.stream.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        if let Some(err) = self.tripped() {
            return Poll::Ready(Err(err));
        }
        Pin::new(&mut self.stream).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        if let Some(err) = self.tripped() {
            return Poll::Ready(Err(err));
        }
        Pin::new(&mut self.stream).poll_shutdown(cx)
    }
}

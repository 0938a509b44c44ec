//! Review of the issue-30 merges: a claim whose reply is lost on the way back.

use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::num::NonZeroUsize;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use idemkit_core::{ClaimOutcome, KeyStore, RecordState};
use idemkit_redis::RedisStore;
use idemkit_testkit::suite::{claim_req, response, scope};

use crate::common::{redis_url, single_config};

/// A TCP proxy in front of Redis that, once armed, swallows the next reply
/// the server sends and cuts that client connection: the command ran, its
/// answer never arrives (a network failure on the way back).
struct ReplyEater {
    addr: SocketAddr,
    armed: Arc<AtomicBool>,
    kept: Arc<Mutex<Vec<TcpStream>>>,
}

impl ReplyEater {
    fn start(upstream: SocketAddr) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let armed = Arc::new(AtomicBool::new(false));
        let kept = Arc::new(Mutex::new(Vec::new()));
        let (a, k) = (armed.clone(), kept.clone());
        std::thread::spawn(move || {
            for client in listener.incoming() {
                let Ok(client) = client else { return };
                let Ok(server) = TcpStream::connect(upstream) else {
                    return;
                };
                k.lock().unwrap().push(server.try_clone().unwrap());
                let (mut c1, mut s1) = (client.try_clone().unwrap(), server.try_clone().unwrap());
                std::thread::spawn(move || {
                    let _ = std::io::copy(&mut c1, &mut s1);
                });
                let (mut c2, mut s2, armed) = (client, server, a.clone());
                std::thread::spawn(move || {
                    use std::io::{Read, Write};
                    let mut buf = [0u8; 16 * 1024];
                    loop {
                        let n = match s2.read(&mut buf) {
                            Ok(0) | Err(_) => return,
                            Ok(n) => n,
                        };
                        if armed.swap(false, Ordering::SeqCst) {
                            let _ = c2.shutdown(Shutdown::Both);
                            return;
                        }
                        if c2.write_all(&buf[..n]).is_err() {
                            return;
                        }
                    }
                });
            }
        });
        Self { addr, armed, kept }
    }
}

impl Drop for ReplyEater {
    fn drop(&mut self) {
        for s in self.kept.lock().unwrap().drain(..) {
            let _ = s.shutdown(Shutdown::Both);
        }
    }
}

/// A claim that ran on the server but whose reply was lost: the store
/// re-delivers it under the same attempt id (the claim script answers its
/// own attempt `Claimed`), instead of answering an error while the key is
/// held by that attempt, and by nobody, for a whole lease (every retry told
/// "in progress").
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_whose_reply_is_lost_is_delivered_again_under_its_attempt() {
    let Some(url) = redis_url() else { return };
    let target: url_host::Target = url_host::parse(&url);
    let proxy = ReplyEater::start(target.addr);
    let config = single_config("reply-lost-claim")
        .with_notifications(false)
        .with_connections(NonZeroUsize::new(2).unwrap());
    let store = RedisStore::connect_with(&target.with_addr(proxy.addr), config)
        .await
        .expect("connect through the proxy");
    let s = scope("a", "reply-lost");

    proxy.armed.store(true, Ordering::SeqCst);
    let outcome = store.claim(&claim_req(&s, "{}")).await;
    assert!(!proxy.armed.load(Ordering::SeqCst), "the claim's reply was eaten");
    let rec = store.get(&s).await.unwrap().expect("the claim ran on the server");
    assert_eq!(rec.state, RecordState::InFlight);
    let lease = match outcome {
        Ok(ClaimOutcome::Claimed(lease)) => lease,
        other => panic!(
            "the claim ran and its reply was lost; it answered {other:?} while its attempt holds \
             the key (a retry gets {:?})",
            store.claim(&claim_req(&s, "{}")).await
        ),
    };
    assert_eq!(lease.token, rec.fencing_token);
    store
        .complete(&s, lease.token, &response(201, "done"))
        .await
        .expect("the caller holds the key it claimed");
}

/// The host and port of a `redis://` URL, and the URL with them replaced.
mod url_host {
    use std::net::{SocketAddr, ToSocketAddrs};

    pub(super) struct Target {
        pub(super) addr: SocketAddr,
        url: String,
        hostport: String,
    }

    impl Target {
        pub(super) fn with_addr(&self, addr: SocketAddr) -> String {
            self.url.replacen(&self.hostport, &addr.to_string(), 1)
        }
    }

    pub(super) fn parse(url: &str) -> Target {
        let rest = url.split_once("://").map_or(url, |(_, r)| r);
        let rest = rest.rsplit_once('@').map_or(rest, |(_, r)| r);
        let hostport = rest.split(['/', '?']).next().unwrap().to_owned();
        let with_port = if hostport.contains(':') {
            hostport.clone()
        } else {
            format!("{hostport}:6379")
        };
        let addr = with_port.to_socket_addrs().unwrap().next().unwrap();
        Target {
            addr,
            url: url.to_owned(),
            hostport,
        }
    }
}

/// A store whose connections go through `proxy`.
async fn through(proxy: &ReplyEater, url: &str, tag: &str) -> RedisStore {
    let target = url_host::parse(url);
    let config = single_config(tag)
        .with_notifications(false)
        .with_connections(NonZeroUsize::new(2).unwrap());
    RedisStore::connect_with(&target.with_addr(proxy.addr), config)
        .await
        .expect("connect through the proxy")
}

/// Fenced writes whose reply is lost: the write ids exist so that the same
/// write delivered again answers like the first and writes nothing, but
/// nothing delivered it again. A completion that landed was answered
/// `Unavailable` (the engine's retry then, under a new id, is fenced by the
/// completion itself), and a phase whose business writes landed was answered
/// as failed. The store delivers them once more under the same write id.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fenced_writes_whose_reply_is_lost_are_delivered_again_under_their_id() {
    let Some(url) = redis_url() else { return };
    let proxy = ReplyEater::start(url_host::parse(&url).addr);
    let store = through(&proxy, &url, "reply-lost-writes").await;
    let mut failures = Vec::new();

    // A phase with a business write.
    let s = scope("a", "reply-lost-phase");
    let ClaimOutcome::Claimed(lease) = store.claim(&claim_req(&s, "{}")).await.unwrap() else {
        panic!("claim");
    };
    let stock = store.business_key(&s.account, "stock");
    let update = idemkit_core::PhaseUpdate {
        recovery_point: "reserved".into(),
        step: None,
    };
    proxy.armed.store(true, Ordering::SeqCst);
    let phase = store
        .advance_with(
            &s,
            lease.token,
            &update,
            &[idemkit_redis::RedisWrite::incr_by(stock.clone(), -1)],
        )
        .await;
    assert!(!proxy.armed.load(Ordering::SeqCst), "the phase's reply was eaten");
    let rec = store.get(&s).await.unwrap().unwrap();
    assert_eq!(rec.recovery_point.as_deref(), Some("reserved"), "the phase ran");
    if phase.is_err() {
        failures.push(format!("a phase that landed answered {phase:?}"));
    }

    // The completion.
    proxy.armed.store(true, Ordering::SeqCst);
    let done = store.complete(&s, lease.token, &response(201, "done")).await;
    assert!(
        !proxy.armed.load(Ordering::SeqCst),
        "the completion's reply was eaten"
    );
    let rec = store.get(&s).await.unwrap().unwrap();
    assert_eq!(rec.state, RecordState::Completed, "the completion ran");
    if done.is_err() {
        failures.push(format!("a completion that landed answered {done:?}"));
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

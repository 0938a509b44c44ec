//! The reqwest transport, for a service that is running somewhere: one tokio task
//! per request so a burst really runs at once, no redirects followed, no proxy, no
//! retries.

use std::error::Error as _;
use std::time::Duration;

use async_trait::async_trait;

use crate::{Answer, Request, Transport, TransportError};

/// Sends the gates' requests over HTTP with reqwest.
#[derive(Debug, Clone)]
pub struct HttpTransport {
    client: reqwest::Client,
}

impl HttpTransport {
    /// A transport whose every request gives up after `timeout`.
    pub fn new(timeout: Duration) -> Result<Self, TransportError> {
        let client = reqwest::Client::builder()
            .redirect(reqwest::redirect::Policy::none())
            .no_proxy()
            .timeout(timeout)
            .build()
            .map_err(|e| TransportError(format!("building the HTTP client: {}", chain(&e))))?;
        Ok(Self { client })
    }
}

#[async_trait]
impl Transport for HttpTransport {
    async fn send(&self, request: Request) -> Result<Answer, TransportError> {
        let client = self.client.clone();
        let task = tokio::spawn(async move {
            let response = client
                .request(request.method, &request.url)
                .headers(request.headers)
                .body(request.body)
                .send()
                .await?;
            let status = response.status().as_u16();
            let headers = response.headers().clone();
            let body = response.bytes().await?.to_vec();
            Ok::<_, reqwest::Error>(Answer {
                status,
                headers,
                body,
            })
        });
        match task.await {
            Ok(Ok(answer)) => Ok(answer),
            Ok(Err(e)) => Err(TransportError(chain(&e))),
            Err(e) => Err(TransportError(format!("request task failed: {e}"))),
        }
    }
}

/// "error sending request …: client error (Connect): Connection refused".
fn chain(e: &reqwest::Error) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(cause) = source {
        let s = cause.to_string();
        if !text.contains(&s) {
            text.push_str(": ");
            text.push_str(&s);
        }
        source = cause.source();
    }
    text
}

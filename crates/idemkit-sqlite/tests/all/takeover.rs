//! A single-step takeover hands its handler what the record holds at the
//! moment the claim holds the write lock (issue 30, item 12), not what an
//! earlier unlocked read saw.

use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use idemkit_core::{Clock, KeyStore, Millis, PhaseUpdate, TransactionalStore, TxClaim};
use idemkit_testkit::ManualClock;
use idemkit_testkit::suite::{claim_req, must_claim, response, scope};
use serde_json::json;

/// A clock that, once armed, pauses the first caller that reads it (on that
/// caller's thread) until the test lets it go: the claim reads the time right
/// after its unlocked read of the record, so the test can write in between.
#[derive(Debug)]
struct PausingClock {
    inner: ManualClock,
    armed: Mutex<Option<(mpsc::Sender<()>, mpsc::Receiver<()>)>>,
}

impl Clock for PausingClock {
    fn now(&self) -> Millis {
        let armed = self.armed.lock().unwrap().take();
        if let Some((reached, go)) = armed {
            reached.send(()).unwrap();
            go.recv().unwrap();
        }
        self.inner.now()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_single_step_takeover_resumes_from_what_the_record_holds_under_the_lock() {
    let clock = Arc::new(PausingClock {
        inner: ManualClock::new(),
        armed: Mutex::new(None),
    });
    let dir = super::test_dir("takeover");
    let store = Arc::new(
        idemkit_sqlite::SqliteStore::connect(dir.join("keys.db"))
            .await
            .unwrap()
            .with_clock(clock.clone()),
    );
    let s = scope("acct", "k-stale");
    let req = claim_req(&s, "{}");
    // A lease-mode holder reaches `one`, then its lease runs out.
    let lapsed = must_claim(&*store, &req).await;
    let at = |point: &str| PhaseUpdate {
        recovery_point: point.into(),
        step: Some((point.into(), json!({ "done": point }))),
    };
    store.advance(&s, lapsed.token, &at("one")).await.unwrap();
    clock.inner.advance(Duration::from_secs(3600));

    let (reached_tx, reached) = mpsc::channel();
    let (go, go_rx) = mpsc::channel();
    *clock.armed.lock().unwrap() = Some((reached_tx, go_rx));
    let claimant = {
        let (store, req) = (store.clone(), req.clone());
        tokio::spawn(async move { store.claim_in_tx(&req).await })
    };
    // The claim has read the record (at `one`) without the lock; the lapsed
    // holder, whose token is still the record's, commits `two` now.
    tokio::task::spawn_blocking(move || reached.recv().unwrap())
        .await
        .unwrap();
    store.advance(&s, lapsed.token, &at("two")).await.unwrap();
    go.send(()).unwrap();
    let TxClaim::Claimed { tx, lease } = claimant.await.unwrap().unwrap() else {
        panic!("the single-step claim takes the abandoned record over")
    };
    let stored = store.get(&s).await.unwrap().unwrap();
    assert_eq!(stored.recovery_point.as_deref(), Some("two"));
    assert_eq!(
        lease.resumed_from.as_deref(),
        Some("two"),
        "the handler resumes from the recovery point the record holds under the write lock"
    );
    store
        .complete_in_tx(tx, &s, lease.token, &response(201, "done"))
        .await
        .expect("what the handler was given is what the record holds: the completion commits");
}

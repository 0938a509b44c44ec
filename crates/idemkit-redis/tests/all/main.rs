//! Redis runs the store conformance suite (single node and a real cluster),
//! fencing under a real process pause, `WAIT`, notifications and failure mapping.
//!
//! Single-node tests use `IDEMKIT_TEST_REDIS_URL`, each store under its own key
//! prefix so tests share the server and run in parallel. Unset: a failure under
//! `CI`, a notice and a skip elsewhere. Cluster and failure tests start their own
//! `redis-server` processes on free loopback ports.

mod business;
mod cluster;
mod common;
mod fencing;
mod hardening;
mod harness;
mod review;
mod roundtrips;
mod single;

mod conformance {
    // `None` (no Redis configured outside CI) skips each case with a notice.
    idemkit_testkit::store_conformance_tests!(optional super::common::fresh_single);
}

mod lifecycle {
    // Phases, parking, the completer's work list, the reaper, the review list,
    // listing and operator releases, each case on a fresh prefix.
    idemkit_testkit::lifecycle_conformance_tests!(optional super::common::fresh_single);
}

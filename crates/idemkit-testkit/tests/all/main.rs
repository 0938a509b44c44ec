//! The in-memory store passes the conformance suite it ships.

use std::sync::Arc;

use idemkit_testkit::{ManualClock, MemoryStore};

async fn fresh(clock: Arc<ManualClock>) -> Arc<MemoryStore> {
    Arc::new(MemoryStore::with_clock(clock))
}

idemkit_testkit::store_conformance_tests!(fresh);

mod lifecycle {
    use super::*;
    idemkit_testkit::lifecycle_conformance_tests!(fresh);
}

//! The keys this process has recently claimed in single-step mode: a hint that
//! picks the cheaper way to open a claim, never an arbiter.
//!
//! A first request opens its transaction with the check that the key has no
//! record (`sql::begin_locked_absent`), which saves the claim's read. A retry
//! fails that check, and the error, the rollback and a read built from
//! literals cost the server more than reading the record with a prepared
//! statement, outside any transaction. A key this process has claimed before
//! is likely a retry, so it takes the read, which settles a replay without a
//! transaction or a lock. Either way the database decides: a key the hint
//! forgot (evicted, or first claimed by another instance) takes the check and
//! falls back to the read; a key it remembers that has no record is read
//! absent, then opened holding the lock, read again and claimed.

use std::sync::atomic::{AtomicU64, Ordering};

/// Slots in the table: 8 bytes each, 512 KiB per store.
const SLOTS: usize = 1 << 16;

/// A direct-mapped table of 64-bit key hashes (the key's advisory lock id): a
/// key remembered in a slot another key needs is forgotten.
pub(crate) struct RecentKeys {
    slots: Box<[AtomicU64]>,
}

impl RecentKeys {
    pub(crate) fn new() -> Self {
        Self {
            slots: (0..SLOTS).map(|_| AtomicU64::new(0)).collect(),
        }
    }

    /// The slot and the value a key's hash is stored as (never 0, which marks
    /// an empty slot; the low bit is part of the slot's index, so setting it
    /// confuses no two keys that share a slot).
    fn place(lock: i64) -> (usize, u64) {
        let h = lock as u64;
        ((h as usize) & (SLOTS - 1), h | 1)
    }

    pub(crate) fn remember(&self, lock: i64) {
        let (slot, value) = Self::place(lock);
        self.slots[slot].store(value, Ordering::Relaxed);
    }

    pub(crate) fn contains(&self, lock: i64) -> bool {
        let (slot, value) = Self::place(lock);
        self.slots[slot].load(Ordering::Relaxed) == value
    }
}

impl std::fmt::Debug for RecentKeys {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("RecentKeys { .. }")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_key_is_remembered_until_another_takes_its_slot() {
        let recent = RecentKeys::new();
        assert!(!recent.contains(7));
        recent.remember(7);
        assert!(recent.contains(7));
        assert!(!recent.contains(8), "a neighbour is not remembered with it");
        // Same slot (the low 16 bits), another key: the first is forgotten.
        let rival = 7 + (1 << 16);
        recent.remember(rival);
        assert!(recent.contains(rival));
        assert!(!recent.contains(7));
        // The low bit is kept apart by the slot index, not lost to the marker.
        recent.remember(6);
        assert!(recent.contains(6) && recent.contains(rival) && !recent.contains(7));
        recent.remember(0);
        assert!(recent.contains(0));
    }
}

//! # idemkit-core
//!
//! The idempotency contract of idemkit as plain types: keys and their validation,
//! scopes, request fingerprints, the record and its state machine, per-route
//! policy, RFC 9457 problem documents with stable codes, and the [`KeyStore`]
//! trait that SQLite, PostgreSQL and Redis backends implement.
//!
//! What keys buy is *effectively once* within the key scope and replay window:
//! at-least-once delivery plus de-duplication. This crate knows no database, no
//! HTTP framework and no async runtime.
//!
//! ```
//! use std::time::Duration;
//! use idemkit_core::{decide, Decision, Fingerprinter, IdempotencyKey, Millis};
//!
//! let key = IdempotencyKey::parse("order-confirm-42").unwrap();
//! let fp = Fingerprinter::new().compute("POST", "/orders", br#"{"sku":"A","quantity":1}"#);
//! // Nothing stored yet: the first attempt claims the key.
//! assert_eq!(decide(None, &fp, Millis(0), Duration::from_secs(86_400)), Decision::Insert);
//! # let _ = key;
//! ```
#![cfg_attr(docsrs, feature(doc_cfg))]

mod clock;
mod deadline;
mod fingerprint;
mod key;
mod policy;
mod problem;
mod record;
mod scope;
mod store;
pub mod wire;

pub use clock::{Clock, Millis, SystemClock};
pub use deadline::{DEADLINE_HEADER_MAX_DIGITS, format_deadline_header, parse_deadline_header};
pub use fingerprint::{Fingerprint, Fingerprinter, PointerError};
pub use key::{IdempotencyKey, KeyError, MAX_KEY_LEN};
pub use policy::{
    DEFAULT_REPLAYED_HEADERS, InFlightBehavior, MismatchStatus, NEVER_REPLAYED_HEADERS, Policy, PolicyError,
    ServerErrorPolicy,
};
pub use problem::{ErrorCode, PROBLEM_CONTENT_TYPE, Problem};
pub use record::{
    Decision, DownstreamKey, FencingToken, PhaseUpdate, ReapReport, Record, RecordHead, RecordState,
    ReviewEntry, StoredHeader, StoredRequest, StoredResponse, decide, decide_resume,
};

/// For store authors: a record and a review entry as a SQL or hash row holds
/// them (JSON columns as text), with their one decoding into [`Record`] and
/// [`ReviewEntry`], so every store reads rows the same way. A service never
/// needs these.
pub mod storage {
    pub use crate::record::{RecordRow, ReviewRow};
}
pub use scope::{Account, AccountKey, Scope};
pub use store::{
    ClaimOutcome, ClaimRequest, FORCE_RELEASED, IntoKeyStore, IntoTransactionalStore, KeyStore, Lease,
    ListFilter, MOVED_TO_REVIEW, RELEASE_REFUSED, Resolution, StoreError, StoreResult, TransactionalStore,
    TxClaim,
};

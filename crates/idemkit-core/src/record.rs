//! The idempotency record, its states, and the claim decision (the behaviour contract, `docs/spec.md` §3 and §6).

use std::collections::BTreeMap;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::{Fingerprint, Millis, Scope};

/// A fencing token: strictly increasing per record, across takeovers, releases and
/// window reuse. Every write a lease holder makes carries it, and a store refuses
/// writes whose token is no longer current.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct FencingToken(pub i64);

/// The state of a record. `absent` is the absence of a record (or a released one).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum RecordState {
    /// Claimed; a lease holder is (or was) executing it.
    InFlight,
    /// Finished with a stored response.
    Completed,
    /// Released (validation error or retryable failure before any phase committed):
    /// behaves as absent. The row is kept so the fencing token keeps increasing.
    Released,
    /// Parked for human review: an external call's outcome is unknown and the
    /// downstream does not honour idempotency keys, so it must not be re-issued.
    /// Retries are answered `idempotency_request_parked` until an operator acts.
    Parked,
}

impl RecordState {
    /// The name stores persist.
    pub const fn as_str(self) -> &'static str {
        match self {
            Self::InFlight => "in_flight",
            Self::Completed => "completed",
            Self::Released => "released",
            Self::Parked => "parked",
        }
    }

    /// Parses a persisted name.
    pub fn parse(s: &str) -> Option<Self> {
        Some(match s {
            "in_flight" => Self::InFlight,
            "completed" => Self::Completed,
            "released" => Self::Released,
            "parked" => Self::Parked,
            _ => return None,
        })
    }
}

/// One header of a stored request or response. Values are bytes: HTTP allows
/// non-UTF-8 header values and replay must be faithful.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StoredHeader {
    /// Lower-case name.
    pub name: String,
    /// Raw value.
    pub value: Vec<u8>,
}

/// The request as received, kept so a completer can finish it without the client.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct StoredRequest {
    /// HTTP method.
    pub method: String,
    /// Route path (with query string, if any).
    pub path: String,
    /// Selected headers (never credentials).
    pub headers: Vec<StoredHeader>,
    /// The body.
    pub body: Vec<u8>,
}

/// A response stored for replay: byte-identical body, status, allowlisted headers.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct StoredResponse {
    /// Status code.
    pub status: u16,
    /// Allowlisted headers, in the original order.
    pub headers: Vec<StoredHeader>,
    /// The body bytes.
    pub body: Vec<u8>,
}

/// A whole record as a store returns it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Record {
    /// (account, key).
    pub scope: Scope,
    /// Fingerprint of the request that claimed the key.
    pub fingerprint: Fingerprint,
    /// Current state.
    pub state: RecordState,
    /// When the current claim began.
    pub created_at: Millis,
    /// When it completed.
    pub completed_at: Option<Millis>,
    /// When the current lease ends.
    pub lease_expires_at: Millis,
    /// The current fencing token.
    pub fencing_token: FencingToken,
    /// The last recovery point a phase committed, if any.
    pub recovery_point: Option<String>,
    /// Saved outputs of completed steps, by step name.
    pub step_outputs: BTreeMap<String, serde_json::Value>,
    /// The request that claimed the key.
    pub request: StoredRequest,
    /// The stored response, once completed.
    pub response: Option<StoredResponse>,
    /// The last error recorded by a retryable outcome.
    pub last_error: Option<String>,
}

impl Record {
    /// Whether an attempt recorded progress: a recovery point or any step
    /// output (an external call's intent included). Such a record is never
    /// released as if nothing happened: it stays resumable.
    pub fn has_progress(&self) -> bool {
        self.recovery_point.is_some() || !self.step_outputs.is_empty()
    }
}

/// A record as SQL stores persist it, one value per column, before validation.
/// Stores read their row into this and convert with `Record::try_from`, so the
/// parsing and its error messages are the same for every SQL backend.
#[derive(Debug, Clone, Default)]
#[allow(missing_docs)] // one field per column of the `idemkit_keys` table
pub struct RecordRow {
    pub account: String,
    pub key: String,
    pub fingerprint: Vec<u8>,
    pub state: String,
    pub created_at: i64,
    pub completed_at: Option<i64>,
    pub lease_expires_at: i64,
    pub fencing_token: i64,
    pub recovery_point: Option<String>,
    pub step_outputs: String,
    pub req_method: String,
    pub req_path: String,
    pub req_headers: String,
    pub req_body: Vec<u8>,
    pub resp_status: Option<i64>,
    pub resp_headers: Option<String>,
    pub resp_body: Option<Vec<u8>>,
    pub last_error: Option<String>,
}

impl TryFrom<RecordRow> for Record {
    type Error = crate::StoreError;

    fn try_from(r: RecordRow) -> Result<Self, Self::Error> {
        use crate::{Account, IdempotencyKey, StoreError};
        let corrupt = |what: String| StoreError::Corrupt(what);
        let fingerprint: [u8; 32] = r
            .fingerprint
            .try_into()
            .map_err(|_| corrupt("fingerprint is not 32 bytes".into()))?;
        let response = match r.resp_status {
            Some(status) => Some(StoredResponse {
                status: u16::try_from(status).map_err(|_| corrupt(format!("status {status}")))?,
                headers: StoredHeader::decode_list(r.resp_headers.as_deref().unwrap_or("[]"))?,
                body: r.resp_body.unwrap_or_default(),
            }),
            None => None,
        };
        Ok(Self {
            scope: Scope::new(
                Account::new(r.account),
                IdempotencyKey::parse(&r.key).map_err(|e| corrupt(format!("key: {e}")))?,
            ),
            fingerprint: Fingerprint::from_bytes(fingerprint),
            state: RecordState::parse(&r.state).ok_or_else(|| corrupt(format!("state {}", r.state)))?,
            created_at: Millis(r.created_at),
            completed_at: r.completed_at.map(Millis),
            lease_expires_at: Millis(r.lease_expires_at),
            fencing_token: FencingToken(r.fencing_token),
            recovery_point: r.recovery_point,
            step_outputs: serde_json::from_str(&r.step_outputs)
                .map_err(|e| corrupt(format!("step outputs: {e}")))?,
            request: StoredRequest {
                method: r.req_method,
                path: r.req_path,
                headers: StoredHeader::decode_list(&r.req_headers)?,
                body: r.req_body,
            },
            response,
            last_error: r.last_error,
        })
    }
}

impl StoredHeader {
    /// Encodes a header list as stores persist it (JSON).
    pub fn encode_list(headers: &[StoredHeader]) -> Result<String, crate::StoreError> {
        serde_json::to_string(headers).map_err(|e| crate::StoreError::Corrupt(e.to_string()))
    }

    /// Decodes a list written by [`StoredHeader::encode_list`].
    pub fn decode_list(s: &str) -> Result<Vec<StoredHeader>, crate::StoreError> {
        serde_json::from_str(s).map_err(|e| crate::StoreError::Corrupt(format!("headers: {e}")))
    }
}

/// The part of a record the claim decision needs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RecordHead {
    /// Current state.
    pub state: RecordState,
    /// Fingerprint of the claiming request.
    pub fingerprint: Fingerprint,
    /// When the current claim began.
    pub created_at: Millis,
    /// When it completed.
    pub completed_at: Option<Millis>,
    /// When the current lease ends.
    pub lease_expires_at: Millis,
    /// The current fencing token.
    pub fencing_token: FencingToken,
}

impl From<&Record> for RecordHead {
    fn from(r: &Record) -> Self {
        Self {
            state: r.state,
            fingerprint: r.fingerprint,
            created_at: r.created_at,
            completed_at: r.completed_at,
            lease_expires_at: r.lease_expires_at,
            fencing_token: r.fencing_token,
        }
    }
}

/// What a claim does, given the record (if any) it finds. This is the state machine
/// of the behaviour contract's §3 (`docs/spec.md`) as a pure function; every store's atomic claim implements exactly it,
/// and the conformance suite checks each store against it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Decision {
    /// No record: insert one, in flight, token 1.
    Insert,
    /// The record is absent in effect (released, or past the replay window): start
    /// a new request on it with the next token and a clean slate.
    Reuse,
    /// In flight with an expired lease and the same fingerprint: take over with
    /// the next token, keeping the recovery point, the step outputs and the
    /// request's generation (`created_at`), however old the record is.
    Takeover,
    /// Completed within the window with the same fingerprint: replay.
    Replay,
    /// Same key, different request: `idempotency_key_reused`.
    Mismatch,
    /// Parked for human review: `idempotency_request_parked`, never executed again.
    Parked,
    /// Held by a live lease: `idempotency_request_in_progress`; retry after this long.
    InProgress {
        /// Time left on the holder's lease.
        retry_after: Duration,
    },
    /// A resume (the completer's claim, see [`decide_resume`]) found the record
    /// no longer in the abandoned state it saw: answer without running anything.
    Stale,
}

/// Decides the completer's resume of the abandoned record it saw with token
/// `seen`: it may only take over exactly that record state. A record that was
/// completed, parked, released, reaped, taken over or reused in between is
/// answered from its new state (replay, parked, in progress) or is
/// [`Decision::Stale`], never run as a fresh request.
pub fn decide_resume(
    existing: Option<&RecordHead>,
    seen: FencingToken,
    fingerprint: &Fingerprint,
    now: Millis,
    replay_window: Duration,
) -> Decision {
    match decide(existing, fingerprint, now, replay_window) {
        Decision::Takeover if existing.is_some_and(|r| r.fencing_token == seen) => Decision::Takeover,
        Decision::Insert | Decision::Reuse | Decision::Takeover => Decision::Stale,
        settled => settled,
    }
}

/// Decides a claim. See [`Decision`].
pub fn decide(
    existing: Option<&RecordHead>,
    fingerprint: &Fingerprint,
    now: Millis,
    replay_window: Duration,
) -> Decision {
    let Some(r) = existing else {
        return Decision::Insert;
    };
    match r.state {
        RecordState::Released => Decision::Reuse,
        RecordState::Parked if r.fingerprint != *fingerprint => Decision::Mismatch,
        RecordState::Parked => Decision::Parked,
        RecordState::Completed => {
            let done = r.completed_at.unwrap_or(r.created_at);
            if done.plus(replay_window) <= now {
                Decision::Reuse
            } else if r.fingerprint != *fingerprint {
                Decision::Mismatch
            } else {
                Decision::Replay
            }
        }
        RecordState::InFlight => {
            if r.lease_expires_at > now {
                if r.fingerprint != *fingerprint {
                    Decision::Mismatch
                } else {
                    Decision::InProgress {
                        retry_after: now.until(r.lease_expires_at),
                    }
                }
            } else if r.fingerprint != *fingerprint {
                // The replay window applies to completed records only: an unfinished
                // request keeps its recovery point, intents and outputs however old
                // it is, and is never restarted as a new request.
                Decision::Mismatch
            } else {
                Decision::Takeover
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Fingerprinter;

    fn head(
        state: RecordState,
        fp: Fingerprint,
        created: i64,
        completed: Option<i64>,
        lease: i64,
    ) -> RecordHead {
        RecordHead {
            state,
            fingerprint: fp,
            created_at: Millis(created),
            completed_at: completed.map(Millis),
            lease_expires_at: Millis(lease),
            fencing_token: FencingToken(1),
        }
    }

    /// The persisted names are the ones every store's schema and script
    /// compare against, and each parses back to its state.
    #[test]
    fn persisted_state_names_round_trip() {
        let states = [
            (RecordState::InFlight, "in_flight"),
            (RecordState::Completed, "completed"),
            (RecordState::Released, "released"),
            (RecordState::Parked, "parked"),
        ];
        for (state, name) in states {
            assert_eq!(state.as_str(), name);
            assert_eq!(RecordState::parse(name), Some(state));
        }
        assert_eq!(RecordState::parse("IN_FLIGHT"), None);
        assert_eq!(RecordState::parse(""), None);
    }

    /// A recovery point alone, or a step output alone, is progress: either
    /// keeps the record resumable instead of released.
    #[test]
    fn either_a_recovery_point_or_a_step_output_is_progress() {
        let mut r = Record {
            scope: crate::Scope::new(
                crate::Account::new("a"),
                crate::IdempotencyKey::parse("k").unwrap(),
            ),
            fingerprint: Fingerprinter::new().compute("POST", "/", b""),
            state: RecordState::InFlight,
            created_at: Millis(0),
            completed_at: None,
            lease_expires_at: Millis(0),
            fencing_token: FencingToken(1),
            recovery_point: None,
            step_outputs: BTreeMap::new(),
            request: StoredRequest {
                method: "POST".into(),
                path: "/".into(),
                headers: Vec::new(),
                body: Vec::new(),
            },
            response: None,
            last_error: None,
        };
        assert!(!r.has_progress());
        r.recovery_point = Some("booked".into());
        assert!(r.has_progress());
        r.recovery_point = None;
        r.step_outputs
            .insert("courier".into(), serde_json::json!({ "intent": "k:courier" }));
        assert!(r.has_progress());
    }

    /// Header lists persist as JSON and come back byte for byte (values
    /// that are not UTF-8 included); anything else is a corrupt record.
    #[test]
    fn header_lists_round_trip_through_their_persisted_form() {
        let headers = vec![
            StoredHeader {
                name: "location".into(),
                value: b"/labels/1".to_vec(),
            },
            StoredHeader {
                name: "x-raw".into(),
                value: vec![0xff, 0x00, b'a'],
            },
        ];
        let encoded = StoredHeader::encode_list(&headers).unwrap();
        assert!(encoded.contains("location"), "{encoded}");
        assert_eq!(StoredHeader::decode_list(&encoded).unwrap(), headers);
        assert_eq!(StoredHeader::decode_list("[]").unwrap(), Vec::new());
        assert!(matches!(
            StoredHeader::decode_list("{not json"),
            Err(crate::StoreError::Corrupt(_))
        ));
    }

    /// The derivation is a promise to every downstream: a request resumed by
    /// a later release must send the key the first attempt sent, so the
    /// value is pinned (SHA-256 over the length-prefixed parts, 32 hex digits).
    #[test]
    fn downstream_keys_are_pinned_and_print_as_sent() {
        let scope = crate::Scope::new(
            crate::Account::new("acct"),
            crate::IdempotencyKey::parse("k1").unwrap(),
        );
        let key = DownstreamKey::derive(&scope, Millis(1), "courier");
        assert_eq!(key.as_str(), "a4c421f001d45fd1f18d2334dd8f1e0a");
        assert_eq!(key.to_string(), key.as_str());
    }

    #[test]
    fn state_machine() {
        let f = Fingerprinter::new();
        let a = f.compute("POST", "/", b"a");
        let b = f.compute("POST", "/", b"b");
        let w = Duration::from_millis(1000);
        let now = Millis(10_000);
        assert_eq!(decide(None, &a, now, w), Decision::Insert);
        let done = head(RecordState::Completed, a, 9_000, Some(9_500), 9_100);
        assert_eq!(decide(Some(&done), &a, now, w), Decision::Replay);
        assert_eq!(decide(Some(&done), &b, now, w), Decision::Mismatch);
        assert_eq!(decide(Some(&done), &b, Millis(10_500), w), Decision::Reuse);
        let live = head(RecordState::InFlight, a, 9_900, None, 10_300);
        assert_eq!(
            decide(Some(&live), &a, now, w),
            Decision::InProgress {
                retry_after: Duration::from_millis(300)
            }
        );
        assert_eq!(decide(Some(&live), &b, now, w), Decision::Mismatch);
        let dead = head(RecordState::InFlight, a, 9_500, None, 9_800);
        assert_eq!(decide(Some(&dead), &a, now, w), Decision::Takeover);
        assert_eq!(decide(Some(&dead), &b, now, w), Decision::Mismatch);
        // Unfinished work is never restarted by the replay window, however old.
        assert_eq!(decide(Some(&dead), &a, Millis(99_999_999), w), Decision::Takeover);
        assert_eq!(decide(Some(&dead), &b, Millis(99_999_999), w), Decision::Mismatch);
        // A resume takes over only the exact state it saw.
        let seen = FencingToken(1);
        assert_eq!(decide_resume(Some(&dead), seen, &a, now, w), Decision::Takeover);
        assert_eq!(
            decide_resume(Some(&dead), FencingToken(2), &a, now, w),
            Decision::Stale
        );
        assert_eq!(decide_resume(None, seen, &a, now, w), Decision::Stale);
        assert_eq!(decide_resume(Some(&done), seen, &a, now, w), Decision::Replay);
        let released = head(RecordState::Released, a, 9_500, None, 9_800);
        assert_eq!(decide(Some(&released), &b, now, w), Decision::Reuse);
        assert_eq!(decide_resume(Some(&released), seen, &a, now, w), Decision::Stale);
        // Parked records never run again, not even after the window: a human decides.
        let parked = head(RecordState::Parked, a, 9_500, None, 9_800);
        assert_eq!(decide(Some(&parked), &a, Millis(99_999_999), w), Decision::Parked);
        assert_eq!(decide(Some(&parked), &b, now, w), Decision::Mismatch);
    }
}

/// A phase's writes to the record, committed with the phase's business writes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PhaseUpdate {
    /// The recovery point reached (the name of the last committed phase).
    pub recovery_point: String,
    /// A step output to save: `(step name, output)`. Saved outputs are reused, not
    /// recomputed, when an attempt resumes.
    pub step: Option<(String, serde_json::Value)>,
}

/// The idempotency key an external call carries downstream, derived from ours so
/// that every attempt of one request sends the same key for the same step:
/// hex SHA-256 over (account, key, generation, step), cut to 32 characters
/// (128 bits) so it fits the length limits downstream APIs impose.
///
/// The *generation* identifies one request under the key: the instant its first
/// claim began (`Record::created_at`), which takeovers keep and a reuse of the
/// key after its replay window renews. So a resumed attempt re-sends the same
/// downstream key, and a new request under a reused key never collides with the
/// old one's downstream record.
///
/// ```
/// use idemkit_core::{Account, DownstreamKey, IdempotencyKey, Millis, Scope};
/// let scope = Scope::new(Account::new("acct"), IdempotencyKey::parse("k1").unwrap());
/// let a = DownstreamKey::derive(&scope, Millis(1), "courier");
/// assert_eq!(a, DownstreamKey::derive(&scope, Millis(1), "courier"));
/// assert_ne!(a, DownstreamKey::derive(&scope, Millis(1), "email"));
/// assert_ne!(a, DownstreamKey::derive(&scope, Millis(2), "courier"));
/// assert_eq!(a.as_str().len(), 32);
/// ```
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct DownstreamKey(String);

impl DownstreamKey {
    /// Derives the key for `step` of the request at `scope` whose generation
    /// (first claim) is `generation`.
    pub fn derive(scope: &Scope, generation: Millis, step: &str) -> Self {
        use sha2::{Digest, Sha256};
        let mut h = Sha256::new();
        h.update(b"idemkit-downstream-v2");
        let generation = generation.0.to_string();
        for part in [
            scope.account.as_str(),
            scope.key.as_str(),
            generation.as_str(),
            step,
        ] {
            h.update((part.len() as u64).to_be_bytes());
            h.update(part.as_bytes());
        }
        Self(hex::encode(h.finalize())[..32].to_owned())
    }

    /// The key as sent downstream.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl std::fmt::Display for DownstreamKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

/// A record the reaper moved out of the key table because it never completed,
/// kept for human review with where it got to and why it stopped.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReviewEntry {
    /// (account, key).
    pub scope: Scope,
    /// The state it was in (in flight or parked).
    pub state: RecordState,
    /// When it was claimed.
    pub created_at: Millis,
    /// When the reaper moved it here.
    pub reaped_at: Millis,
    /// The last recovery point it committed.
    pub recovery_point: Option<String>,
    /// Saved step outputs (including recorded external-call intents).
    pub step_outputs: BTreeMap<String, serde_json::Value>,
    /// The last error recorded for it.
    pub last_error: Option<String>,
    /// The request, so an operator can see what was asked.
    pub request: StoredRequest,
}

/// A review-list row as SQL stores persist it, before validation (see
/// [`RecordRow`]).
#[derive(Debug, Clone, Default)]
#[allow(missing_docs)] // one field per column of the `idemkit_review` table
pub struct ReviewRow {
    pub account: String,
    pub key: String,
    pub state: String,
    pub created_at: i64,
    pub reaped_at: i64,
    pub recovery_point: Option<String>,
    pub step_outputs: String,
    pub last_error: Option<String>,
    pub req_method: String,
    pub req_path: String,
    pub req_headers: String,
    pub req_body: Vec<u8>,
}

impl TryFrom<ReviewRow> for ReviewEntry {
    type Error = crate::StoreError;

    fn try_from(r: ReviewRow) -> Result<Self, Self::Error> {
        use crate::{Account, IdempotencyKey, StoreError};
        let corrupt = |what: String| StoreError::Corrupt(what);
        Ok(Self {
            scope: Scope::new(
                Account::new(r.account),
                IdempotencyKey::parse(&r.key).map_err(|e| corrupt(format!("key: {e}")))?,
            ),
            state: RecordState::parse(&r.state).ok_or_else(|| corrupt(format!("state {}", r.state)))?,
            created_at: Millis(r.created_at),
            reaped_at: Millis(r.reaped_at),
            recovery_point: r.recovery_point,
            step_outputs: serde_json::from_str(&r.step_outputs)
                .map_err(|e| corrupt(format!("step outputs: {e}")))?,
            last_error: r.last_error,
            request: StoredRequest {
                method: r.req_method,
                path: r.req_path,
                headers: StoredHeader::decode_list(&r.req_headers)?,
                body: r.req_body,
            },
        })
    }
}

/// What one reaper pass did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ReapReport {
    /// Completed or released records deleted.
    pub deleted: u64,
    /// Never-completed records moved to the review list.
    pub moved_to_review: u64,
}

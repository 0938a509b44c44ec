//! Redis replies to records: the claim script's answer, review entries and
//! record hashes (parsing shared with the SQL stores lives in
//! `idemkit_core::storage::RecordRow`), and the headers' JSON encoding.

use std::collections::{BTreeMap, HashMap};
use std::time::Duration;

use idemkit_core::{
    ClaimOutcome, FencingToken, Fingerprint, Lease, Millis, Record, RecordState, ReviewEntry, Scope,
    StoreResult, StoredHeader, StoredRequest, StoredResponse,
};
use redis::Value;

use crate::error::corrupt;

pub(crate) fn to_json(headers: &[StoredHeader]) -> StoreResult<Vec<u8>> {
    serde_json::to_vec(headers).map_err(|e| corrupt(e.to_string()))
}

pub(crate) fn from_json(bytes: &[u8]) -> StoreResult<Vec<StoredHeader>> {
    serde_json::from_slice(bytes).map_err(|e| corrupt(e.to_string()))
}

pub(crate) fn int_of(v: &Value) -> Option<i64> {
    match v {
        Value::Int(n) => Some(*n),
        Value::BulkString(b) => std::str::from_utf8(b).ok()?.parse().ok(),
        Value::SimpleString(s) => s.parse().ok(),
        _ => None,
    }
}

pub(crate) fn bytes_of(v: Value) -> Option<Vec<u8>> {
    match v {
        Value::BulkString(b) => Some(b),
        Value::SimpleString(s) => Some(s.into_bytes()),
        _ => None,
    }
}

pub(crate) fn decode_claim(reply: Value, expires: Millis) -> StoreResult<ClaimOutcome> {
    let Value::Array(items) = reply else {
        return Err(corrupt(format!("claim script returned {reply:?}")));
    };
    let bad = || corrupt("claim script returned an unexpected reply");
    let mut items = items.into_iter();
    let code = items.next().as_ref().and_then(int_of).ok_or_else(bad)?;
    match code {
        1 => {
            let token = items.next().as_ref().and_then(int_of).ok_or_else(bad)?;
            let resumed_from = match items.next().and_then(bytes_of) {
                Some(rp) => Some(String::from_utf8(rp).map_err(|e| corrupt(e.to_string()))?),
                None => None,
            };
            // The stored expiry: a re-delivered claim reports the first delivery's.
            let expires_at = items.next().as_ref().and_then(int_of).map_or(expires, Millis);
            Ok(ClaimOutcome::Claimed(Lease {
                token: FencingToken(token),
                expires_at,
                resumed_from,
            }))
        }
        2 => {
            let status = items.next().as_ref().and_then(int_of).ok_or_else(bad)?;
            let headers = items.next().and_then(bytes_of).unwrap_or_default();
            let body = items.next().and_then(bytes_of).unwrap_or_default();
            Ok(ClaimOutcome::Replay(StoredResponse {
                status: u16::try_from(status).map_err(|_| corrupt(format!("status {status}")))?,
                headers: if headers.is_empty() {
                    Vec::new()
                } else {
                    from_json(&headers)?
                },
                body,
            }))
        }
        3 => Ok(ClaimOutcome::Mismatch),
        5 => Ok(ClaimOutcome::Stale),
        6 => Ok(ClaimOutcome::Parked),
        4 => {
            let left = items.next().as_ref().and_then(int_of).ok_or_else(bad)?;
            Ok(ClaimOutcome::InProgress {
                retry_after: Duration::from_millis(u64::try_from(left).unwrap_or(0)),
            })
        }
        _ => Err(bad()),
    }
}

/// Decodes a review entry the reap script wrote: `len:bytes` items,
/// alternating field names and values.
pub(crate) fn decode_review(scope: &Scope, encoded: &[u8]) -> StoreResult<ReviewEntry> {
    let bad = || corrupt("review entry is malformed");
    let mut items = Vec::new();
    let mut rest = encoded;
    while !rest.is_empty() {
        let colon = rest.iter().position(|&b| b == b':').ok_or_else(bad)?;
        let len: usize = std::str::from_utf8(&rest[..colon])
            .ok()
            .and_then(|s| s.parse().ok())
            .ok_or_else(bad)?;
        let value = rest.get(colon + 1..colon + 1 + len).ok_or_else(bad)?;
        items.push(value.to_vec());
        rest = &rest[colon + 1 + len..];
    }
    if items.len() % 2 != 0 {
        return Err(bad());
    }
    let mut fields = HashMap::new();
    let mut it = items.into_iter();
    while let (Some(name), Some(value)) = (it.next(), it.next()) {
        fields.insert(String::from_utf8(name).map_err(|_| bad())?, value);
    }
    let text = |f: &mut HashMap<String, Vec<u8>>, name: &str| -> StoreResult<Option<String>> {
        f.remove(name)
            .map(|b| String::from_utf8(b).map_err(|_| corrupt(format!("{name} is not UTF-8"))))
            .transpose()
    };
    let num = |f: &mut HashMap<String, Vec<u8>>, name: &str| -> StoreResult<i64> {
        text(f, name)?
            .and_then(|s| s.parse::<i64>().ok())
            .ok_or_else(|| corrupt(format!("review entry {name}")))
    };
    let state = text(&mut fields, "state")?.unwrap_or_default();
    let mut step_outputs = BTreeMap::new();
    for (name, value) in &fields {
        if let Some(step) = name.strip_prefix("step:") {
            let value = serde_json::from_slice(value).map_err(|e| corrupt(e.to_string()))?;
            step_outputs.insert(step.to_owned(), value);
        }
    }
    Ok(ReviewEntry {
        scope: scope.clone(),
        state: RecordState::parse(&state).ok_or_else(|| corrupt(format!("state {state}")))?,
        created_at: Millis(num(&mut fields, "created_at")?),
        reaped_at: Millis(num(&mut fields, "reaped_at")?),
        recovery_point: text(&mut fields, "recovery_point")?,
        step_outputs,
        last_error: text(&mut fields, "last_error")?,
        request: StoredRequest {
            method: text(&mut fields, "request_method")?.unwrap_or_default(),
            path: text(&mut fields, "request_path")?.unwrap_or_default(),
            headers: from_json(&fields.remove("request_headers").unwrap_or_else(|| b"[]".to_vec()))?,
            body: fields.remove("request_body").unwrap_or_default(),
        },
    })
}

pub(crate) fn decode_record(scope: &Scope, mut f: HashMap<String, Vec<u8>>) -> StoreResult<Record> {
    fn text(f: &mut HashMap<String, Vec<u8>>, name: &str) -> StoreResult<Option<String>> {
        f.remove(name)
            .map(|b| String::from_utf8(b).map_err(|_| corrupt(format!("{name} is not UTF-8"))))
            .transpose()
    }
    fn num(f: &mut HashMap<String, Vec<u8>>, name: &str) -> StoreResult<Option<i64>> {
        text(f, name)?
            .map(|s| s.parse::<i64>().map_err(|_| corrupt(format!("{name} = {s:?}"))))
            .transpose()
    }
    let need = |name: &str| corrupt(format!("record has no {name}"));
    let state = text(&mut f, "state")?.ok_or_else(|| need("state"))?;
    let fingerprint: [u8; 32] = f
        .remove("fingerprint")
        .ok_or_else(|| need("fingerprint"))?
        .try_into()
        .map_err(|_| corrupt("fingerprint is not 32 bytes"))?;
    let response = match num(&mut f, "response_status")? {
        Some(status) => Some(StoredResponse {
            status: u16::try_from(status).map_err(|_| corrupt(format!("status {status}")))?,
            headers: from_json(&f.remove("response_headers").unwrap_or_else(|| b"[]".to_vec()))?,
            body: f.remove("response_body").unwrap_or_default(),
        }),
        None => None,
    };
    let mut step_outputs = BTreeMap::new();
    for (name, value) in f.iter() {
        if let Some(step) = name.strip_prefix("step:") {
            let value = serde_json::from_slice(value).map_err(|e| corrupt(e.to_string()))?;
            step_outputs.insert(step.to_owned(), value);
        }
    }
    Ok(Record {
        scope: scope.clone(),
        fingerprint: Fingerprint::from_bytes(fingerprint),
        state: RecordState::parse(&state).ok_or_else(|| corrupt(format!("state {state}")))?,
        created_at: Millis(num(&mut f, "created_at")?.ok_or_else(|| need("created_at"))?),
        completed_at: num(&mut f, "completed_at")?.map(Millis),
        lease_expires_at: Millis(num(&mut f, "lease_expires_at")?.ok_or_else(|| need("lease_expires_at"))?),
        fencing_token: FencingToken(num(&mut f, "token")?.ok_or_else(|| need("token"))?),
        recovery_point: text(&mut f, "recovery_point")?,
        step_outputs,
        request: StoredRequest {
            method: text(&mut f, "request_method")?.unwrap_or_default(),
            path: text(&mut f, "request_path")?.unwrap_or_default(),
            headers: from_json(&f.remove("request_headers").unwrap_or_else(|| b"[]".to_vec()))?,
            body: f.remove("request_body").unwrap_or_default(),
        },
        response,
        last_error: text(&mut f, "last_error")?,
    })
}

//! The Lua scripts. Each operation is one script, so one round trip, and Redis
//! runs a script atomically: nothing interleaves between its read and its write.
//!
//! Conventions shared by every script:
//! - `KEYS[1]` is the record (a hash), `KEYS[2]` (when present) its change channel;
//!   both carry the account's hash tag, so they share a cluster slot.
//! - Times are the store's clock: the server's `TIME` in milliseconds, so every
//!   instance judges leases by one clock (SPEC §3). A test clock may pass its
//!   time in instead (a non-empty "now" argument).
//! - The fencing token is a decimal string compared byte for byte and increased
//!   only with `HINCRBY` (exact 64-bit arithmetic, never a Lua double).
//! - Every lease-holder write starts with the same guard: the caller's token is
//!   the record's current one and the record is `in_flight`; otherwise the script
//!   writes nothing and returns 0 (the caller maps that to `Fenced`).
//! - The key's TTL is the reap threshold (`keep_ms`, at least the replay window);
//!   whether a completed record replays is decided from its stored timestamps.

use std::sync::LazyLock;

use redis::Script;

/// The store's clock in Lua: the test clock's time when one is passed in
/// (`arg` non-empty), the server's `TIME` otherwise.
macro_rules! now_fn {
    () => {
        r#"
local function now_ms(arg)
  if arg ~= '' then return tonumber(arg) end
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
"#
    };
}

/// Claim: implements `idemkit_core::ClaimRequest::decide` exactly.
///
/// ARGV: now ('' for the server's clock), lease length, replay window, keep,
/// fingerprint, method, path, headers (JSON), body, touch-on-replay ("1" in
/// WAIT mode), attempt id, resumed token ('' unless the completer resumes).
///
/// The attempt id makes a re-delivered claim (the client retried after losing
/// the reply) answer `Claimed` to its own request rather than `InProgress`.
///
/// Returns `{1, token, recovery_point|nil, lease_expiry}` claimed, `{2, status, headers, body}`
/// replay, `{3}` mismatch, `{4, retry_after_ms}` in progress, `{5}` a resume
/// that found the record no longer as it saw it.
const CLAIM: &str = concat!(
    now_fn!(),
    r#"
local k = KEYS[1]
local now = now_ms(ARGV[1])
local expires = now + tonumber(ARGV[2])
local resume = ARGV[12]
local window = tonumber(ARGV[3])
local keep = tonumber(ARGV[4])
local fp = ARGV[5]
local h = redis.call('HMGET', k, 'state', 'fingerprint', 'created_at', 'completed_at', 'lease_expires_at', 'token',
  'attempt')
local state = h[1]
local takeover = false
if state then
  if state == 'completed' then
    local done = tonumber(h[4] or h[3])
    if done + window > now then
      if h[2] ~= fp then return {3} end
      if ARGV[10] == '1' then
        -- A write, so that a following WAIT covers the completion being replayed.
        redis.call('HINCRBY', k, 'replays', 1)
      end
      local r = redis.call('HMGET', k, 'response_status', 'response_headers', 'response_body')
      return {2, r[1], r[2], r[3]}
    end
  elseif state == 'in_flight' then
    local lease = tonumber(h[5])
    if lease > now then
      if h[7] == ARGV[11] then return {1, h[6], redis.call('HGET', k, 'recovery_point'), h[5]} end
      if h[2] ~= fp then return {3} end
      return {4, lease - now}
    end
    -- The replay window applies to completed records only: unfinished work is
    -- taken over (progress and generation kept) however old it is.
    if h[2] ~= fp then return {3} end
    if resume ~= '' and h[6] ~= resume then return {5} end
    takeover = true
  elseif state ~= 'released' then
    return redis.error_reply('ERR idemkit: corrupt record state')
  end
end
if resume ~= '' and not takeover then return {5} end
if takeover then
  local tok = redis.call('HINCRBY', k, 'token', 1)
  redis.call('HSET', k, 'lease_expires_at', expires, 'attempt', ARGV[11])
  redis.call('PEXPIRE', k, keep + expires - now)
  return {1, tok, redis.call('HGET', k, 'recovery_point'), expires}
end
if state then
  -- Reuse (released, or past the replay window): a clean slate, but the token
  -- keeps growing so no earlier holder can ever write again.
  local old = h[6]
  redis.call('DEL', k)
  redis.call('HSET', k, 'token', old)
end
local tok = redis.call('HINCRBY', k, 'token', 1)
redis.call('HSET', k, 'state', 'in_flight', 'fingerprint', fp, 'created_at', now,
  'lease_expires_at', expires, 'keep_ms', ARGV[4], 'request_method', ARGV[6],
  'request_path', ARGV[7], 'request_headers', ARGV[8], 'request_body', ARGV[9], 'attempt', ARGV[11])
redis.call('PEXPIRE', k, keep + expires - now)
return {1, tok, false, expires}
"#
);

/// The guard every lease-holder write starts with. Leaves `k`, `wid` and `keep`
/// in scope; every body records `wid` as `last_write` in its `HSET`.
///
/// The last ARGV of every fenced script is a write id, unique per call: the same
/// write delivered twice (the client retried after losing the reply) succeeds
/// twice instead of being refused by its own first delivery (even when that
/// delivery moved the record to a new token, as abandon does).
macro_rules! fenced {
    ($body:literal) => {
        concat!(
            now_fn!(),
            r#"
local k = KEYS[1]
local wid = ARGV[#ARGV]
local h = redis.call('HMGET', k, 'token', 'state', 'keep_ms', 'last_write')
if h[4] == wid then return 1 end
if h[1] ~= ARGV[1] or h[2] ~= 'in_flight' then return 0 end
local keep = tonumber(h[3]) or 0
"#,
            $body
        )
    };
}

/// Heartbeat. ARGV: token, now ('' for the server's clock), lease length, write id.
const HEARTBEAT: &str = fenced!(
    r#"
local expires = now_ms(ARGV[2]) + tonumber(ARGV[3])
redis.call('HSET', k, 'lease_expires_at', expires, 'last_write', wid)
if keep > 0 then redis.call('PEXPIRE', k, keep + tonumber(ARGV[3])) end
return 1
"#
);

/// Complete. ARGV: token, now ('' for the server's clock), status, headers
/// (JSON), body, publish command, write id.
const COMPLETE: &str = fenced!(
    r#"
redis.call('HSET', k, 'state', 'completed', 'completed_at', now_ms(ARGV[2]), 'response_status', ARGV[3],
  'response_headers', ARGV[4], 'response_body', ARGV[5], 'last_write', wid)
redis.call('HDEL', k, 'last_error')
if keep > 0 then redis.call('PEXPIRE', k, keep) end
if ARGV[6] ~= '' then redis.call(ARGV[6], KEYS[2], ARGV[1]) end
return 1
"#
);

/// Release: the record stays (state `released`) so tokens keep growing. A
/// record with recorded progress (a recovery point, set by every phase and
/// intent) is abandoned instead, on a new token.
/// ARGV: token, publish command, now ('' for the server's clock), refusal
/// message, write id.
const RELEASE: &str = fenced!(
    r#"
redis.call('HINCRBY', k, 'token', 1)
if redis.call('HEXISTS', k, 'recovery_point') == 1 then
  redis.call('HSET', k, 'lease_expires_at', now_ms(ARGV[3]), 'last_error', ARGV[4], 'last_write', wid)
else
  redis.call('HSET', k, 'state', 'released', 'lease_expires_at', '0', 'request_body', '', 'last_write', wid)
end
if keep > 0 then redis.call('PEXPIRE', k, keep) end
if ARGV[2] ~= '' then redis.call(ARGV[2], KEYS[2], ARGV[1]) end
return 1
"#
);

/// Abandon: ends the lease now, keeps the record resumable, and moves it to a
/// new token so a heartbeat of the old holder still on its way is refused.
/// ARGV: token, now ('' for the server's clock), error, publish command, write id.
const ABANDON: &str = fenced!(
    r#"
redis.call('HINCRBY', k, 'token', 1)
redis.call('HSET', k, 'lease_expires_at', now_ms(ARGV[2]), 'last_error', ARGV[3], 'last_write', wid)
if keep > 0 then redis.call('PEXPIRE', k, keep) end
if ARGV[4] ~= '' then redis.call(ARGV[4], KEYS[2], ARGV[1]) end
return 1
"#
);

/// Phase advance: records a recovery point and optionally one step's output.
/// ARGV: token, recovery point, step name ('' for none), step output (JSON), write id.
const PHASE: &str = fenced!(
    r#"
redis.call('HSET', k, 'recovery_point', ARGV[2], 'last_write', wid)
if ARGV[3] ~= '' then redis.call('HSET', k, 'step:' .. ARGV[3], ARGV[4]) end
return 1
"#
);

/// The compiled scripts (their SHA-1 is computed once).
pub(crate) struct Scripts {
    pub(crate) claim: Lua,
    pub(crate) heartbeat: Lua,
    pub(crate) complete: Lua,
    pub(crate) release: Lua,
    pub(crate) abandon: Lua,
    pub(crate) phase: Lua,
}

/// A script's source and hash.
pub(crate) struct Lua {
    pub(crate) name: &'static str,
    pub(crate) source: &'static str,
    pub(crate) script: Script,
}

impl Lua {
    fn new(name: &'static str, source: &'static str) -> Self {
        Self {
            name,
            source,
            script: Script::new(source),
        }
    }

    /// The SHA-1 `EVALSHA` uses.
    pub(crate) fn hash(&self) -> &str {
        self.script.get_hash()
    }
}

pub(crate) static SCRIPTS: LazyLock<Scripts> = LazyLock::new(|| Scripts {
    claim: Lua::new("claim", CLAIM),
    heartbeat: Lua::new("heartbeat", HEARTBEAT),
    complete: Lua::new("complete", COMPLETE),
    release: Lua::new("release", RELEASE),
    abandon: Lua::new("abandon", ABANDON),
    phase: Lua::new("phase", PHASE),
});

impl Scripts {
    /// Every script, for preloading.
    pub(crate) fn all(&self) -> [&Lua; 6] {
        [
            &self.claim,
            &self.heartbeat,
            &self.complete,
            &self.release,
            &self.abandon,
            &self.phase,
        ]
    }
}

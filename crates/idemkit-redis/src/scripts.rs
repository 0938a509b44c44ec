//! The Lua scripts. Each operation is one script, so one round trip, and Redis
//! runs a script atomically: nothing interleaves between its read and its write.
//!
//! Conventions shared by every script:
//! - `KEYS[1]` is the record (a hash), `KEYS[2]` (when present) its change channel,
//!   `KEYS[3]` (`KEYS[2]` for the claim) the account's token high-water mark;
//!   all carry the account's hash tag, so they share a cluster slot.
//! - Times are the store's clock: the server's `TIME` in milliseconds, so every
//!   instance judges leases by one clock (the behaviour contract, `docs/spec.md` §3). A test clock may pass its
//!   time in instead (a non-empty "now" argument).
//! - The fencing token is a decimal string compared byte for byte. Every new
//!   token comes from the account's high-water mark (`INCR`, exact 64-bit
//!   arithmetic), a key with no TTL that outlives every record of the account:
//!   a record deleted by the reaper or by its TTL and claimed again gets a token
//!   above every token it ever had, so a stale holder can never write to it.
//! - Every lease-holder write starts with the same guard: the caller's token is
//!   the record's current one and the record is `in_flight`; otherwise the script
//!   writes nothing and returns 0 (the caller maps that to `Fenced`).
//! - TTL: completed and released records expire after the reap threshold
//!   (`keep_ms`, at least the replay window; whether a completed record replays
//!   is decided from its stored timestamps). Unfinished records (in flight,
//!   parked) never expire: they keep their progress and intents until they
//!   complete or an operator acts (the reaper lists them for review and keeps
//!   them parked).

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

/// The next fencing token of a record whose current token is `cur` (a
/// decimal string, or false for none): one above both the account's
/// high-water mark `seqk` and `cur` (a record written before the mark existed).
/// Returned as the decimal string Redis stores.
macro_rules! token_fn {
    () => {
        r#"
local function num_less(a, b)
  return #a < #b or (#a == #b and a < b)
end
local function next_token(seqk, cur)
  if cur then
    local s = redis.call('GET', seqk)
    if (not s) or num_less(s, cur) then redis.call('SET', seqk, cur) end
  end
  redis.call('INCR', seqk)
  return redis.call('GET', seqk)
end
local function has_progress(k)
  if redis.call('HEXISTS', k, 'recovery_point') == 1 then return true end
  for _, f in ipairs(redis.call('HKEYS', k)) do
    if string.sub(f, 1, 5) == 'step:' then return true end
  end
  return false
end
"#
    };
}

/// The write ids a record remembers (field `writes`): the ids of its latest
/// state-changing lease-holder writes (phase, complete, release, abandon,
/// park), newest first, space-separated, at most `WRITES_KEPT` of them.
/// Heartbeats keep their own one id (`last_write`), so the heartbeat timer
/// never pushes a phase's id out. A re-sent write whose id is remembered is
/// answered as applied and writes nothing, whatever ran in between.
macro_rules! writes_fn {
    () => {
        r#"
local WRITES_KEPT = 8
local function remembered(list, wid)
  return list ~= false and list ~= nil and string.find(' ' .. list .. ' ', ' ' .. wid .. ' ', 1, true) ~= nil
end
local function remember(list, wid)
  local out = {wid}
  if list then
    for id in string.gmatch(list, '[^ ]+') do
      if #out >= WRITES_KEPT then break end
      out[#out + 1] = id
    end
  end
  return table.concat(out, ' ')
end
"#
    };
}

/// Claim: implements `idemkit_core::ClaimRequest::decide` exactly.
///
/// ARGV: now ('' for the server's clock), lease length, replay window, keep,
/// fingerprint, method, path, headers (JSON), body, touch-on-replay ("1" in
/// WAIT mode), attempt id, resumed token ('' unless the completer resumes),
/// the recovery point the claim starts at ('' for none).
///
/// The attempt id makes a re-delivered claim (the client retried after losing
/// the reply) answer `Claimed` to its own request rather than `InProgress`,
/// resuming from what the first delivery resumed from (kept in `resumed`).
///
/// Returns `{1, token, recovery_point|nil, lease_expiry}` claimed, `{2, status, headers, body}`
/// replay, `{3}` mismatch, `{4, retry_after_ms}` in progress, `{5}` a resume
/// that found the record no longer as it saw it, `{6}` parked.
///
/// KEYS: the record, the account's token high-water mark.
const CLAIM: &str = concat!(
    now_fn!(),
    token_fn!(),
    r#"
local k = KEYS[1]
local seqk = KEYS[2]
local now = now_ms(ARGV[1])
local expires = now + tonumber(ARGV[2])
local resume = ARGV[12]
local window = tonumber(ARGV[3])
local fp = ARGV[5]
local h = redis.call('HMGET', k, 'state', 'fingerprint', 'created_at', 'completed_at', 'lease_expires_at', 'token',
  'attempt', 'writes')
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
      if h[7] == ARGV[11] then return {1, h[6], redis.call('HGET', k, 'resumed'), h[5]} end
      if h[2] ~= fp then return {3} end
      return {4, lease - now}
    end
    -- The replay window applies to completed records only: unfinished work is
    -- taken over (progress and generation kept) however old it is.
    if h[2] ~= fp then return {3} end
    if resume ~= '' and h[6] ~= resume then return {5} end
    takeover = true
  elseif state == 'parked' then
    -- A human decides: never run again, whatever the window.
    if h[2] ~= fp then return {3} end
    return {6}
  elseif state ~= 'released' then
    return redis.error_reply('ERR idemkit: corrupt record state')
  end
end
if resume ~= '' and not takeover then return {5} end
local tok = next_token(seqk, h[6])
if takeover then
  -- A record without a recovery point takes the claim's.
  local point = redis.call('HGET', k, 'recovery_point')
  if not point and ARGV[13] ~= '' then point = ARGV[13] end
  redis.call('HSET', k, 'token', tok, 'lease_expires_at', expires, 'attempt', ARGV[11])
  if point then
    redis.call('HSET', k, 'recovery_point', point, 'resumed', point)
  else
    redis.call('HDEL', k, 'resumed')
  end
  -- Unfinished work never expires (see the module docs).
  redis.call('PERSIST', k)
  return {1, tok, point, expires}
end
if state then
  -- Reuse (released, or past the replay window): a clean slate; the token
  -- comes from the high-water mark, so no earlier holder can ever write again.
  redis.call('DEL', k)
end
redis.call('HSET', k, 'token', tok, 'state', 'in_flight', 'fingerprint', fp, 'created_at', now,
  'lease_expires_at', expires, 'keep_ms', ARGV[4], 'request_method', ARGV[6],
  'request_path', ARGV[7], 'request_headers', ARGV[8], 'request_body', ARGV[9], 'attempt', ARGV[11])
if ARGV[13] ~= '' then redis.call('HSET', k, 'recovery_point', ARGV[13]) end
-- The earlier holder's write ids outlive the clean slate: its release (or
-- completion) re-sent after this reuse is still answered as applied.
if h[8] then redis.call('HSET', k, 'writes', h[8]) end
return {1, tok, false, expires}
"#
);

/// The guard every lease-holder write starts with. Leaves `k`, `seqk`, `wid`,
/// `keep` and `writes` in scope; the heartbeat records `wid` as `last_write`,
/// every other body records `writes` (the remembered ids with `wid` added) as
/// `writes` in its `HSET`.
/// KEYS: the record, its change channel, the account's token high-water mark.
///
/// The last ARGV of every fenced script is a write id, unique per call: the same
/// write delivered twice (the client retried after losing the reply) succeeds
/// twice and writes once, instead of being refused by its own first delivery
/// (even when that delivery moved the record to a new token, as abandon does)
/// or applied twice (a phase re-sent after a heartbeat wrote in between).
macro_rules! fenced {
    ($body:literal) => {
        concat!(
            now_fn!(),
            token_fn!(),
            writes_fn!(),
            r#"
local k = KEYS[1]
local seqk = KEYS[3]
local wid = ARGV[#ARGV]
local h = redis.call('HMGET', k, 'token', 'state', 'keep_ms', 'last_write', 'writes')
if h[4] == wid or remembered(h[5], wid) then return 1 end
if h[1] ~= ARGV[1] or h[2] ~= 'in_flight' then return 0 end
local keep = tonumber(h[3]) or 0
local writes = remember(h[5], wid)
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
redis.call('PERSIST', k)
return 1
"#
);

/// Complete (and drop the request body: a completed record replays its
/// answer, nothing reads the request again). ARGV: token, now ('' for the
/// server's clock), status, headers (JSON), body, publish command, write id.
const COMPLETE: &str = fenced!(
    r#"
redis.call('HSET', k, 'state', 'completed', 'completed_at', now_ms(ARGV[2]), 'response_status', ARGV[3],
  'response_headers', ARGV[4], 'response_body', ARGV[5], 'writes', writes, 'request_body', '')
redis.call('HDEL', k, 'last_error')
if keep > 0 then redis.call('PEXPIRE', k, keep) end
if ARGV[6] ~= '' then redis.call(ARGV[6], KEYS[2], ARGV[1]) end
return 1
"#
);

/// Release: the record stays (state `released`) so tokens keep growing. A
/// record with recorded progress (a recovery point, set by every phase and
/// intent) is abandoned instead, on a new token.
/// With ARGV[5] = '1' (`release_discarding`) the progress is discarded first,
/// so the record is released.
/// ARGV: token, publish command, now ('' for the server's clock), refusal
/// message, discard ('1' or '0'), write id.
const RELEASE: &str = fenced!(
    r#"
local tok = next_token(seqk, h[1])
if ARGV[5] == '1' then
  redis.call('HDEL', k, 'recovery_point')
  for _, f in ipairs(redis.call('HKEYS', k)) do
    if string.sub(f, 1, 5) == 'step:' then redis.call('HDEL', k, f) end
  end
end
if has_progress(k) then
  redis.call('HSET', k, 'token', tok, 'lease_expires_at', now_ms(ARGV[3]), 'last_error', ARGV[4],
    'writes', writes)
  redis.call('PERSIST', k)
else
  redis.call('HSET', k, 'token', tok, 'state', 'released', 'lease_expires_at', '0', 'request_body', '',
    'writes', writes)
  if keep > 0 then redis.call('PEXPIRE', k, keep) end
end
if ARGV[2] ~= '' then redis.call(ARGV[2], KEYS[2], ARGV[1]) end
return 1
"#
);

/// Abandon: ends the lease now, keeps the record resumable, and moves it to a
/// new token so a heartbeat of the old holder still on its way is refused.
/// ARGV: token, now ('' for the server's clock), error, publish command, write id.
const ABANDON: &str = fenced!(
    r#"
redis.call('HSET', k, 'token', next_token(seqk, h[1]), 'lease_expires_at', now_ms(ARGV[2]),
  'last_error', ARGV[3], 'writes', writes)
redis.call('PERSIST', k)
if ARGV[4] ~= '' then redis.call(ARGV[4], KEYS[2], ARGV[1]) end
return 1
"#
);

/// Redis's integer rules for `INCRBY` (its `string2ll`), in Lua with exact
/// 64-bit range checks. Lua numbers are doubles (exact to 2^53 only), so
/// integers stay decimal strings throughout: parsed by pattern, compared by
/// length then bytes, added digit by digit.
macro_rules! int_fn {
    () => {
        r#"
local I64_MAX, I64_MIN_MAG = '9223372036854775807', '9223372036854775808'
-- Magnitudes: decimal digit strings without leading zeros. Compared byte by
-- byte (Lua's `<` on strings follows the server's collation locale).
local function mag_less(a, b)
  if #a ~= #b then return #a < #b end
  for i = 1, #a do
    local x, y = string.byte(a, i), string.byte(b, i)
    if x ~= y then return x < y end
  end
  return false
end
-- string2ll: "0", or an optional '-' and a digit 1-9 followed by digits,
-- nothing else (no '+', no spaces, no leading zeros, no "-0"), within
-- [-2^63, 2^63 - 1]. Returns sign (1 or -1) and magnitude, or nil.
local function parse_i64(s)
  if s == '0' then return 1, '0' end
  local neg, mag = string.match(s, '^(%-?)([1-9][0-9]*)$')
  if not mag then return nil end
  if neg == '-' then
    if mag_less(I64_MIN_MAG, mag) then return nil end
    return -1, mag
  end
  if mag_less(I64_MAX, mag) then return nil end
  return 1, mag
end
local function mag_add(a, b)
  local out, carry, i, j = {}, 0, #a, #b
  while i > 0 or j > 0 or carry > 0 do
    local d = carry
    if i > 0 then d = d + string.byte(a, i) - 48 end
    if j > 0 then d = d + string.byte(b, j) - 48 end
    if d >= 10 then d, carry = d - 10, 1 else carry = 0 end
    out[#out + 1] = string.char(48 + d)
    i, j = i - 1, j - 1
  end
  return string.reverse(table.concat(out))
end
-- a - b for magnitudes with b <= a.
local function mag_sub(a, b)
  local out, borrow, i, j = {}, 0, #a, #b
  while i > 0 do
    local d = string.byte(a, i) - 48 - borrow
    if j > 0 then d = d - (string.byte(b, j) - 48) end
    if d < 0 then d, borrow = d + 10, 1 else borrow = 0 end
    out[#out + 1] = string.char(48 + d)
    i, j = i - 1, j - 1
  end
  local r = string.gsub(string.reverse(table.concat(out)), '^0+', '')
  if r == '' then return '0' end
  return r
end
-- The decimal string Redis stores for a + b, or nil outside the signed 64-bit
-- range (where INCRBY answers "increment or decrement would overflow").
local function add_i64(sa, ma, sb, mb)
  local sign, mag
  if sa == sb then
    sign, mag = sa, mag_add(ma, mb)
  elseif mag_less(ma, mb) then
    sign, mag = sb, mag_sub(mb, ma)
  else
    sign, mag = sa, mag_sub(ma, mb)
  end
  if mag == '0' then return '0' end
  if sign < 0 then
    if mag_less(I64_MIN_MAG, mag) then return nil end
    return '-' .. mag
  end
  if mag_less(I64_MAX, mag) then return nil end
  return mag
end
"#
    };
}

/// Phase advance: records a recovery point and optionally one step's output,
/// and applies the application's business writes in the same script, all or
/// none. Redis keeps what a script wrote before an error, so the script must
/// not be able to fail once it has written: the whole batch is first run
/// against a simulated key space (each key's type as the batch's own earlier
/// writes leave it, values read up front, `INCRBY` checked with Redis's
/// integer rules and 64-bit range), and only a batch that passes is applied.
/// (Redis refuses a script's write for OOM only at its first write; a
/// read-only replica, MISCONF and NOREPLICAS are server states that do not
/// change while a script runs. So those refuse the first write too.)
/// KEYS: the record, its channel, the token high-water mark, then one key per
/// business write. ARGV: token, recovery point, step name ('' for none), step
/// output (JSON), the number of writes n, then n × (op, field, value), write id.
/// Returns 1, 0 when fenced, or `{i, reason}` when write i would be refused
/// (nothing written).
const PHASE: &str = concat!(
    int_fn!(),
    fenced!(
        r#"
local n = tonumber(ARGV[5])
-- key -> {t = its type, v = its string value, read = whether v is known}
local sim = {}
for i = 1, n do
  local op, value, key = ARGV[3 + 3 * i], ARGV[5 + 3 * i], KEYS[3 + i]
  local s = sim[key]
  if not s then
    s = { t = redis.call('TYPE', key)['ok'], read = false }
    sim[key] = s
  end
  if op == 'SET' then
    s.t, s.v, s.read = 'string', value, true
  elseif op == 'DEL' then
    s.t, s.v, s.read = 'none', nil, true
  elseif op == 'HSET' or op == 'SADD' then
    local want = 'hash'
    if op == 'SADD' then want = 'set' end
    if s.t ~= 'none' and s.t ~= want then
      return {i, 'WRONGTYPE: the key holds a ' .. s.t .. ' here, not a ' .. want}
    end
    s.t = want
  elseif op == 'INCRBY' then
    if s.t ~= 'none' and s.t ~= 'string' then
      return {i, 'WRONGTYPE: the key holds a ' .. s.t .. ' here, not an integer'}
    end
    local cur = '0'
    if s.t == 'string' then
      if not s.read then s.v, s.read = redis.call('GET', key), true end
      cur = s.v
    end
    local sa, ma = parse_i64(cur)
    if not sa then return {i, 'the value here is not a 64-bit integer by Redis rules'} end
    local sb, mb = parse_i64(value)
    if not sb then return {i, 'the increment is not a 64-bit integer by Redis rules'} end
    local r = add_i64(sa, ma, sb, mb)
    if not r then return {i, 'the result would overflow a signed 64-bit integer'} end
    s.t, s.v, s.read = 'string', r, true
  else
    return {i, 'unknown operation'}
  end
end
for i = 1, n do
  local op, field, value, key = ARGV[3 + 3 * i], ARGV[4 + 3 * i], ARGV[5 + 3 * i], KEYS[3 + i]
  if op == 'SET' then redis.call('SET', key, value)
  elseif op == 'HSET' then redis.call('HSET', key, field, value)
  elseif op == 'INCRBY' then redis.call('INCRBY', key, value)
  elseif op == 'SADD' then redis.call('SADD', key, value)
  elseif op == 'DEL' then redis.call('DEL', key)
  end
end
redis.call('HSET', k, 'recovery_point', ARGV[2], 'writes', writes)
if ARGV[3] ~= '' then redis.call('HSET', k, 'step:' .. ARGV[3], ARGV[4]) end
return 1
"#
    )
);

/// Park: ends the lease, never runs again (the claim answers parked), on a new
/// token. Unfinished, so no TTL. ARGV: token, now ('' for the server's clock),
/// reason, publish command, write id.
const PARK: &str = fenced!(
    r#"
redis.call('HSET', k, 'token', next_token(seqk, h[1]), 'state', 'parked', 'lease_expires_at', now_ms(ARGV[2]),
  'last_error', ARGV[3], 'writes', writes)
redis.call('PERSIST', k)
if ARGV[4] ~= '' then redis.call(ARGV[4], KEYS[2], ARGV[1]) end
return 1
"#
);

/// An operator's release (`force_release`, or with ARGV[4] = '1'
/// `discard_progress`) of a record nobody holds: parked, or in flight with an
/// expired lease by the store's clock. Not fenced by a token: the state check
/// is the guard. The record moves to a new token; without recorded progress
/// (or when discarding it) it becomes `released`, else resumable (in flight,
/// lease ended, progress kept).
/// KEYS: the record, its change channel, the token high-water mark.
/// ARGV: now ('' for the server's clock), last error, publish command,
/// discard ('1' or '0'), keep for a record without one (ms).
/// Returns 1 when released, 0 when nothing changed.
const FORCE_RELEASE: &str = concat!(
    now_fn!(),
    token_fn!(),
    r#"
local k = KEYS[1]
local h = redis.call('HMGET', k, 'state', 'lease_expires_at', 'token', 'keep_ms')
local state = h[1]
if not state then return 0 end
local now = now_ms(ARGV[1])
local lease = tonumber(h[2]) or 0
if not (state == 'parked' or (state == 'in_flight' and lease <= now)) then return 0 end
local tok = next_token(KEYS[3], h[3])
local keep = tonumber(h[4]) or tonumber(ARGV[5])
if ARGV[4] == '1' then
  redis.call('HDEL', k, 'recovery_point')
  for _, f in ipairs(redis.call('HKEYS', k)) do
    if string.sub(f, 1, 5) == 'step:' then redis.call('HDEL', k, f) end
  end
end
if has_progress(k) then
  if lease > now then lease = now end
  redis.call('HSET', k, 'token', tok, 'state', 'in_flight', 'lease_expires_at', lease, 'last_error', ARGV[2])
  redis.call('PERSIST', k)
else
  redis.call('HSET', k, 'token', tok, 'state', 'released', 'lease_expires_at', '0', 'request_body', '',
    'last_error', ARGV[2])
  if keep > 0 then redis.call('PEXPIRE', k, keep) end
end
if ARGV[3] ~= '' then redis.call(ARGV[3], KEYS[2], tok) end
return 1
"#
);

/// One reaper batch. KEYS: triples (record, its review hash, the account's
/// token high-water mark). ARGV: now ('' for the server's clock), before,
/// the last error of a record moved to review.
///
/// A record that never completed (parked, or in flight with an expired lease)
/// and was claimed before `before` is listed once in its review hash (field:
/// its `created_at`, so one claim is listed once; value: the entry's fields,
/// each length-prefixed, binary safe) and stays, parked on a new token, with
/// no TTL. A completed record (by `completed_at`) or released one (by
/// `created_at`) older than `before` is deleted after the high-water mark has
/// been raised to its token. Returns `{deleted, moved}`.
const REAP: &str = concat!(
    now_fn!(),
    token_fn!(),
    r#"
local now = now_ms(ARGV[1])
local before = tonumber(ARGV[2])
local deleted, moved = 0, 0
local function enc(t)
  local parts = {}
  for _, v in ipairs(t) do parts[#parts + 1] = string.len(v) .. ':' .. v end
  return table.concat(parts)
end
for i = 1, #KEYS, 3 do
  local k, rk, seqk = KEYS[i], KEYS[i + 1], KEYS[i + 2]
  local h = redis.call('HMGET', k, 'state', 'created_at', 'completed_at', 'lease_expires_at', 'token')
  local state = h[1]
  if state then
    local created = tonumber(h[2])
    local lease = tonumber(h[4]) or 0
    if state == 'parked' or (state == 'in_flight' and lease <= now) then
      if created < before and redis.call('HEXISTS', rk, h[2]) == 0 then
        local f = redis.call('HGETALL', k)
        local entry = {'state', state, 'reaped_at', string.format('%.0f', now)}
        for j = 1, #f, 2 do
          local n = f[j]
          if n == 'created_at' or n == 'recovery_point' or n == 'last_error'
            or string.sub(n, 1, 8) == 'request_' or string.sub(n, 1, 5) == 'step:' then
            entry[#entry + 1] = n
            entry[#entry + 1] = f[j + 1]
          end
        end
        redis.call('HSET', rk, h[2], enc(entry))
        if lease > now then lease = now end
        redis.call('HSET', k, 'token', next_token(seqk, h[5]), 'state', 'parked', 'lease_expires_at', lease,
          'last_error', ARGV[3])
        redis.call('PERSIST', k)
        moved = moved + 1
      end
    elseif (state == 'completed' and tonumber(h[3] or h[2]) < before)
      or (state == 'released' and created < before) then
      local s = redis.call('GET', seqk)
      if h[5] and ((not s) or num_less(s, h[5])) then redis.call('SET', seqk, h[5]) end
      redis.call('DEL', k)
      deleted = deleted + 1
    end
  end
end
return {deleted, moved}
"#
);

/// Reads many hashes in one round trip (operator listings, the completer's
/// work list), filtering on the server. KEYS: the hashes. ARGV: mode (`all`,
/// `state` or `abandoned`), the state (mode `state`), now ('' for the
/// server's clock; mode `abandoned`), claimed-before (mode `abandoned`).
/// Returns a flat array: name, fields (as `HGETALL`), name, fields, …
const FETCH: &str = concat!(
    now_fn!(),
    r#"
local mode = ARGV[1]
local now = 0
if mode == 'abandoned' then now = now_ms(ARGV[3]) end
local out = {}
for _, k in ipairs(KEYS) do
  local ok = true
  if mode ~= 'all' then
    local h = redis.call('HMGET', k, 'state', 'lease_expires_at', 'created_at')
    if not h[1] then
      ok = false
    elseif mode == 'state' then
      ok = h[1] == ARGV[2]
    else
      ok = h[1] == 'in_flight' and tonumber(h[2]) <= now and tonumber(h[3]) <= tonumber(ARGV[4])
    end
  end
  if ok then
    local f = redis.call('HGETALL', k)
    if #f > 0 then
      out[#out + 1] = k
      out[#out + 1] = f
    end
  end
end
return out
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
    pub(crate) park: Lua,
    pub(crate) force_release: Lua,
    pub(crate) reap: Lua,
    pub(crate) fetch: Lua,
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
    park: Lua::new("park", PARK),
    force_release: Lua::new("force_release", FORCE_RELEASE),
    reap: Lua::new("reap", REAP),
    fetch: Lua::new("fetch", FETCH),
});

impl Scripts {
    /// Every script, for preloading.
    pub(crate) fn all(&self) -> [&Lua; 10] {
        [
            &self.claim,
            &self.heartbeat,
            &self.complete,
            &self.release,
            &self.abandon,
            &self.phase,
            &self.park,
            &self.force_release,
            &self.reap,
            &self.fetch,
        ]
    }
}

-- wrk script: the harness's order write with a fresh Idempotency-Key per request
-- (`<tag>-<thread>-<n>`), every status counted per thread and summed in done().
-- Usage: wrk -t2 -c16 -d5s -s fresh.lua http://127.0.0.1:PORT/orders -- TAG
local threads = {}
local next_id = 0

function setup(thread)
  next_id = next_id + 1
  thread:set("tid", next_id)
  table.insert(threads, thread)
end

function init(args)
  tag = args[1] or "wrk"
  counter = 0
  statuses = {}
  path = wrk.path
end

function request()
  counter = counter + 1
  return wrk.format("POST", path, {
    ["Authorization"] = "Bearer bench",
    ["Content-Type"] = "application/json",
    ["Idempotency-Key"] = tag .. "-" .. tid .. "-" .. counter,
  }, '{"sku":"BENCH-1","quantity":2}')
end

function response(status, headers, body)
  statuses[status] = (statuses[status] or 0) + 1
end

function done(summary, latency, requests)
  local total = {}
  for _, t in ipairs(threads) do
    for code, n in pairs(t:get("statuses")) do
      total[code] = (total[code] or 0) + n
    end
  end
  local seconds = summary.duration / 1e6
  local parts = {}
  for code, n in pairs(total) do
    table.insert(parts, code .. ":" .. n)
  end
  table.sort(parts)
  io.write(string.format("wrk-result requests=%d seconds=%.3f rps=%.1f p50_us=%d p99_us=%d errors=%d status=%s\n",
    summary.requests, seconds, summary.requests / seconds,
    latency:percentile(50), latency:percentile(99),
    summary.errors.connect + summary.errors.read + summary.errors.write + summary.errors.status + summary.errors.timeout,
    table.concat(parts, ",")))
end

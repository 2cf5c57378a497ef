-- wrk script: POST a fixed chat body; each connection's calls are grouped into runs of 20
-- (X-Run-Id), as an agent loop would send them. Parameters come from the environment:
--   BENCH_BODY    file holding the request body
--   BENCH_PATH    path and query to POST to
--   BENCH_KEY     API key sent as Authorization: Bearer (spanmeter tenant key or upstream key)
--   BENCH_RESULT  file the summary is written to as JSON (latency in microseconds)
--   BENCH_SEED    makes run ids unique per wrk invocation
--   BENCH_NO_RUN  (optional) send no X-Run-Id: every call is its own run
--   BENCH_NEXT    (optional) a chained run: the body of a run's every call after its first, with
--                 @CALL_ID@ where the tool call id of the previous answer goes (its call and result)

local f = assert(io.open(os.getenv("BENCH_BODY"), "rb"))
local body = f:read("*a")
f:close()
local path = os.getenv("BENCH_PATH") or "/v1/chat/completions"
local key = os.getenv("BENCH_KEY") or "sk-bench"
local seed = os.getenv("BENCH_SEED") or "0"
local threads = 0
local no_run = os.getenv("BENCH_NO_RUN") ~= nil
local next_head, last_id = nil, nil
if os.getenv("BENCH_NEXT") then
  local n = assert(io.open(os.getenv("BENCH_NEXT"), "rb"))
  local template = n:read("*a")
  n:close()
  -- split on the placeholder: head .. id .. middle .. id .. tail (the call and its result)
  next_head = {}
  for piece in (template .. "@CALL_ID@"):gmatch("(.-)@CALL_ID@") do
    next_head[#next_head + 1] = piece
  end
end
counter = 0
prefix = "r"

function setup(thread)
  threads = threads + 1
  thread:set("prefix", "s" .. seed .. "t" .. tostring(threads))
end

function request()
  local headers = {
    ["Content-Type"] = "application/json",
    ["Authorization"] = "Bearer " .. key,
  }
  if not no_run then
    headers["X-Run-Id"] = prefix .. "-" .. tostring(math.floor(counter / 20))
  end
  local payload = body
  if next_head and counter % 20 ~= 0 and last_id then
    payload = table.concat(next_head, last_id)
  end
  counter = counter + 1
  return wrk.format("POST", path, headers, payload)
end

if next_head then
  -- the next call carries the tool call this answer asked for (one connection: in order)
  function response(status, headers, resp)
    last_id = resp:match('"(call_%x+)"')
  end
end

function done(summary, latency, requests)
  local e = summary.errors
  local out = string.format(
    '{"requests": %d, "duration_us": %d, "bytes": %d, ' ..
    '"errors": {"connect": %d, "read": %d, "write": %d, "status": %d, "timeout": %d}, ' ..
    '"latency_us": {"p50": %d, "p90": %d, "p99": %d, "p999": %d, "mean": %.1f, "max": %d}}',
    summary.requests, summary.duration, summary.bytes,
    e.connect, e.read, e.write, e.status, e.timeout,
    latency:percentile(50), latency:percentile(90), latency:percentile(99), latency:percentile(99.9),
    latency.mean, latency.max)
  local r = assert(io.open(os.getenv("BENCH_RESULT"), "w"))
  r:write(out)
  r:close()
end

-- Admit one model call, atomically: close the tool calls its results answer (counting
-- the loop guard's streaks), keep the run's trace ids, read the admin budgets, bound the
-- stored context it names, then count the call and reserve its worst case on every scope,
-- or refuse. Mirrors SqliteStore.admit; the contract suite holds both to the same results.
-- KEYS: 1 run hash, 2 day hash, 3 month hash, 4 tenant total hash, 5 reservation hash,
--       6 expiry zset, 7 runs zset, 8 tenant runs zset, 9 active runs zset, 10 tools hash,
--       11 budget hash, 12.. one string key per stored-context ref
-- ARGV: 1 max calls, 2 run max cost, 3 day budget, 4 month budget (-1 = no limit),
--       5 min reserve, 6 max reserve, 7 now, 8 expires at, 9 run member, 10 run id,
--       11 window ttl seconds, 12 trace json ('' = none), 13 guard threshold (-1 = none),
--       14 guard refuses streaks (1/0), 15 max consecutive failures (-1 = none),
--       16 priced (1/0), 17 stored-context rate (micro-USD per million tokens),
--       18 number of results n, then n pairs: tool call id, '1' if the result is ok
if redis.call('EXISTS', KEYS[5]) == 1 then
  -- a retried admission (the reply to the first was lost): answer it again
  local f = redis.call('HMGET', KEYS[5], 'amount', 'calls')
  return {'dup', {}, '', tonumber(f[1]), tonumber(f[2])}
end

-- 1. Close the tool calls this request answers; the guard's state follows each.
local closed = {}
local n = tonumber(ARGV[18])
if n > 0 then
  local st = redis.call('HMGET', KEYS[1], 'sig', 'streak', 'failures')
  local sig, streak, failures = st[1], tonumber(st[2] or '0'), tonumber(st[3] or '0')
  local touched = false
  for i = 19, 18 + 2 * n, 2 do
    local cur = redis.call('HGET', KEYS[10], ARGV[i])
    if cur then
      redis.call('HDEL', KEYS[10], ARGV[i])
      local body = string.sub(cur, string.find(cur, '\t', 1, true) + 1)
      local call_sig = cjson.decode(body)['sig']
      if type(call_sig) ~= 'string' then call_sig = '' end
      if call_sig == sig then streak = streak + 1 else streak = 1 end
      sig = call_sig
      if ARGV[i + 1] == '1' then failures = 0 else failures = failures + 1 end
      table.insert(closed, body)
      table.insert(closed, streak)
      table.insert(closed, failures)
      table.insert(closed, ARGV[i + 1])
      touched = true
    end
  end
  if touched then
    redis.call('HSET', KEYS[1], 'sig', sig, 'streak', streak, 'failures', failures)
  end
end

-- 2. The run's trace ids: the first stored win.
local trace = ''
if ARGV[12] ~= '' then
  trace = redis.call('HGET', KEYS[1], 'trace')
  if not trace then
    trace = ARGV[12]
    redis.call('HSET', KEYS[1], 'trace', trace, 'run_id', ARGV[10])
    redis.call('HSETNX', KEYS[1], 'first_seen', ARGV[7])
    redis.call('HSETNX', KEYS[1], 'last_seen', ARGV[7])
    redis.call('ZADD', KEYS[7], ARGV[7], ARGV[9])
    redis.call('ZADD', KEYS[8], ARGV[7], ARGV[10])
    if redis.call('HGET', KEYS[1], 'ended') ~= '1' then
      redis.call('ZADD', KEYS[9], ARGV[7], ARGV[9])
    end
  end
end

-- 3. The loop guard's refusals (Python words the message from the closed calls).
local threshold, max_failures = tonumber(ARGV[13]), tonumber(ARGV[15])
if threshold >= 0 then
  for i = 1, #closed, 4 do
    if (max_failures >= 0 and closed[i + 2] >= max_failures)
        or (ARGV[14] == '1' and closed[i + 1] >= threshold) then
      return {'loop', closed, trace}
    end
  end
end

-- 4. Limits in force: the admin API's budgets over the config's.
local limits = {tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])}
local b = redis.call('HMGET', KEYS[11], 'day', 'month')
if b[1] then limits[2] = tonumber(b[1]) end
if b[2] then limits[3] = tonumber(b[2]) end
local budgets = {b[1] or '', b[2] or ''}
local costed = limits[1] >= 0 or limits[2] >= 0 or limits[3] >= 0

if costed and ARGV[16] ~= '1' then
  return {'unpriced', closed, trace, budgets[1], budgets[2]}
end

-- 5. Stored context: its remembered size is reserved as input; unseen refs cannot be bounded.
local context_tokens, unknown = 0, {}
for i = 12, #KEYS do
  local t = redis.call('GET', KEYS[i])
  if t then context_tokens = context_tokens + tonumber(t) else table.insert(unknown, KEYS[i]) end
end
if costed and #unknown > 0 then
  return {'context', closed, trace, budgets[1], budgets[2], unknown}
end
local extra = math.ceil(context_tokens * tonumber(ARGV[17]) / 1000000)

-- 6. Count the call and reserve, or refuse.
local calls = tonumber(redis.call('HGET', KEYS[1], 'calls') or '0')
local max_calls = tonumber(ARGV[1])
if max_calls >= 0 and calls >= max_calls then
  return {'refused', closed, trace, budgets[1], budgets[2], 'run_calls', calls, 0}
end

local names = {'run_cost', 'tenant_day', 'tenant_month'}
local head = {}
local tight, tight_i = nil, nil
for i = 1, 3 do
  local limit = limits[i]
  local v = redis.call('HMGET', KEYS[i], 'settled', 'reserved')
  local settled, reserved = tonumber(v[1] or '0'), tonumber(v[2] or '0')
  if limit >= 0 then
    head[i] = limit - settled - reserved
    if tight == nil or head[i] < tight then
      tight, tight_i = head[i], i
    end
  end
end

local min_r, max_r = tonumber(ARGV[5]) + extra, tonumber(ARGV[6]) + extra
if tight ~= nil and tight < min_r then
  local v = redis.call('HMGET', KEYS[tight_i], 'settled', 'reserved')
  return {'refused', closed, trace, budgets[1], budgets[2], names[tight_i],
          tonumber(v[1] or '0'), tonumber(v[2] or '0'), string.format('%d', extra)}
end
local amount = max_r
if tight ~= nil and tight < amount then
  amount = tight
end

for i = 1, 4 do
  redis.call('HINCRBY', KEYS[i], 'reserved', amount)
end
redis.call('EXPIRE', KEYS[2], ARGV[11])
redis.call('EXPIRE', KEYS[3], ARGV[11])
calls = redis.call('HINCRBY', KEYS[1], 'calls', 1)
redis.call('HSETNX', KEYS[1], 'first_seen', ARGV[7])
redis.call('HSET', KEYS[1], 'last_seen', ARGV[7], 'run_id', ARGV[10])
redis.call('HSET', KEYS[5], 'amount', amount, 'calls', calls, 'expired', '0',
  'run', KEYS[1], 'day', KEYS[2], 'month', KEYS[3], 'total', KEYS[4])
redis.call('ZADD', KEYS[6], ARGV[8], KEYS[5])
redis.call('ZADD', KEYS[7], ARGV[7], ARGV[9])
redis.call('ZADD', KEYS[8], ARGV[7], ARGV[10])
if redis.call('HGET', KEYS[1], 'ended') ~= '1' then
  redis.call('ZADD', KEYS[9], ARGV[7], ARGV[9])
end

local left = {}
for i = 1, 3 do
  -- %d, not tostring: tostring prints large numbers as 1e+15
  if head[i] == nil then left[i] = 'none' else left[i] = string.format('%d', head[i] - amount) end
end
return {'ok', closed, trace, budgets[1], budgets[2], string.format('%d', amount), calls,
        left[1], left[2], left[3], context_tokens}

-- Admit one model call, atomically: close the tool calls its results answer (counting
-- the loop guard's streaks), keep the run's trace ids, read the admin budgets, bound the
-- stored context it names, check the run's calls, tokens and wall time, then the cost
-- scopes, then the rate buckets (GCRA, proxy/ledger/rates.py), and count the call and
-- reserve its worst case on every scope, or refuse. Mirrors SqliteStore.admit; the
-- contract suite holds both to the same results.
-- Every key is one tenant's (`sm:{tenant}:...`, one Redis Cluster slot) and declared here.
-- KEYS: 1 run hash, 2 day hash, 3 month hash, 4 tenant total hash, 5 reservation hash,
--       6 the tenant's expiry zset, 7 the tenant's runs zset, 8 the tenant's active runs
--       zset (both by run id), 9 tools hash, 10 budget hash, 11 run totals hash, 12 key day
--       hash, 13 key month hash (both unused without a key), 14.. one hash per rate bucket,
--       then one string key per stored-context ref
-- ARGV: 1 max calls, 2 run max cost, 3 day budget, 4 month budget (-1 = no limit),
--       5 min reserve, 6 max reserve, 7 now, 8 expires at, 9 run id,
--       10 window ttl seconds, 11 trace json ('' = none), 12 guard threshold (-1 = none),
--       13 guard refuses streaks (1/0), 14 max consecutive failures (-1 = none),
--       15 priced (1/0), 16 stored-context rate (micro-USD per million tokens),
--       17 run max tokens, 18 run max seconds, 19 key day budget, 20 key month budget (-1 = none),
--       21 has a key (1/0), 22 now in ms, 23 number of rate buckets r, then r pairs: limit, cost,
--       then the number of results n, then n pairs: tool call id, '1' if the result is ok,
--       then the least and the most tokens the call may use, then (the last) the calls to
--       count (1 for a model call; a budget lease counts the calls it may serve)
if redis.call('EXISTS', KEYS[5]) == 1 then
  -- a retried admission (the reply to the first was lost): answer it again
  local f = redis.call('HMGET', KEYS[5], 'amount', 'calls', 'tokens')
  return {'dup', {}, '', tonumber(f[1]), tonumber(f[2]), tonumber(f[3] or '0')}
end

local has_key = ARGV[21] == '1'
local tokens_lo, tokens_hi = tonumber(ARGV[#ARGV - 2]), tonumber(ARGV[#ARGV - 1])
local count = tonumber(ARGV[#ARGV])
local r = tonumber(ARGV[23])
local n0 = 24 + 2 * r

-- 1. Close the tool calls this request answers; the guard's state follows each.
local closed = {}
local n = tonumber(ARGV[n0])
if n > 0 then
  local st = redis.call('HMGET', KEYS[1], 'sig', 'streak', 'failures')
  local sig, streak, failures = st[1], tonumber(st[2] or '0'), tonumber(st[3] or '0')
  local touched = false
  for i = n0 + 1, n0 + 2 * n, 2 do
    local cur = redis.call('HGET', KEYS[9], ARGV[i])
    if cur then
      redis.call('HDEL', KEYS[9], ARGV[i])
      local body = string.sub(cur, string.find(cur, '\t', 1, true) + 1)
      local call_sig = cjson.decode(body)['sig']
      if type(call_sig) ~= 'string' then call_sig = '' end
      -- Identical calls closed by one admission answer one model turn: one step (store.streak_of).
      if call_sig ~= sig then streak = 1 elseif not touched then streak = streak + 1 end
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
local trace = runtrace_keep(11, 9, 7)

-- 3. The loop guard's refusals (Python words the message from the closed calls).
local threshold, max_failures = tonumber(ARGV[12]), tonumber(ARGV[14])
if threshold >= 0 then
  for i = 1, #closed, 4 do
    if (max_failures >= 0 and closed[i + 2] >= max_failures)
        or (ARGV[13] == '1' and closed[i + 1] >= threshold) then
      return {'loop', closed, trace}
    end
  end
end

-- 4. Limits in force: the admin API's budgets over the config's.
local limits = {tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4]), -1, -1}
if has_key then
  limits[4], limits[5] = tonumber(ARGV[19]), tonumber(ARGV[20])
end
local b = redis.call('HMGET', KEYS[10], 'day', 'month')
if b[1] then limits[2] = tonumber(b[1]) end
if b[2] then limits[3] = tonumber(b[2]) end
local budgets = {b[1] or '', b[2] or ''}
local costed = false
for i = 1, 5 do
  if limits[i] >= 0 then costed = true end
end

if costed and ARGV[15] ~= '1' then
  return {'unpriced', closed, trace, budgets[1], budgets[2]}
end

-- 5. Stored context: its remembered size is reserved as input; unseen refs cannot be bounded.
local context_tokens, unknown = 0, {}
for i = 14 + r, #KEYS do
  local t = redis.call('GET', KEYS[i])
  if t then context_tokens = context_tokens + tonumber(t) else table.insert(unknown, KEYS[i]) end
end
if costed and #unknown > 0 then
  return {'context', closed, trace, budgets[1], budgets[2], unknown}
end
local extra = math.ceil(context_tokens * tonumber(ARGV[16]) / 1000000)

-- 6. The run's calls, tokens (settled, and held by its calls in flight) and wall time.
local run = redis.call('HMGET', KEYS[1], 'calls', 'first_seen', 'tokens_held', 'tokens_expired')
local calls = tonumber(run[1] or '0')
local held = tonumber(run[3] or '0')
local run_tokens, started = 0, ''
if tonumber(ARGV[17]) >= 0 then
  local t = redis.call('HMGET', KEYS[11], 'input_tokens', 'output_tokens', 'estimated_tokens')
  run_tokens = tonumber(t[1] or '0') + tonumber(t[2] or '0') + tonumber(t[3] or '0') + tonumber(run[4] or '0')
end
local elapsed = 0
if tonumber(ARGV[18]) >= 0 then
  started = run[2] or ARGV[7]
  elapsed = tonumber(ARGV[7]) - tonumber(started)
end
local function refused(scope, settled, reserved)
  return {'refused', closed, trace, budgets[1], budgets[2], scope, settled, reserved, string.format('%d', extra),
          string.format('%d', run_tokens), string.format('%.6f', elapsed), string.format('%d', held),
          string.format('%d', tokens_lo + context_tokens)}
end
local max_calls = tonumber(ARGV[1])
if max_calls >= 0 and calls + count > max_calls then
  return refused('run_calls', calls, 0)
end
local tokens = 0  -- held only under a token ceiling (store.decide)
if tonumber(ARGV[17]) >= 0 then
  local left = tonumber(ARGV[17]) - run_tokens - held
  if left <= 0 or left < tokens_lo + context_tokens then
    return refused('run_tokens', 0, 0)
  end
  tokens = math.min(tokens_hi + context_tokens, left)
end
if tonumber(ARGV[18]) >= 0 and elapsed >= tonumber(ARGV[18]) then
  return refused('run_seconds', 0, 0)
end

-- 7. Money on every scope, in SCOPES' order (of equal headroom the first is refused).
local names = {'run_cost', 'tenant_day', 'tenant_month', 'key_day', 'key_month'}
local scope_keys = {KEYS[1], KEYS[2], KEYS[3], KEYS[12], KEYS[13]}
local scopes = 3
if has_key then scopes = 5 end
local head = {}
local tight, tight_i = nil, nil
for i = 1, scopes do
  local limit = limits[i]
  if limit >= 0 then
    local v = redis.call('HMGET', scope_keys[i], 'settled', 'reserved')
    head[i] = limit - tonumber(v[1] or '0') - tonumber(v[2] or '0')
    if tight == nil or head[i] < tight then
      tight, tight_i = head[i], i
    end
  end
end

local min_r, max_r = tonumber(ARGV[5]) + extra, tonumber(ARGV[6]) + extra
if tight ~= nil and tight < min_r then
  local v = redis.call('HMGET', scope_keys[tight_i], 'settled', 'reserved')
  return refused(names[tight_i], tonumber(v[1] or '0'), tonumber(v[2] or '0'))
end
local amount = max_r
if tight ~= nil and tight < amount then
  amount = tight
end

-- 8. Rate buckets (GCRA, integers; rates.py rate_step line for line; lib/gcra.lua): refuse if one is full.
local limited, states, held_of, last_of = gcra_rates(22, r)
if limited then
  return {'rate', closed, trace, budgets[1], budgets[2], states}
end

-- 9. Count the call and reserve.
gcra_draw(r, held_of, last_of)
scopes_reserve(amount, 10, has_key)
calls = redis.call('HINCRBY', KEYS[1], 'calls', count)
redis.call('HINCRBY', KEYS[1], 'tokens_held', tokens)
runseen_note(7, 9)
redis.call('HSET', KEYS[5], 'amount', amount, 'calls', calls, 'expired', '0', 'tokens', tokens,
  'run', KEYS[1], 'day', KEYS[2], 'month', KEYS[3], 'total', KEYS[4])
if has_key then
  redis.call('HSET', KEYS[5], 'keyday', KEYS[12], 'keymonth', KEYS[13])
end
redis.call('ZADD', KEYS[6], ARGV[8], KEYS[5])

local left = scopes_left(head, amount)
return {'ok', closed, trace, budgets[1], budgets[2], string.format('%d', amount), calls,
        left[1], left[2], left[3], context_tokens, left[4], left[5], string.format('%d', run_tokens),
        started, states, string.format('%d', tokens)}

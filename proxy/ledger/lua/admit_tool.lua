-- Admit one request of the MCP route, atomically: keep the run's trace ids; for a
-- tools/call also mark the open model tool call it executes, count the MCP streak, then
-- refuse (loop guard, max tool calls, the run's wall time, a cost scope: the key's too)
-- or count the call and reserve its fixed cost on every scope. Any request, tool call or
-- not, then draws on its rate buckets (GCRA, as admit.lua). Mirrors
-- SqliteStore.admit_tool (store.match_pending).
-- Every key is one tenant's (`sm:{tenant}:...`, one Redis Cluster slot) and declared here.
-- KEYS: 1 run hash, 2 day hash, 3 month hash, 4 tenant total hash, 5 reservation hash,
--       6 the tenant's expiry zset, 7 the tenant's runs zset, 8 the tenant's active runs
--       zset (both by run id), 9 tools hash, 10 budget hash, 11 run totals hash,
--       12 key day hash, 13 key month hash (both unused without a key), 14.. one hash per rate bucket
-- ARGV: 1 tool name ('' = not a tool call: the trace and the rates only), 2 signature, 3 cost,
--       4 max tool calls, 5 run max cost, 6 day budget, 7 month budget (-1 = no limit),
--       8 now, 9 expires at, 10 run id, 11 window ttl seconds,
--       12 trace json ('' = none), 13 guard threshold (-1 = none), 14 guard refuses (1/0),
--       15 run max seconds, 16 key day budget, 17 key month budget (-1 = none), 18 has a key (1/0),
--       19 now in ms, 20 number of rate buckets r, then r pairs: limit, cost
if redis.call('EXISTS', KEYS[5]) == 1 then
  -- a retried admission (the reply to the first was lost): answer it again
  local f = redis.call('HMGET', KEYS[5], 'amount', 'calls', 'entry', 'streak')
  return {'dup', f[3], tonumber(f[4]), '', tonumber(f[1]), tonumber(f[2])}
end

-- 1. The run's trace ids: the first stored win (as admit.lua).
local trace = runtrace_keep(12, 10, 8)
-- The rate buckets (lib/gcra.lua): drawn on only once nothing refused.
local r = tonumber(ARGV[20])

local name, sig = ARGV[1], ARGV[2]
if name == '' then
  local limited, states, held_of, last_of = gcra_rates(19, r)
  if limited then
    return {'rate', '', 0, trace, '', '', states}
  end
  gcra_draw(r, held_of, last_of)
  return {'trace', '', 0, trace, states}
end

-- 2. The open model tool call this executes: same signature first, else same name, in
-- the order the model made them, never one an MCP call took already. The stored JSON is
-- marked by text, not re-encoded: cjson would round its 128-bit trace ids.
local best_sig, best_name = nil, nil
local all = redis.call('HGETALL', KEYS[9])
for i = 1, #all, 2 do
  local cur = all[i + 1]
  local tab = string.find(cur, '\t', 1, true)
  local seq = tonumber(string.sub(cur, 1, tab - 1))
  local rec = cjson.decode(string.sub(cur, tab + 1))
  if rec['mcp'] ~= true then
    if rec['sig'] == sig and (best_sig == nil or seq < best_sig[1]) then best_sig = {seq, all[i], cur} end
    if rec['name'] == name and (best_name == nil or seq < best_name[1]) then best_name = {seq, all[i], cur} end
  end
end
local best = best_sig or best_name
local matched = ''
if best then
  local cur = best[3]
  local tab = string.find(cur, '\t', 1, true)
  matched = string.sub(cur, tab + 1, -2) .. ', "mcp": true}'
  redis.call('HSET', KEYS[9], best[2], string.sub(cur, 1, tab) .. matched)
end

-- 3. The streak of identical MCP calls, and the loop guard's refusal.
local st = redis.call('HMGET', KEYS[1], 'mcp_sig', 'mcp_streak')
local streak = 1
if st[1] == sig then streak = tonumber(st[2] or '0') + 1 end
redis.call('HSET', KEYS[1], 'mcp_sig', sig, 'mcp_streak', streak)
if tonumber(ARGV[13]) >= 0 and ARGV[14] == '1' and streak >= tonumber(ARGV[13]) then
  return {'loop', matched, streak, trace}
end

-- 4. Limits in force: the admin API's budgets over the config's.
local has_key = ARGV[18] == '1'
local limits = {tonumber(ARGV[5]), tonumber(ARGV[6]), tonumber(ARGV[7]), -1, -1}
if has_key then
  limits[4], limits[5] = tonumber(ARGV[16]), tonumber(ARGV[17])
end
local b = redis.call('HMGET', KEYS[10], 'day', 'month')
if b[1] then limits[2] = tonumber(b[1]) end
if b[2] then limits[3] = tonumber(b[2]) end
local budgets = {b[1] or '', b[2] or ''}

-- 5. The tool-call ceiling, the run's wall time, then the cost ceilings.
local count = tonumber(redis.call('HGET', KEYS[11], 'mcp_tool_calls') or '0')
local max_calls = tonumber(ARGV[4])
if max_calls >= 0 and count >= max_calls then
  return {'calls', matched, streak, trace, budgets[1], budgets[2]}
end
local started = redis.call('HGET', KEYS[1], 'first_seen') or ARGV[8]
local elapsed = 0
if tonumber(ARGV[15]) >= 0 then
  elapsed = tonumber(ARGV[8]) - tonumber(started)
  if elapsed >= tonumber(ARGV[15]) then
    return {'refused', matched, streak, trace, budgets[1], budgets[2], 'run_seconds', 0, 0,
            string.format('%.6f', elapsed)}
  end
end
local names = {'run_cost', 'tenant_day', 'tenant_month', 'key_day', 'key_month'}
local scope_keys = {KEYS[1], KEYS[2], KEYS[3], KEYS[12], KEYS[13]}
local scopes = 3
if has_key then scopes = 5 end
local head = {}
local tight, tight_i = nil, nil
for i = 1, scopes do
  if limits[i] >= 0 then
    local v = redis.call('HMGET', scope_keys[i], 'settled', 'reserved')
    head[i] = limits[i] - tonumber(v[1] or '0') - tonumber(v[2] or '0')
    if tight == nil or head[i] < tight then tight, tight_i = head[i], i end
  end
end
local amount = tonumber(ARGV[3])
if tight ~= nil and tight < amount then
  local v = redis.call('HMGET', scope_keys[tight_i], 'settled', 'reserved')
  return {'refused', matched, streak, trace, budgets[1], budgets[2], names[tight_i],
          tonumber(v[1] or '0'), tonumber(v[2] or '0'), '0'}
end
local limited, states, held_of, last_of = gcra_rates(19, r)
if limited then
  return {'rate', matched, streak, trace, budgets[1], budgets[2], states}
end

-- 6. Count the call, draw on the rates and reserve its cost.
gcra_draw(r, held_of, last_of)
scopes_reserve(amount, 11, has_key)
if has_key then
  redis.call('HSET', KEYS[5], 'keyday', KEYS[12], 'keymonth', KEYS[13])
end
count = redis.call('HINCRBY', KEYS[11], 'mcp_tool_calls', 1)
if matched == '' then
  redis.call('HINCRBY', KEYS[11], 'tool_calls', 1)
else
  redis.call('HINCRBY', KEYS[11], 'tool_calls', 0)
end
runseen_note(8, 10)
redis.call('HSET', KEYS[5], 'amount', amount, 'calls', count, 'expired', '0', 'entry', matched,
  'streak', streak, 'run', KEYS[1], 'day', KEYS[2], 'month', KEYS[3], 'total', KEYS[4])
redis.call('ZADD', KEYS[6], ARGV[9], KEYS[5])
local left = scopes_left(head, amount)
return {'ok', matched, streak, trace, budgets[1], budgets[2], string.format('%d', amount), count,
        left[1], left[2], left[3], left[4], left[5], started, states}

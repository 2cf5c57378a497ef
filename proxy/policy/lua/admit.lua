-- Count a call and reserve its worst case on every scope, or refuse. Atomic.
-- Mirrors proxy.policy.store.decide; the contract suite holds both to the same results.
-- KEYS: 1 run hash, 2 day hash, 3 month hash, 4 tenant total hash, 5 reservation hash,
--       6 expiry zset, 7 runs zset, 8 tenant runs zset, 9 active runs zset
-- ARGV: 1 max calls, 2 run max cost, 3 day budget, 4 month budget (-1 = no limit),
--       5 min reserve, 6 max reserve, 7 now, 8 expires at, 9 run member, 10 run id,
--       11 window ttl seconds
if redis.call('EXISTS', KEYS[5]) == 1 then
  -- a retried admission (the reply to the first was lost): answer it again
  local f = redis.call('HMGET', KEYS[5], 'amount', 'calls')
  return {'dup', tonumber(f[1]), tonumber(f[2])}
end

local calls = tonumber(redis.call('HGET', KEYS[1], 'calls') or '0')
local max_calls = tonumber(ARGV[1])
if max_calls >= 0 and calls >= max_calls then
  return {'refused', 'run_calls', calls, 0}
end

local names = {'run_cost', 'tenant_day', 'tenant_month'}
local head = {}
local tight, tight_i = nil, nil
for i = 1, 3 do
  local limit = tonumber(ARGV[i + 1])
  local v = redis.call('HMGET', KEYS[i], 'settled', 'reserved')
  local settled, reserved = tonumber(v[1] or '0'), tonumber(v[2] or '0')
  if limit >= 0 then
    head[i] = limit - settled - reserved
    if tight == nil or head[i] < tight then
      tight, tight_i = head[i], i
    end
  end
end

local min_r, max_r = tonumber(ARGV[5]), tonumber(ARGV[6])
if tight ~= nil and tight < min_r then
  local v = redis.call('HMGET', KEYS[tight_i], 'settled', 'reserved')
  return {'refused', names[tight_i], tonumber(v[1] or '0'), tonumber(v[2] or '0')}
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
return {'ok', amount, calls, left[1], left[2], left[3]}

-- Write runs that budget leases kept in memory (runs of one call) whole, each added to
-- whatever the run already holds. Mirrors SqliteStore.runs_record; one tenant's keys.
-- KEYS: 1 the tenant's runs zset, 2 its active runs zset, then per run: its hash, its totals hash
-- ARGV: per run: run id, calls, first seen, last seen, ended at ('' = open), trace json
--       ('' = none), settled micro-USD, the number of totals n, then n pairs name, value
local a = 1
for i = 3, #KEYS, 2 do
  local id, first, last, ended_at, trace = ARGV[a], ARGV[a + 2], ARGV[a + 3], ARGV[a + 4], ARGV[a + 5]
  redis.call('HINCRBY', KEYS[i], 'calls', ARGV[a + 1])
  redis.call('HINCRBY', KEYS[i], 'settled', ARGV[a + 6])
  redis.call('HSET', KEYS[i], 'run_id', id)
  if trace ~= '' then redis.call('HSETNX', KEYS[i], 'trace', trace) end
  local f = redis.call('HGET', KEYS[i], 'first_seen')
  if not f or tonumber(first) < tonumber(f) then redis.call('HSET', KEYS[i], 'first_seen', first) end
  local l = redis.call('HGET', KEYS[i], 'last_seen')
  if not l or tonumber(last) > tonumber(l) then
    l = last
    redis.call('HSET', KEYS[i], 'last_seen', last)
  end
  redis.call('ZADD', KEYS[1], l, id)
  if ended_at ~= '' then
    if redis.call('HGET', KEYS[i], 'ended') ~= '1' then
      redis.call('HSET', KEYS[i], 'ended', '1', 'ended_at', ended_at)
    end
    redis.call('ZREM', KEYS[2], id)
  elseif redis.call('HGET', KEYS[i], 'ended') ~= '1' then
    redis.call('ZADD', KEYS[2], l, id)
  end
  local n = tonumber(ARGV[a + 7])
  for j = a + 8, a + 7 + 2 * n, 2 do
    redis.call('HINCRBY', KEYS[i + 1], ARGV[j], ARGV[j + 1])
  end
  a = a + 8 + 2 * n
end
return 1

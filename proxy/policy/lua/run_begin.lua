-- Set the run's trace if it has none; return the stored one, so replicas share it.
-- KEYS: 1 run hash, 2 runs zset, 3 tenant runs zset, 4 active runs zset
-- ARGV: 1 trace json, 2 now, 3 run member, 4 run id
local stored = redis.call('HGET', KEYS[1], 'trace')
if stored then
  return stored
end
redis.call('HSET', KEYS[1], 'trace', ARGV[1], 'last_seen', ARGV[2], 'run_id', ARGV[4])
redis.call('HSETNX', KEYS[1], 'first_seen', ARGV[2])
redis.call('ZADD', KEYS[2], ARGV[2], ARGV[3])
redis.call('ZADD', KEYS[3], ARGV[2], ARGV[4])
if redis.call('HGET', KEYS[1], 'ended') ~= '1' then
  redis.call('ZADD', KEYS[4], ARGV[2], ARGV[3])
end
return ARGV[1]

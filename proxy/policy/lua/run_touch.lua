-- Record activity on a run (never moves last_seen backwards).
-- KEYS: 1 run hash, 2 runs zset, 3 tenant runs zset, 4 active runs zset
-- ARGV: 1 now, 2 run member, 3 run id
local last = tonumber(redis.call('HGET', KEYS[1], 'last_seen') or '0')
local now = tonumber(ARGV[1])
if now < last then
  now = last
end
redis.call('HSET', KEYS[1], 'last_seen', tostring(now), 'run_id', ARGV[3])
redis.call('HSETNX', KEYS[1], 'first_seen', ARGV[1])
redis.call('ZADD', KEYS[2], now, ARGV[2])
redis.call('ZADD', KEYS[3], now, ARGV[3])
if redis.call('HGET', KEYS[1], 'ended') ~= '1' then
  redis.call('ZADD', KEYS[4], now, ARGV[2])
end
return 1

-- Mark a run ended; only the first caller gets 1 (and so emits the run span).
-- KEYS: 1 run hash, 2 the tenant's active runs zset (one tenant's slot)
-- ARGV: 1 now, 2 run id
if redis.call('EXISTS', KEYS[1]) == 0 or redis.call('HGET', KEYS[1], 'ended') == '1' then
  return 0
end
redis.call('HSET', KEYS[1], 'ended', '1', 'ended_at', ARGV[1])
redis.call('ZREM', KEYS[2], ARGV[2])
return 1

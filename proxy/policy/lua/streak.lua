-- Count consecutive identical signatures; a different one starts again at 1.
-- KEYS: 1 run hash   ARGV: 1 signature
if redis.call('HGET', KEYS[1], 'sig') == ARGV[1] then
  return redis.call('HINCRBY', KEYS[1], 'streak', 1)
end
redis.call('HSET', KEYS[1], 'sig', ARGV[1], 'streak', 1)
return 1

-- Count consecutive failed tool results; a success resets to 0.
-- KEYS: 1 run hash   ARGV: 1 "1" when this one failed
if ARGV[1] == '1' then
  return redis.call('HINCRBY', KEYS[1], 'failures', 1)
end
redis.call('HSET', KEYS[1], 'failures', 0)
return 0

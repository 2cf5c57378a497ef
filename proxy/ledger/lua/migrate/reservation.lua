-- Move one reservation of the layout before hash tags, atomically: its hash to the new
-- name, the scopes it names to their new names, its place in the global expiry zset to
-- the tenant's. A second run finds nothing to move.
-- KEYS: 1 old reservation hash, 2 new reservation hash, 3 old global expiry zset,
--       4 the tenant's new expiry zset
-- ARGV: the new names of its run, day, month, total, key day, key month hashes ('' = none)
if redis.call('EXISTS', KEYS[1]) == 0 then
  return 0
end
local score = redis.call('ZSCORE', KEYS[3], KEYS[1])
redis.call('RENAME', KEYS[1], KEYS[2])
local fields = {'run', 'day', 'month', 'total', 'keyday', 'keymonth'}
for i = 1, 6 do
  if ARGV[i] ~= '' then redis.call('HSET', KEYS[2], fields[i], ARGV[i]) end
end
if score then
  redis.call('ZADD', KEYS[4], score, KEYS[2])
  redis.call('ZREM', KEYS[3], KEYS[1])
end
return 1

-- Move one run from the global active-runs zset of the layout before hash tags to its
-- tenant's, atomically. A second run finds nothing to move.
-- KEYS: 1 old global active zset (members '["tenant", "run"]'), 2 the tenant's new one (run ids)
-- ARGV: 1 the old member, 2 the run id
local score = redis.call('ZSCORE', KEYS[1], ARGV[1])
if not score then
  return 0
end
redis.call('ZADD', KEYS[2], score, ARGV[2])
redis.call('ZREM', KEYS[1], ARGV[1])
return 1

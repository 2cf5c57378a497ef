-- Replace a tenant's admin budgets, atomically.
-- KEYS: 1 budget hash
-- ARGV: 1 day budget, 2 month budget (micro-USD; '' = none)
redis.call('DEL', KEYS[1])
if ARGV[1] ~= '' then redis.call('HSET', KEYS[1], 'day', ARGV[1]) end
if ARGV[2] ~= '' then redis.call('HSET', KEYS[1], 'month', ARGV[2]) end
return 1

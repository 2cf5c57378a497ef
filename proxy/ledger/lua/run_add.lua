-- Add deltas to a run's totals, atomically (one hash of one tenant).
-- KEYS: 1 run totals hash
-- ARGV: name1, delta1, name2, delta2, ... (deltas stay strings: HINCRBY parses them exactly)
for i = 1, #ARGV, 2 do
  redis.call('HINCRBY', KEYS[1], ARGV[i], ARGV[i + 1])
end
return 1

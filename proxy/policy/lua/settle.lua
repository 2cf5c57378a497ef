-- Replace a reservation by the actual cost on every scope. Idempotent: the
-- reservation hash is deleted, so a second settle finds nothing and changes nothing.
-- KEYS: 1 reservation hash, 2 expiry zset
-- ARGV: 1 actual micro-USD
local f = redis.call('HMGET', KEYS[1], 'amount', 'expired', 'run', 'day', 'month', 'total')
if not f[1] then
  return {0, 0}
end
local amount, actual = tonumber(f[1]), tonumber(ARGV[1])
for i = 3, 6 do
  if f[2] == '1' then
    -- expiry already charged the reserved amount: correct it to the real cost
    redis.call('HINCRBY', f[i], 'settled', actual - amount)
  else
    redis.call('HINCRBY', f[i], 'reserved', -amount)
    redis.call('HINCRBY', f[i], 'settled', actual)
  end
end
redis.call('DEL', KEYS[1])
redis.call('ZREM', KEYS[2], KEYS[1])
return {1, amount}

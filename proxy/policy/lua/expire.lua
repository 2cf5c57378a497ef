-- Charge reservations past their ttl at their reserved amount: the call may have
-- been billed, and unknown is not zero. Headroom does not change (reserved -> settled).
-- The hash is kept a while so that a late settle can still correct the charge.
-- KEYS: 1 expiry zset
-- ARGV: 1 now, 2 max count, 3 seconds to keep expired reservations
local due = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', ARGV[1], 'LIMIT', 0, tonumber(ARGV[2]))
for _, res in ipairs(due) do
  local f = redis.call('HMGET', res, 'amount', 'expired', 'run', 'day', 'month', 'total', 'keyday', 'keymonth')
  if f[1] and f[2] == '0' then
    local amount = tonumber(f[1])
    local last = 6
    if f[7] then last = 8 end
    for i = 3, last do
      redis.call('HINCRBY', f[i], 'reserved', -amount)
      redis.call('HINCRBY', f[i], 'settled', amount)
    end
    redis.call('HSET', res, 'expired', '1')
    redis.call('EXPIRE', res, ARGV[3])
  end
  redis.call('ZREM', KEYS[1], res)
end
return #due

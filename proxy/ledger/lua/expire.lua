-- Charge one reservation past its ttl at its reserved amount: the call may have been
-- billed, and unknown is not zero. Headroom does not change (reserved -> settled). The
-- hash is kept a while so that a late settle can still correct the charge.
-- The caller read the scopes' names from the reservation hash and declares them here
-- (all `sm:{tenant}:...`, one Redis Cluster slot); the script checks they still match.
-- KEYS: 1 the tenant's expiry zset, 2 reservation hash, then (when the hash exists) its
--       run, day, month and total hashes, and its key day and key month hashes if it has them
-- ARGV: 1 seconds to keep expired reservations
local f = redis.call('HMGET', KEYS[2], 'amount', 'expired', 'run', 'day', 'month', 'total', 'keyday', 'keymonth',
  'tokens')
local charged = 0
if f[1] and f[2] == '0' then
  local last = 6
  if f[7] then last = 8 end
  if #KEYS ~= last then
    return redis.error_reply('ERR spanmeter: reservation ' .. KEYS[2] .. ' holds money on more keys than declared')
  end
  for i = 3, last do
    if f[i] ~= KEYS[i] then
      return redis.error_reply('ERR spanmeter: reservation ' .. KEYS[2] .. ' holds money on ' .. f[i] ..
        ', not the declared ' .. KEYS[i])
    end
  end
  local amount = tonumber(f[1])
  for i = 3, last do
    redis.call('HINCRBY', KEYS[i], 'reserved', -amount)
    redis.call('HINCRBY', KEYS[i], 'settled', amount)
  end
  -- and at the tokens it held on the run (KEYS[3])
  local tokens = tonumber(f[9] or '0')
  if tokens > 0 then
    redis.call('HINCRBY', KEYS[3], 'tokens_held', -tokens)
    redis.call('HINCRBY', KEYS[3], 'tokens_expired', tokens)
  end
  redis.call('HSET', KEYS[2], 'expired', '1')
  redis.call('EXPIRE', KEYS[2], ARGV[1])
  charged = 1
end
redis.call('ZREM', KEYS[1], KEYS[2])
return charged

-- Replace a reservation by the actual cost on every scope and, in the same step, add
-- the run's totals and remember its open tool calls. Idempotent as a whole: the
-- reservation hash is deleted, so a second settle (or a retry whose first reply was
-- lost) finds nothing and changes nothing, totals and tool calls included.
-- Every key is one tenant's (`sm:{tenant}:...`, one Redis Cluster slot) and declared here.
-- The reservation hash also names the scopes it holds money on (the expiry sweep reads
-- them); the script checks they are the ones declared, so nothing undeclared is touched.
-- KEYS: 1 reservation hash, 2 the tenant's expiry zset, 3 run totals hash, 4 tools hash
--       (id -> "seq<TAB>json"), 5 tools sequence counter, 6 run hash, 7 day hash,
--       8 month hash, 9 tenant total hash, 10 key day hash, 11 key month hash (both unused
--       for a call made without a key), 12.. one key per stored context whose size this
--       call revealed
-- ARGV: 1 actual micro-USD, 2 number of totals n, then n pairs name, delta,
--       then the number of tool calls m, then m pairs tool id, tool json,
--       then the context keys' ttl, then one token count per context key
local f = redis.call('HMGET', KEYS[1], 'amount', 'expired', 'run', 'day', 'month', 'total', 'keyday', 'keymonth',
  'tokens')
if not f[1] then
  return {0, 0}
end
local last = 9
if f[7] then last = 11 end  -- a call made with a key holds money on the key's day and month too
for i = 6, last do
  if f[i - 3] ~= KEYS[i] then
    return redis.error_reply('ERR spanmeter: reservation ' .. KEYS[1] .. ' holds money on ' .. tostring(f[i - 3]) ..
      ', not the declared ' .. KEYS[i])
  end
end
local amount, actual = tonumber(f[1]), tonumber(ARGV[1])
for i = 6, last do
  if f[2] == '1' then
    -- expiry already charged the reserved amount: correct it to the real cost
    redis.call('HINCRBY', KEYS[i], 'settled', actual - amount)
  else
    redis.call('HINCRBY', KEYS[i], 'reserved', string.format('%d', -amount))  -- never '-0' (not an integer to HINCRBY)
    redis.call('HINCRBY', KEYS[i], 'settled', actual)
  end
end
-- the tokens it held: the real count arrives in the run totals (expiry had charged them)
local tokens = tonumber(f[9] or '0')
if tokens > 0 then
  if f[2] == '1' then
    redis.call('HINCRBY', KEYS[6], 'tokens_expired', -tokens)
  else
    redis.call('HINCRBY', KEYS[6], 'tokens_held', -tokens)
  end
end
redis.call('DEL', KEYS[1])
redis.call('ZREM', KEYS[2], KEYS[1])

local n = tonumber(ARGV[2] or '0')
for i = 3, 2 + 2 * n, 2 do
  -- the delta stays a string: HINCRBY parses it exactly (no double rounding)
  redis.call('HINCRBY', KEYS[3], ARGV[i], ARGV[i + 1])
end
-- as tools_put.lua: a call already known keeps its place in the order
local t0 = 3 + 2 * n
local m = tonumber(ARGV[t0])
for i = t0 + 1, t0 + 2 * m, 2 do
  local cur = redis.call('HGET', KEYS[4], ARGV[i])
  local seq
  if cur then
    seq = string.match(cur, '^(%d+)\t')
  else
    seq = tostring(redis.call('INCR', KEYS[5]))
  end
  redis.call('HSET', KEYS[4], ARGV[i], seq .. '\t' .. ARGV[i + 1])
end
-- the largest size seen: a conversation only grows, a prompt template is fixed
local c0 = t0 + 2 * m + 1
for i = 12, #KEYS do
  local tokens = tonumber(ARGV[c0 + i - 11])
  local cur = tonumber(redis.call('GET', KEYS[i]) or '0')
  if tokens > cur then cur = tokens end
  redis.call('SET', KEYS[i], string.format('%d', cur), 'EX', ARGV[c0])
end
return {1, amount}

-- Move one key of the layout before hash tags to its new name, atomically; run once per
-- key by `spanmeter ledger migrate-keys` on the one Redis that layout lived on (never a
-- Cluster: the two names are in different slots). A second run finds nothing to move.
-- When the new key exists already (a new proxy wrote it first), money and counts are
-- added, times and sizes take the larger, the rest keeps the new value.
-- KEYS: 1 old key, 2 new key
-- ARGV: 1 how to merge: add | run | fill | zmax | max | keep
if redis.call('EXISTS', KEYS[1]) == 0 then
  return 0
end
if redis.call('EXISTS', KEYS[2]) == 0 then
  redis.call('RENAME', KEYS[1], KEYS[2])  -- keeps the time to live
  return 1
end
local mode = ARGV[1]
if mode == 'add' or mode == 'run' or mode == 'fill' then
  local f = redis.call('HGETALL', KEYS[1])
  for i = 1, #f, 2 do
    local k, v = f[i], f[i + 1]
    if mode == 'add' or (mode == 'run' and (k == 'calls' or k == 'settled' or k == 'reserved')) then
      redis.call('HINCRBY', KEYS[2], k, v)
    elseif mode == 'run' and (k == 'first_seen' or k == 'last_seen') then
      local cur = redis.call('HGET', KEYS[2], k)
      local earlier = cur and tonumber(v) < tonumber(cur)
      if not cur or (k == 'first_seen' and earlier) or (k == 'last_seen' and not earlier) then
        redis.call('HSET', KEYS[2], k, v)
      end
    else
      redis.call('HSETNX', KEYS[2], k, v)
    end
  end
elseif mode == 'zmax' then
  redis.call('ZUNIONSTORE', KEYS[2], 2, KEYS[2], KEYS[1], 'AGGREGATE', 'MAX')
elseif mode == 'max' then
  local old, new = tonumber(redis.call('GET', KEYS[1])), tonumber(redis.call('GET', KEYS[2]))
  if old and new and old > new then
    redis.call('SET', KEYS[2], string.format('%d', old), 'KEEPTTL')
  end
end
redis.call('DEL', KEYS[1])
return 2

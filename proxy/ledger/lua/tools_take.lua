-- Pop the tool calls with these ids, atomically: each is taken by one caller only.
-- KEYS: 1 tools hash
-- ARGV: ids
local taken = {}
for _, id in ipairs(ARGV) do
  local cur = redis.call('HGET', KEYS[1], id)
  if cur then
    redis.call('HDEL', KEYS[1], id)
    table.insert(taken, cur)
  end
end
return taken

-- Remember open tool calls; a call already known keeps its place in the order.
-- KEYS: 1 tools hash (id -> "seq<TAB>json"), 2 sequence counter
-- ARGV: id1, json1, id2, json2, ...
for i = 1, #ARGV, 2 do
  local cur = redis.call('HGET', KEYS[1], ARGV[i])
  local seq
  if cur then
    seq = string.match(cur, '^(%d+)\t')
  else
    seq = tostring(redis.call('INCR', KEYS[2]))
  end
  redis.call('HSET', KEYS[1], ARGV[i], seq .. '\t' .. ARGV[i + 1])
end
return 1

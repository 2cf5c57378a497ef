-- Rate buckets per minute: GCRA in integers, shared by admit.lua and admit_tool.lua, which
-- proxy/ledger/redis.py loads with this file in front of them.
-- KEYS: bucket j is KEYS[13 + j] (hash: debt, last), as both scripts declare them.
-- ARGV: now in ms at ARGV[base]; bucket j's limit per minute and this request's cost at
-- ARGV[base + 2j] and ARGV[base + 2j + 1].

-- The state of each bucket with this request counted, and whether one is full: nothing is
-- written here, a refusal further on must leave every bucket as it was.
local function gcra_rates(base, r)
  local now_ms = tonumber(ARGV[base])
  local states, held_of, last_of = {}, {}, {}
  local limited = false
  for j = 1, r do
    local limit, cost = tonumber(ARGV[base + 2 * j]), tonumber(ARGV[base + 1 + 2 * j])
    local bucket = redis.call('HMGET', KEYS[13 + j], 'debt', 'last')
    local debt, last = tonumber(bucket[1] or '0'), tonumber(bucket[2] or ARGV[base])
    local cap = limit * 60000
    local gone = now_ms - last
    if gone < 0 then gone = 0 end
    if gone > 60000 then gone = 60000 end
    local drained = debt - gone * limit
    if drained < 0 then drained = 0 end
    local need = drained + cost * 60000
    local wait, held
    if cost > limit then
      wait, held = -1, drained
    elseif need <= cap then
      wait, held = 0, need
    else
      wait, held = math.ceil((need - cap) / limit), drained
    end
    if wait ~= 0 then limited = true end
    held_of[j] = held
    if last > now_ms then last_of[j] = last else last_of[j] = now_ms end
    table.insert(states, math.floor((cap - held) / 60000))
    table.insert(states, math.ceil(held / limit))
    table.insert(states, wait)
  end
  return limited, states, held_of, last_of
end

-- Draw on the buckets: what gcra_rates computed becomes their state.
local function gcra_draw(r, held_of, last_of)
  for j = 1, r do
    redis.call('HSET', KEYS[13 + j], 'debt', string.format('%d', held_of[j]), 'last', string.format('%d', last_of[j]))
    redis.call('PEXPIRE', KEYS[13 + j], 120000)  -- a bucket untouched for a window is empty anyway
  end
end


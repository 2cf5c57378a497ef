-- Reserving on a call's scopes, shared by admit.lua and admit_tool.lua (put in front of them at load).
-- KEYS: KEYS[1..4] the run, day, month and all-time scopes; KEYS[12], KEYS[13] the key's day and
-- month, as both scripts declare them.
-- ARGV: the day and month scopes' ttl (s) at ARGV[ttl_at].

-- Hold `amount` on every scope the call touches (the key's too when it has one).
local function scopes_reserve(amount, ttl_at, has_key)
  for i = 1, 4 do
    redis.call('HINCRBY', KEYS[i], 'reserved', amount)
  end
  redis.call('EXPIRE', KEYS[2], ARGV[ttl_at])
  redis.call('EXPIRE', KEYS[3], ARGV[ttl_at])
  if has_key then
    for i = 12, 13 do
      redis.call('HINCRBY', KEYS[i], 'reserved', amount)
      redis.call('EXPIRE', KEYS[i], ARGV[ttl_at])
    end
  end
end


-- What each of the five limited scopes has left once `amount` is held ('none': no limit), as
-- decimal text: string.format('%d'), since tostring prints large numbers as 1e+15.
local function scopes_left(head, amount)
  local left = {}
  for i = 1, 5 do
    if head[i] == nil then left[i] = 'none' else left[i] = string.format('%d', head[i] - amount) end
  end
  return left
end


-- When a run was seen, shared by admit.lua and admit_tool.lua (put in front of them at load).
-- KEYS: KEYS[1] the run's hash, KEYS[7] the tenant's runs by first sight, KEYS[8] its open runs,
-- as both scripts declare them.
-- ARGV: now at ARGV[now_at], the run id at ARGV[run_at].

-- The run's first and last sight, and its place in the tenant's lists (open until it ends).
local function runseen_note(now_at, run_at)
  redis.call('HSETNX', KEYS[1], 'first_seen', ARGV[now_at])
  redis.call('HSET', KEYS[1], 'last_seen', ARGV[now_at], 'run_id', ARGV[run_at])
  redis.call('ZADD', KEYS[7], ARGV[now_at], ARGV[run_at])
  if redis.call('HGET', KEYS[1], 'ended') ~= '1' then
    redis.call('ZADD', KEYS[8], ARGV[now_at], ARGV[run_at])
  end
end


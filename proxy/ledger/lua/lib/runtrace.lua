-- The run's trace ids, shared by admit.lua and admit_tool.lua (put in front of them at load).
-- KEYS: KEYS[1] the run's hash, KEYS[7] the tenant's runs by first sight, KEYS[8] its open runs,
-- as both scripts declare them.
-- ARGV: the trace json at ARGV[trace_at] ('' = none), the run id at ARGV[run_at], now at ARGV[now_at].

-- The first trace stored wins: every call of a run joins the trace its first call started.
local function runtrace_keep(trace_at, run_at, now_at)
  if ARGV[trace_at] == '' then
    return ''
  end
  local trace = redis.call('HGET', KEYS[1], 'trace')
  if not trace then
    trace = ARGV[trace_at]
    redis.call('HSET', KEYS[1], 'trace', trace, 'run_id', ARGV[run_at])
    redis.call('HSETNX', KEYS[1], 'first_seen', ARGV[now_at])
    redis.call('HSETNX', KEYS[1], 'last_seen', ARGV[now_at])
    redis.call('ZADD', KEYS[7], ARGV[now_at], ARGV[run_at])
    if redis.call('HGET', KEYS[1], 'ended') ~= '1' then
      redis.call('ZADD', KEYS[8], ARGV[now_at], ARGV[run_at])
    end
  end
  return trace
end


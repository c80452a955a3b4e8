-- ratelimit-gateway: envoyproxy/ratelimit's fixed window, for the rate limit
-- service (rls/): each key is counted on its own, never all or nothing.
--
-- KEYS[i]      one key base per descriptor, "<prefix>{<domain>|<entries>}|fixed_window|<unit s>";
--              the key counted is "<base>|<window start, epoch s>" (same hash
--              tag, so same slot), since only this script knows the time
-- ARGV[1]      "": time comes from Redis TIME; else a time in ms the script
--              runs at. Every key gets an expiry (common.lua's ttl).
-- ARGV[2i], ARGV[2i+1]
--              per key i: the unit in seconds, the hits to add (>= 0)
--
-- Returns { now_ms, then per key: the count after the hits (at most 2^53),
-- ms until the window ends }.
--
-- As theirs (INCRBY, then compare): the hits are added whether or not they
-- fit, so a client over the limit stays over until the window ends, and two
-- gateways or one of theirs against the same counts agree. The window is
-- floor(now / unit) in Redis time (theirs: the service's clock). The key
-- expires when its window ends (theirs: EXPIRE unit after each hit); the
-- counts are the same.
--
-- clock, expire_at, divmod and fmt come from common.lua, which script.rs puts in front.

-- The largest stored count (2^53, the protocol's MAX_EXACT).
local MAX_COUNT = 9007199254740992

local now = clock(ARGV[1])
local sec = divmod(now, 1000)
local out = { now }
for i = 1, #KEYS do
  local unit = tonumber(ARGV[2 * i])
  local hits = tonumber(ARGV[2 * i + 1])
  local start = sec - math.fmod(sec, unit)
  local stop_ms = (start + unit) * 1000
  local key = KEYS[i] .. '|' .. fmt(start)
  -- Capped at 2^53: past it INCRBY would overflow at 2^63 and fail, and the
  -- count would no longer be exact in Lua; a capped count stays over any limit.
  local count = redis.pcall('INCRBY', key, fmt(hits))
  if type(count) ~= 'number' or count > MAX_COUNT then
    redis.call('SET', key, fmt(MAX_COUNT))
    count = MAX_COUNT
  end
  redis.call('PEXPIREAT', key, fmt(expire_at(stop_ms - now)))
  out[#out + 1] = count
  out[#out + 1] = stop_ms - now
end
return out

-- ratelimit-gateway: helpers shared by check.lua, refund.lua and lease.lua.
-- Redis scripts cannot include each other, so script.rs puts this file in
-- front of each script; they round and count time the same way.
--
-- Lua numbers are doubles: every quantity the scripts handle is an integer of
-- at most 2^53 (the gateway rejects requests * window_ms, costs, want and
-- return above 2^53), so every + - * is exact. Division is never trusted near
-- integers: divmod uses fmod, which is exact for doubles, and then divides an
-- exact multiple.

-- now in ms: `arg` "" takes the time from Redis TIME (clock::RedisTime);
-- anything else is a time in ms the script runs at (clock::FixedClock).
-- Redis's own time is kept for the absolute expiries (PEXPIREAT).
local given, redis_now = false, 0
local function clock(arg)
  local t = redis.call('TIME')
  redis_now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
  if arg ~= '' then
    given = true
    return tonumber(arg)
  end
  return redis_now
end

-- The expiry (ms from now, for PX) of a key stale `ms` after now. Every key
-- gets one. At a given time Redis's own clock does not follow the script's,
-- so the key lives at least a day of Redis time (longer than any test that
-- steps time runs): never for ever, never gone mid-test.
local GIVEN_MIN_TTL = 86400000
local function ttl(ms)
  if given and ms < GIVEN_MIN_TTL then return GIVEN_MIN_TTL end
  return ms
end

-- The same expiry in Redis time, for PEXPIREAT: on Redis time now + ms.
local function expire_at(ms)
  return redis_now + ttl(ms)
end

-- q, r with a = q*b + r, 0 <= r < b, for integers a >= 0, b >= 1.
local function divmod(a, b)
  local r = math.fmod(a, b)
  return (a - r) / b, r
end

local function ceildiv(a, b)
  local q, r = divmod(a, b)
  if r > 0 then q = q + 1 end
  return q
end

local function fmt(x)
  return string.format('%.0f', x)
end

-- Calendar arithmetic in UTC on whole days since 1970-01-01 (Howard
-- Hinnant's days_from_civil / civil_from_days, for days >= 0).
local function civil_from_days(z)
  z = z + 719468
  local era, doe = divmod(z, 146097)
  local yoe = divmod(doe - divmod(doe, 1460) + divmod(doe, 36524) - divmod(doe, 146096), 365)
  local doy = doe - (365 * yoe + divmod(yoe, 4) - divmod(yoe, 100))
  local mp = divmod(5 * doy + 2, 153)
  local d = doy - divmod(153 * mp + 2, 5) + 1
  local m
  if mp < 10 then m = mp + 3 else m = mp - 9 end
  local y = yoe + era * 400
  if m <= 2 then y = y + 1 end
  return y, m, d
end

local function days_from_civil(y, m, d)
  if m <= 2 then y = y - 1 end
  local era, yoe = divmod(y, 400)
  local mp
  if m > 2 then mp = m - 3 else mp = m + 9 end
  local doy = divmod(153 * mp + 2, 5) + d - 1
  local doe = yoe * 365 + divmod(yoe, 4) - divmod(yoe, 100) + doy
  return era * 146097 + doe - 719468
end

-- Start and end (epoch seconds) of the quota period holding the second s.
local function period_bounds(period, s)
  local len
  if period == 'minute' then len = 60
  elseif period == 'hour' then len = 3600
  elseif period == 'day' then len = 86400
  elseif period == 'month' then
    local days = divmod(s, 86400)
    local y, m, d = civil_from_days(days)
    local first = days - (d - 1)
    if m == 12 then y, m = y + 1, 1 else m = m + 1 end
    return first * 86400, days_from_civil(y, m, 1) * 86400
  else
    return nil
  end
  local q = divmod(s, len)
  return q * len, q * len + len
end


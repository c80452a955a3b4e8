-- ratelimit-gateway: give back what check.lua charged, for a call whose keys
-- span several cluster slots and whose later slot group was denied.
--
-- KEYS[1..L]       the limit keys check.lua charged (one slot)
-- KEYS[L+1..L+Q]   the quota key bases check.lua charged
-- ARGV[1]          now_ms that check.lua returned for the charge
-- ARGV[2]          "" (time from Redis TIME), or TEST ONLY a time in ms
-- ARGV[3]          L, the number of limit keys
-- ARGV[4i..4i+3]   per limit key i (i = 1..L): algorithm, requests, window_ms, cost charged
--                  (as for check.lua)
-- ARGV[4L+2j+2..4L+2j+3]
--                  per quota j (j = 1..Q): period, amount charged
--
-- Token bucket: the TAT goes back by cost * W / C ms, floored at now (a
-- bucket that is full again is deleted, which means the same).
-- Sliding window: cur -= cost (floored at 0) in the window that was charged;
-- if a later write moved that window into "prev", prev -= cost instead.
-- Quota: the key of the period that holds ARGV[1] gets DECRBY amount,
-- floored at 0 (deleted at 0), only while now is still in that period.
-- The expiry is kept: it can only be later than needed, never earlier.
-- Returns the number of keys changed.

local charged_at = tonumber(ARGV[1])
local now
if ARGV[2] ~= '' then
  now = tonumber(ARGV[2])
else
  local t = redis.call('TIME')
  now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

local function divmod(a, b)
  local r = math.fmod(a, b)
  return (a - r) / b, r
end

local function fmt(x)
  return string.format('%.0f', x)
end

-- As in check.lua.
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

-- Start (epoch seconds) of the period holding the second s.
local function period_start(period, s)
  local len
  if period == 'minute' then len = 60
  elseif period == 'hour' then len = 3600
  elseif period == 'day' then len = 86400
  elseif period == 'month' then
    local days = divmod(s, 86400)
    local _, _, d = civil_from_days(days)
    return (days - (d - 1)) * 86400
  else
    return nil
  end
  local q = divmod(s, len)
  return q * len
end

local changed = 0
local n_limits = tonumber(ARGV[3])
for i = 1, n_limits do
  local key = KEYS[i]
  local algorithm = ARGV[4 * i]
  local n = tonumber(ARGV[4 * i + 1])
  local w = tonumber(ARGV[4 * i + 2])
  local cost = tonumber(ARGV[4 * i + 3])
  local state = redis.call('GET', key)
  if state and algorithm == 'token_bucket' then
    local t, r = string.match(state, '^(%d+):(%d+)$')
    t, r = tonumber(t), tonumber(r)
    if t and r then
      -- TAT - cost*W/C, in whole ms and 1/C ms, without forming large products.
      local q1, r1 = divmod(cost * w, n)
      t, r = t - q1, r - r1
      if r < 0 then
        t, r = t - 1, r + n
      end
      if t < now or (t == now and r == 0) then
        redis.call('DEL', key) -- full again: same as a TAT floored at now
      else
        redis.call('SET', key, fmt(t) .. ':' .. fmt(r), 'KEEPTTL')
      end
      changed = changed + 1
    end
  elseif state and algorithm == 'sliding_window' then
    local sk, sc, sp = string.match(state, '^(%d+):(%d+):(%d+)$')
    sk, sc, sp = tonumber(sk), tonumber(sc), tonumber(sp)
    local k = divmod(charged_at, w)
    if sk and sc and sp and (sk == k or sk == k + 1) then
      if sk == k then
        sc = math.max(sc - cost, 0)
      else
        sp = math.max(sp - cost, 0)
      end
      if sc == 0 and sp == 0 then
        redis.call('DEL', key)
      else
        redis.call('SET', key, fmt(sk) .. ':' .. fmt(sc) .. ':' .. fmt(sp), 'KEEPTTL')
      end
      changed = changed + 1
    end
  end
end
for j = 1, #KEYS - n_limits do
  local a = 4 * n_limits + 2 * j
  local period = ARGV[a + 2]
  local amount = tonumber(ARGV[a + 3])
  local start = period_start(period, divmod(charged_at, 1000))
  if start and start == period_start(period, divmod(now, 1000)) then
    local key = KEYS[n_limits + j] .. '|' .. fmt(start)
    local count = tonumber(redis.call('GET', key) or '')
    if count then
      if count <= amount then
        redis.call('DEL', key)
      else
        redis.call('DECRBY', key, fmt(amount))
      end
      changed = changed + 1
    end
  end
end
return changed

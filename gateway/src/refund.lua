-- ratelimit-gateway: give back what check.lua charged, for a call whose keys
-- span several cluster slots and whose later slot group was denied.
--
-- KEYS[i]          the keys check.lua charged (one slot)
-- ARGV[1]          now_ms that check.lua returned for the charge
-- ARGV[2]          "" (time from Redis TIME), or TEST ONLY a time in ms
-- ARGV[4i-1..4i+2] per key i: algorithm, requests, window_ms, cost charged
--                  (as for check.lua)
--
-- Token bucket: the TAT goes back by cost * W / C ms, floored at now (a
-- bucket that is full again is deleted, which means the same).
-- Sliding window: cur -= cost (floored at 0) in the window that was charged;
-- if a later write moved that window into "prev", prev -= cost instead.
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

local changed = 0
for i = 1, #KEYS do
  local key = KEYS[i]
  local algorithm = ARGV[4 * i - 1]
  local n = tonumber(ARGV[4 * i])
  local w = tonumber(ARGV[4 * i + 1])
  local cost = tonumber(ARGV[4 * i + 2])
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
return changed

-- ratelimit-gateway: give back what check.lua charged, for a call whose keys
-- span several cluster slots and whose later slot group was denied.
--
-- KEYS[1..L]       the limit keys check.lua charged (one slot)
-- KEYS[L+1..L+Q]   the quota key bases check.lua charged
-- ARGV[1]          now_ms that check.lua returned for the charge
-- ARGV[2]          "" (time from Redis TIME), or a time in ms the script runs at
-- ARGV[3]          L, the number of limit keys
-- ARGV[4i..4i+3]   per limit key i (i = 1..L): algorithm, requests, window_ms, cost charged
--                  (as for check.lua)
-- ARGV[4L+2j+2..4L+2j+3]
--                  per quota j (j = 1..Q): period, amount charged
--
-- Token bucket: the TAT goes back by cost * W / C ms (a TAT in the past reads
-- as a full bucket; it is kept, not floored at now, so that a later step back
-- of Redis time reads it as the filter's token_bucket.rs does).
-- Sliding window: cur -= cost (floored at 0) in the window that was charged;
-- if a later write moved that window into "prev", prev -= cost instead; older:
-- nothing. A charge that a step back of Redis time counted in a later window
-- is so given back from prev or not at all: stricter, never more than taken.
-- The window is kept even at 0:0, since check.lua reads a clock behind it as
-- its start (as the filter's sliding_window.rs refund).
-- Quota: the key of the period that holds ARGV[1] gets DECRBY amount,
-- floored at 0 (deleted at 0), only while now is still in that period.
-- The expiry is kept: it can only be later than needed, never earlier.
-- Returns the number of keys changed.

-- clock, divmod, fmt and period_bounds come from common.lua, which script.rs
-- puts in front.

local charged_at = tonumber(ARGV[1])
local now = clock(ARGV[2])

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
      if t < 0 then
        redis.call('DEL', key) -- only a key that lost its charge (expired, rewritten)
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
      redis.call('SET', key, fmt(sk) .. ':' .. fmt(sc) .. ':' .. fmt(sp), 'KEEPTTL')
      changed = changed + 1
    end
  end
end
for j = 1, #KEYS - n_limits do
  local a = 4 * n_limits + 2 * j
  local period = ARGV[a + 2]
  local amount = tonumber(ARGV[a + 3])
  local start = period_bounds(period, divmod(charged_at, 1000))
  if start and start == period_bounds(period, divmod(now, 1000)) then
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

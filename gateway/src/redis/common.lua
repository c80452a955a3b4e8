-- ratelimit-gateway: helpers shared by check.lua, refund.lua, settle.lua and lease.lua.
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


-- A token bucket's use at `now` from its state "tat_ms:rem" (TAT = tat_ms +
-- rem/C ms, 0 <= rem < C): TAT - now = d + r/C ms, returned as d, r; (0, 0)
-- when there is no state or the TAT is past (the bucket is full). The
-- caller bounds d (check.lua, lease.lua, force).
local function tb_use(state, now)
  if state then
    local t, r = string.match(state, '^(%d+):(%d+)$')
    t, r = tonumber(t), tonumber(r)
    if t and r and (t > now or (t == now and r > 0)) then
      return t - now, r
    end
  end
  return 0, 0
end

-- Limit i's arguments (i = 1..L) in check.lua, refund.lua and settle.lua,
-- which all start with three ARGV of their own: algorithm, requests (N or
-- C), window_ms (W), cost, and the ceiling: how far ahead of now (ms) a
-- token bucket's TAT may stand as debt a settlement left (W for a rule that
-- does not settle); a TAT further ahead only comes from Redis time that
-- went backwards.
local function limit_args(i)
  local a = 5 * i - 1
  return ARGV[a], tonumber(ARGV[a + 1]), tonumber(ARGV[a + 2]), tonumber(ARGV[a + 3]),
    tonumber(ARGV[a + 4])
end

-- Gives `cost` back to the limit at `key`, charged at `charged_at` (ms).
-- Token bucket: the TAT goes back by cost * W / C ms (a TAT in the past reads
-- as a full bucket; it is kept, not floored at now, so that a later step back
-- of Redis time reads it as the filter's token_bucket.rs does).
-- Sliding window: cur -= cost (floored at 0) in the window that was charged;
-- if a later write moved that window into "prev", prev -= cost instead; older:
-- nothing. A charge that a step back of Redis time counted in a later window
-- is so given back from prev or not at all: stricter, never more than taken.
-- The window is kept even at 0:0, since check.lua reads a clock behind it as
-- its start (as the filter's sliding_window.rs refund). Concurrency limit:
-- `member` (the reservation record's name, as check.lua took the slot)
-- leaves the set. Returns whether the key changed.
local function give_back(key, algorithm, n, w, cost, charged_at, member)
  if algorithm == 'concurrent' then
    return member ~= nil and redis.call('ZREM', key, member) == 1
  end
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
      return true
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
      return true
    end
  end
  return false
end

-- Charges `cost` more to the limit at `key` at `now`, whatever it holds: a
-- settlement of a response that cost more than its reservation. Token
-- bucket: the TAT moves cost * W / C ms further ahead of max(TAT, now), at
-- most to now + ceiling (the debt bound; ceiling * C <= 2^53, so exact).
-- Sliding window: cur += cost in the current window. Both may leave the
-- limit over its capacity: check.lua then denies until the debt is paid.
-- Returns the key's new expiry (ms, on the script's clock).
local function force(key, algorithm, n, w, cost, ceiling, now)
  if algorithm == 'concurrent' then
    return now -- never: a slot's real cost is 0 (the policy's max)
  end
  local state = redis.call('GET', key)
  if algorithm == 'token_bucket' then
    local d, r = tb_use(state, now)
    if d > ceiling then d, r = ceiling, 0 end
    local used = d * n + r
    local room = math.max(ceiling * n - used, 0)
    local add = room
    if cost < divmod(room, w) then add = cost * w end
    local q, rem = divmod(used + add, n)
    local life = ceildiv(used + add, n) + 1
    redis.call('SET', key, fmt(now + q) .. ':' .. fmt(rem), 'PX', fmt(ttl(life)))
    return now + ttl(life)
  elseif algorithm == 'sliding_window' then
    local sk, sc, sp
    if state then
      sk, sc, sp = string.match(state, '^(%d+):(%d+):(%d+)$')
      sk, sc, sp = tonumber(sk), tonumber(sc), tonumber(sp)
    end
    local k = divmod(now, w)
    local cur, prev = 0, 0
    if sk and sc and sp then
      if sk >= k then
        k, cur, prev = sk, sc, sp -- a clock behind the window counts as its start
      elseif sk + 1 == k then
        prev = sc
      end
    end
    local window_end = (k + 1) * w - now
    redis.call('SET', key, fmt(k) .. ':' .. fmt(cur + cost) .. ':' .. fmt(prev),
      'PX', fmt(ttl(window_end + w)))
    return now + ttl(window_end + w)
  end
  return now
end

-- The domain's ledger of live keys (the key budget's count; check.lua):
-- `key` lives until `expire_ms` (on the script's clock), and the ledger as
-- long as its longest-lived key.
local function ledger_track(ledger, key, expire_ms)
  redis.call('ZADD', ledger, fmt(expire_ms), key)
end

local function ledger_keep(ledger, now)
  local last = redis.call('ZRANGE', ledger, -1, -1, 'WITHSCORES')
  if last[2] then redis.call('PEXPIREAT', ledger, fmt(expire_at(tonumber(last[2]) - now))) end
end

-- Gives `amount` back to the quota at key base `base`, counted at
-- `charged_at` (ms): the key of the period that held it gets DECRBY amount,
-- floored at 0 (deleted at 0), only while now is still in that period. The
-- expiry is kept: it can only be later than needed, never earlier.
local function quota_give_back(base, period, amount, charged_at, now)
  local start = period_bounds(period, divmod(charged_at, 1000))
  if not start or start ~= period_bounds(period, divmod(now, 1000)) then
    return false
  end
  local key = base .. '|' .. fmt(start)
  local count = tonumber(redis.call('GET', key) or '')
  if not count then
    return false
  end
  if count <= amount then
    redis.call('DEL', key)
  else
    redis.call('DECRBY', key, fmt(amount))
  end
  return true
end

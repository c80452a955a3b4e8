-- ratelimit-gateway: check-and-consume for every limit and every quota of one
-- call, atomically, all or nothing.
--
-- KEYS[1..L]       one Redis key per limit (all keys of a call in one cluster slot)
-- KEYS[L+1..L+Q]   one key base per quota, "<prefix>{<domain>|<tag>}|q|<key>|<period>";
--                  the key used is "<base>|<period start, epoch s>" (same hash
--                  tag, so same slot), since only this script knows the time
-- ARGV[1]          "1": charge everything when everything passes; "0": dry run
--                  (evaluate only, write nothing)
-- ARGV[2]          "": time comes from Redis TIME (the service's clock,
--                  clock::RedisTime); else a time in ms the script runs at (a
--                  clock::FixedClock, e.g. the differential test against the
--                  Rust buckets and the quota period tests). Every key gets a
--                  expiry (PX, PEXPIREAT; common.lua's ttl).
-- ARGV[3]          L, the number of limit keys
-- ARGV[5i-1..5i+3] per limit key i (i = 1..L): algorithm ("token_bucket" |
--                  "sliding_window" | "concurrent"), requests (N, C or slots), window_ms
--                  (W; a slot's longest hold), cost (>= 1; 1 for a slot), ceiling (ms >=
--                  W: a token bucket's TAT up to now + ceiling is a settlement's debt;
--                  common.lua's limit_args)
-- ARGV[5L+3j+1..5L+3j+3]
--                  per quota j (j = 1..Q): period ("minute" | "hour" | "day" | "month"),
--                  limit (0..2^50), amount (>= 1)
-- ARGV[last-1]     the reservation record's life in ms; 0: no record
-- KEYS[L+Q+1]      (when ARGV[last-1] > 0) the reservation record: an allowed
--                  charge writes there what it charged (a hash: "@at" -> now_ms,
--                  each limit key -> cost, each quota key base -> amount), which
--                  settle.lua reads once. Its name is also the request's member
--                  in a concurrency limit's sorted set (a "concurrent" limit
--                  needs it)
-- KEYS[last]       the domain's ledger of live keys, "<prefix>{<domain>|live}"
--                  (on a cluster "<prefix>{<domain>|live|<n>}", n chosen so
--                  that it shares the other keys' slot): a sorted set of the
--                  keys the domain holds, scored by their expiry (ms)
-- ARGV[last]       the key budget: how many live keys the ledger may hold
--                  (0: no budget). A charge that would create a key past it
--                  is refused with the error "KEYBUDGET"; existing keys keep
--                  working, and nothing is written.
--
-- Returns { all_allowed (1|0), now_ms,
--           then per limit: allowed (1|0), remaining, reset_ms, retry_after_ms,
--           then per quota: allowed (1|0), remaining, reset_ms }.
--
-- A concurrency limit's key is a sorted set of the requests holding a slot,
-- each scored by its deadline (now + W): the members scored after now hold
-- the slots; a charge drops the expired ones and adds the request's. A
-- request already holding a live slot (a retried check) is allowed again
-- without a second slot. As the filter's own concurrency limits: reset 0
-- when allowed; reset and retry 1 s when denied.
--
-- All or nothing: if any limit denies, nothing is charged (the quotas report
-- their uncharged state); else if any quota would be exceeded, nothing is
-- charged; else every limit and every quota is charged. A denied token bucket
-- read as more than empty (Redis time went backwards) still stores that bound.
--
-- clock, ttl, expire_at, divmod, ceildiv, fmt, period_bounds, tb_use,
-- limit_args, ledger_track and ledger_keep come from common.lua, which script.rs puts in front (with why the arithmetic is exact).

local commit = ARGV[1] == '1'
local now = clock(ARGV[2])
local ledger = KEYS[#KEYS]
local budget = tonumber(ARGV[#ARGV]) or 0
local record_ms = tonumber(ARGV[#ARGV - 1]) or 0
local n_limits = tonumber(ARGV[3])
local n_quotas = (#ARGV - 5 - 5 * n_limits) / 3
local record = nil
if record_ms > 0 then record = KEYS[n_limits + n_quotas + 1] end
local fresh = {} -- keys this call would create, as a set
local n_fresh = 0
local function created(key)
  if not fresh[key] then
    fresh[key] = true
    n_fresh = n_fresh + 1
  end
end

-- Token bucket (GCRA). State "tat_ms:rem": TAT = tat_ms + rem/C ms, 0 <= rem < C.
-- The bucket holds TAT - now = d + r/C ms of use (0 when the TAT is past), i.e.
-- used = d*C + r in units of 1/C ms, at most tol = W*C <= 2^53. A TAT more
-- than a full bucket ahead only comes from Redis time that went backwards: it
-- reads as an empty bucket (d = W, r = 0), never emptier, as the filter's
-- token_bucket.rs; a denial then stores that bound (returned as its state), so
-- the bucket refills from the step on instead of after it.
-- A TAT up to `cap` ahead (the ceiling, >= W) is debt a settlement left:
-- denied, with a wait that covers it.
local function token_bucket(state, c, w, cost, cap)
  local d, r = tb_use(state, now)
  local bounded = false
  if d > cap or (d == cap and r > 0) then
    d, r, bounded = cap, 0, true
  end
  local tol = w * c
  local free = 0
  if d < w then free = tol - (d * c + r) end -- then d*C + r < tol: exact, free >= 1
  if cost <= c and cost * w <= free then
    local need = tol - free + cost * w
    local q, rem = divmod(need, c)
    local reset = ceildiv(need, c)
    return true, fmt(now + q) .. ':' .. fmt(rem), divmod(free - cost * w, w), reset, 0, reset
  end
  local remaining = 0
  if free > 0 then remaining = divmod(free, w) end
  -- ceil(used / C)
  local reset = d
  if r > 0 then reset = d + 1 end
  local retry = w -- a cost above the capacity can never pass: a full window
  if cost <= c then
    -- ceil((used + cost*W - tol) / C) = (d - W) + ceil((r + cost*W) / C)
    local q1, r1 = divmod(cost * w, c)
    retry = d - w + q1
    if r + r1 > 0 then
      if r1 <= c - r then retry = retry + 1 else retry = retry + 2 end
    end
  end
  if bounded then
    return false, fmt(now + cap) .. ':0', remaining, reset, retry, reset
  end
  return false, nil, remaining, reset, retry, 0
end

-- Sliding-window counter. State "k:cur:prev", k = floor(now / W). A clock
-- behind the stored window (Redis time went backwards) counts as that
-- window's start, as the filter's sliding_window.rs: the counts are kept, and
-- reset and retry include the wait for the clock to catch up (`behind`).
local function sliding_window(state, n, w, cost)
  local sk, sc, sp
  if state then
    sk, sc, sp = string.match(state, '^(%d+):(%d+):(%d+)$')
    sk, sc, sp = tonumber(sk), tonumber(sc), tonumber(sp)
  end
  local t = now
  if sk and sk * w > now then t = sk * w end
  local behind = t - now
  local k, elapsed = divmod(t, w)
  local cur, prev = 0, 0
  if sk and sc and sp then
    if sk == k then
      cur, prev = sc, sp
    elseif sk + 1 == k then
      cur, prev = 0, sc
    end
  end
  -- Everything is multiplied by W to stay in integers.
  local room = n * w - (prev * (w - elapsed) + cur * w)
  local window_end = w - elapsed
  if cost <= n and cost * w <= room then
    local reset = window_end + w + behind
    return true, fmt(k) .. ':' .. fmt(cur + cost) .. ':' .. fmt(prev),
      divmod(room - cost * w, w), reset, 0, reset
  end
  local remaining = 0
  if room > 0 then remaining = divmod(room, w) end
  local reset = 0
  if cur > 0 then reset = window_end + w + behind elseif prev > 0 then reset = window_end + behind end
  local retry = w
  if cost <= n then
    -- The elapsed time in a window from which fading * (W - e) <= spare * W.
    local function from(fading, spare)
      if fading == 0 then return 0 end
      local q = divmod(spare * w, fading)
      if q >= w then return 0 end
      return w - q
    end
    retry = nil
    if cur + cost <= n then
      local e = from(prev, n - cur - cost)
      if e < w then retry = math.max(e - elapsed, 1) end
    end
    if not retry then retry = window_end + from(cur, n - cost) end
  end
  return false, nil, remaining, reset, retry + behind, 0
end

-- Concurrency limit: the live slots at `key` (sorted set; members scored by
-- deadline), with `member` taking one more if there is room.
local function in_flight(key, n, w, member)
  local live = redis.call('ZCOUNT', key, '(' .. fmt(now), '+inf')
  local mine = tonumber(redis.call('ZSCORE', key, member) or '')
  if mine and mine > now then
    return true, fmt(now + w), n - math.min(live, n), 0, 0, w
  end
  if live < n then
    return true, fmt(now + w), n - live - 1, 0, 0, w
  end
  return false, nil, 0, 1000, 1000, 0
end

local out = { 1, now }
local pending = {} -- state written by an earlier limit of this call (same key twice)
local writes = {}
local bounds = {} -- token-bucket bounds of denied limits (time went backwards)
local all = true
for i = 1, n_limits do
  local key = KEYS[i]
  local algorithm, requests, window, cost, ceiling = limit_args(i)
  local state = pending[key]
  if algorithm == 'concurrent' then
    if not record then
      return redis.error_reply('ERR ratelimit: a concurrent limit needs a reservation record')
    end
    if redis.call('EXISTS', key) == 0 then created(key) end
  elseif state == nil then
    state = redis.call('GET', key)
    if not state then created(key) end
  end
  local ok, new_state, remaining, reset, retry, ttl
  if algorithm == 'concurrent' then
    ok, new_state, remaining, reset, retry, ttl = in_flight(key, requests, window, record)
  elseif algorithm == 'token_bucket' then
    ok, new_state, remaining, reset, retry, ttl = token_bucket(state, requests, window, cost, ceiling)
  elseif algorithm == 'sliding_window' then
    ok, new_state, remaining, reset, retry, ttl = sliding_window(state, requests, window, cost)
  else
    return redis.error_reply('ERR ratelimit: unknown algorithm ' .. tostring(algorithm))
  end
  if ok and algorithm == 'concurrent' then
    writes[#writes + 1] = { key, new_state, ttl, record }
    out[#out + 1] = 1
  elseif ok then
    pending[key] = new_state
    writes[#writes + 1] = { key, new_state, ttl }
    out[#out + 1] = 1
  else
    all = false
    if new_state then bounds[#bounds + 1] = { key, new_state, ttl } end
    out[#out + 1] = 0
  end
  out[#out + 1] = remaining
  out[#out + 1] = reset
  out[#out + 1] = retry
end

-- Quotas: count + amount <= limit, with count from this period's key (and
-- the earlier quotas of this call with the same key).
local sec = divmod(now, 1000)
local counts = {}
local quotas = {}
for j = 1, n_quotas do
  local a = 5 * n_limits + 3 * j
  local period = ARGV[a + 1]
  local limit = tonumber(ARGV[a + 2])
  local amount = tonumber(ARGV[a + 3])
  local start, stop = period_bounds(period, sec)
  if not start then
    return redis.error_reply('ERR ratelimit: unknown period ' .. tostring(period))
  end
  local key = KEYS[n_limits + j] .. '|' .. fmt(start)
  local count = counts[key]
  if count == nil then
    local stored = redis.call('GET', key)
    if not stored then created(key) end
    count = tonumber(stored or '0') or 0
  end
  local ok = amount <= limit - count
  if ok then counts[key] = count + amount else all = false end
  quotas[j] = { key, ok, limit - count, amount, stop * 1000 - now, stop * 1000 }
end

local charge = all and commit
for _, q in ipairs(quotas) do
  local ok, left = q[2], q[3]
  if charge then left = left - q[4] end -- after the request, only when charged
  if left < 0 then left = 0 end
  if ok then out[#out + 1] = 1 else out[#out + 1] = 0 end
  out[#out + 1] = left
  out[#out + 1] = q[5]
end

-- A denial writes only the bounds; a pass every charge. A later write to the
-- same key carries every earlier charge of this call. A slot (a fourth
-- field: the member) is added to its set, whose expired members go, and the
-- set lives as long as its newest slot.
local function set_all(list)
  for _, wr in ipairs(list) do
    if wr[4] then
      redis.call('ZREMRANGEBYSCORE', wr[1], '-inf', fmt(now))
      redis.call('ZADD', wr[1], wr[2], wr[4])
      redis.call('PEXPIRE', wr[1], fmt(ttl(wr[3])))
    else
      redis.call('SET', wr[1], wr[2], 'PX', fmt(ttl(wr[3])))
    end
  end
end

-- The ledger forgets expired keys, then must have room for the new ones.
local function track(key, expire_ms)
  if budget > 0 then ledger_track(ledger, key, expire_ms) end
end

if not all then
  out[1] = 0
  if commit then set_all(bounds) end
elseif commit then
  if budget > 0 and n_fresh > 0 then
    redis.call('ZREMRANGEBYSCORE', ledger, '-inf', fmt(now))
    local live = redis.call('ZCARD', ledger)
    if live + n_fresh > budget then
      return redis.error_reply('KEYBUDGET ratelimit: ' .. fmt(live) .. ' live keys of '
        .. fmt(budget) .. ', ' .. fmt(n_fresh) .. ' more refused')
    end
  end
  set_all(writes)
  for _, wr in ipairs(writes) do track(wr[1], now + ttl(wr[3])) end
  for _, q in ipairs(quotas) do
    redis.call('INCRBY', q[1], fmt(q[4]))
    -- The key names its period, so a late write can never extend an old one.
    redis.call('PEXPIREAT', q[1], fmt(expire_at(q[6] - now)))
    track(q[1], now + ttl(q[6] - now))
  end
  if record then
    local fields = { '@at', fmt(now) }
    for i = 1, n_limits do
      local _, _, _, cost = limit_args(i)
      fields[#fields + 1] = KEYS[i]
      fields[#fields + 1] = fmt(cost)
    end
    for j, q in ipairs(quotas) do
      fields[#fields + 1] = KEYS[n_limits + j]
      fields[#fields + 1] = fmt(q[4])
    end
    redis.call('HSET', record, unpack(fields))
    redis.call('PEXPIRE', record, fmt(ttl(record_ms)))
  end
  if budget > 0 then
    ledger_keep(ledger, now)
  end
end
return out

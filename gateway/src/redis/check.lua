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
-- ARGV[5L+3Q+6s-2..5L+3Q+6s+3]
--                  per special limit s (s = 1..S): the limit's index i, watched
--                  (1|0), burst (a graduated token bucket's size in tokens,
--                  >= requests; 0: not graduated), demand (the demand bucket's
--                  size in tokens; 0: no block stage), block_ms (a new block's
--                  length, jitter included), longest_ms (the longest block the
--                  policy gives: a stored block longer than that only comes
--                  from Redis time that went backwards)
-- ARGV[last-2]     S, the number of special limits (watched or graduated)
-- KEYS[L+Q+2g-1..L+Q+2g]
--                  per graduated special limit g, in order: its demand key and
--                  its block key (same hash tag as its limit key)
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
--           then per quota: allowed (1|0), remaining, reset_ms,
--           then per special limit: used (whole tokens in use: after the
--           request when it passes, before it otherwise), blocked (1|0) }.
--
-- A watched limit (a shadow rule, a soft client) answers like the others
-- but never makes the call denied; the watched limits are charged, all or
-- nothing among themselves, only when the call is allowed.
--
-- A graduated limit (a token bucket of `burst` tokens): while its block key
-- holds a time after now the client is blocked (denied, retry at that
-- time) and nothing else of the limit is read. Else the request counts in
-- the demand bucket (`demand` tokens, same rate; a request that does not
-- fit fills it): when that is full the client is blocked for block_ms (the
-- block key, expiring then) and the demand starts over. Demand and blocks
-- are written whether the call is allowed or denied (never in a dry run),
-- as the filter's own graduated rules do.
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
local n_special = tonumber(ARGV[#ARGV - 2]) or 0
local n_limits = tonumber(ARGV[3])
local n_quotas = (#ARGV - 6 - 5 * n_limits - 6 * n_special) / 3
-- The special limits by index: { watched, burst, demand, block_ms,
-- longest_ms, demand key, block key }.
local special = {}
local n_graduated = 0
for s = 1, n_special do
  local a = 3 + 5 * n_limits + 3 * n_quotas + 6 * (s - 1)
  local sp = { ARGV[a + 2] == '1', tonumber(ARGV[a + 3]), tonumber(ARGV[a + 4]),
    tonumber(ARGV[a + 5]), tonumber(ARGV[a + 6]) }
  if sp[2] > 0 then
    sp[6] = KEYS[n_limits + n_quotas + 2 * n_graduated + 1]
    sp[7] = KEYS[n_limits + n_quotas + 2 * n_graduated + 2]
    n_graduated = n_graduated + 1
  end
  special[tonumber(ARGV[a + 1])] = sp
end
local record = nil
if record_ms > 0 then record = KEYS[n_limits + n_quotas + 2 * n_graduated + 1] end
local fresh = {} -- keys this call would create, as a set
local n_fresh = 0
local function created(key)
  if not fresh[key] then
    fresh[key] = true
    n_fresh = n_fresh + 1
  end
end
-- Keys of watched limits and of demands and blocks, counted apart: each is
-- written on its own condition.
local fresh_watched, fresh_always = {}, {}
local function created_in(set, key)
  if not set[key] and not fresh[key] then set[key] = true end
end
local function count(set)
  local n = 0
  for _ in pairs(set) do n = n + 1 end
  return n
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
-- A graduated rule's bucket holds b >= C tokens (reject_at of the limit):
-- tol = W*b, and remaining counts only up to C. The last value returned is
-- the use in units of 1/C ms (after the request when it passes).
local function token_bucket(state, c, w, cost, cap, b)
  local d, r = tb_use(state, now)
  local bounded = false
  if d > cap or (d == cap and r > 0) then
    d, r, bounded = cap, 0, true
  end
  local tol = w * b
  local used = d * c + r -- exact: cap * C <= 2^53 (script.rs ceiling)
  local free = 0
  if used < tol then free = tol - used end
  local over = (b - c) * w -- the part of the bucket past 100% of the limit
  if cost <= b and cost * w <= free then
    local need = tol - free + cost * w
    local q, rem = divmod(need, c)
    local reset = ceildiv(need, c)
    local left = 0
    if free - cost * w > over then left = divmod(free - cost * w - over, w) end
    return true, fmt(now + q) .. ':' .. fmt(rem), left, reset, 0, reset, need
  end
  local remaining = 0
  if free > over then remaining = divmod(free - over, w) end
  -- ceil(used / C)
  local reset = d
  if r > 0 then reset = d + 1 end
  local retry = w -- a cost above the capacity can never pass: a full window
  if cost <= b then
    -- ceil((used + cost*W - tol) / C), tol = W*b: with W*b = C*wb + rb,
    -- (d - wb) + ceil((r + cost*W - rb) / C), each part exact
    local wb, rb = divmod(w * b, c)
    local q1, r1 = divmod(cost * w, c)
    retry = d - wb + q1
    local extra = r + r1 - rb -- in (-C, 2C)
    if extra > c then retry = retry + 2 elseif extra > 0 then retry = retry + 1 end
  end
  if bounded then
    return false, fmt(now + cap) .. ':0', remaining, reset, retry, reset, used
  end
  return false, nil, remaining, reset, retry, 0, used
end

-- A graduated limit's block (KEYS sp[7]): its end in ms while it lasts,
-- bounded by longest_ms from now, and whether the bound must be stored.
local function block_of(sp)
  local stored = tonumber(redis.call('GET', sp[7]) or '')
  if not stored or stored <= now then return nil, false end
  if stored > now + sp[5] then return now + sp[5], true end
  return stored, false
end

-- Counts `cost` in a graduated limit's demand bucket (sp[3] tokens of the
-- limit's rate C/W): its new state, and whether it is full (a block).
local function demand_of(sp, c, w, cost)
  local state = redis.call('GET', sp[6])
  if not state then created_in(fresh_always, sp[6]) end
  local d, r = tb_use(state, now)
  local tol = w * sp[3]
  local used = d * c + r
  if used > tol then used = tol end -- Redis time went backwards
  used = used + cost * w
  if used > tol then used = tol end
  local full = ceildiv(used, w) >= sp[3]
  local q, rem = divmod(used, c)
  return fmt(now + q) .. ':' .. fmt(rem), ceildiv(used, c), full
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
local watched_writes = {} -- charges of watched limits: only when all pass
local watched_ok = true
local always = {} -- demands and blocks of graduated limits: allowed or denied
local bounds = {} -- token-bucket bounds of denied limits (time went backwards)
local stages = {} -- per special limit: used tokens, blocked
local all = true
for i = 1, n_limits do
  local key = KEYS[i]
  local algorithm, requests, window, cost, ceiling = limit_args(i)
  local sp = special[i]
  local watched = sp ~= nil and sp[1]
  local state = pending[key]
  local ok, new_state, remaining, reset, retry, ttl, used
  local blocked = false
  if sp and sp[2] > 0 and algorithm == 'token_bucket' then
    local until_ms, bound = block_of(sp)
    if until_ms then
      if bound then always[#always + 1] = { sp[7], fmt(until_ms), until_ms - now } end
      blocked = true
      ok, remaining, reset, retry, used = false, 0, until_ms - now, until_ms - now, 0
    elseif sp[3] > 0 then
      local d_state, d_life, full = demand_of(sp, requests, window, cost)
      if full then
        until_ms = now + sp[4]
        created_in(fresh_always, sp[7])
        always[#always + 1] = { sp[7], fmt(until_ms), sp[4] }
        always[#always + 1] = { sp[6], nil }
        blocked = true
        ok, remaining, reset, retry, used = false, 0, sp[4], sp[4], 0
      else
        always[#always + 1] = { sp[6], d_state, d_life + 1 }
      end
    end
  end
  local mark = created
  if watched then mark = function(k) created_in(fresh_watched, k) end end
  if blocked then
    -- the limit itself is not read
  elseif algorithm == 'concurrent' then
    if not record then
      return redis.error_reply('ERR ratelimit: a concurrent limit needs a reservation record')
    end
    if redis.call('EXISTS', key) == 0 then mark(key) end
  elseif state == nil then
    state = redis.call('GET', key)
    if not state then mark(key) end
  end
  local burst = requests
  if sp and sp[2] > 0 then burst = sp[2] end
  if blocked then
    -- answered above
  elseif algorithm == 'concurrent' then
    ok, new_state, remaining, reset, retry, ttl = in_flight(key, requests, window, record)
  elseif algorithm == 'token_bucket' then
    ok, new_state, remaining, reset, retry, ttl, used = token_bucket(state, requests, window, cost, ceiling, burst)
  elseif algorithm == 'sliding_window' then
    ok, new_state, remaining, reset, retry, ttl = sliding_window(state, requests, window, cost)
  else
    return redis.error_reply('ERR ratelimit: unknown algorithm ' .. tostring(algorithm))
  end
  local list = writes
  if watched then list = watched_writes end
  if ok and algorithm == 'concurrent' then
    list[#list + 1] = { key, new_state, ttl, record }
    out[#out + 1] = 1
  elseif ok then
    pending[key] = new_state
    list[#list + 1] = { key, new_state, ttl }
    out[#out + 1] = 1
  else
    if watched then watched_ok = false else all = false end
    if new_state then bounds[#bounds + 1] = { key, new_state, ttl } end
    out[#out + 1] = 0
  end
  out[#out + 1] = remaining
  out[#out + 1] = reset
  out[#out + 1] = retry
  if sp then
    local tokens = 0
    if used then tokens = ceildiv(used, window) end
    local b = 0
    if blocked then b = 1 end
    stages[#stages + 1] = { tokens, b }
  end
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
for _, st in ipairs(stages) do
  out[#out + 1] = st[1]
  out[#out + 1] = st[2]
end

-- A denial writes only the bounds; a pass every charge. A later write to the
-- same key carries every earlier charge of this call. A slot (a fourth
-- field: the member) is added to its set, whose expired members go, and the
-- set lives as long as its newest slot.
local function set_all(list)
  for _, wr in ipairs(list) do
    if wr[2] == nil then
      redis.call('DEL', wr[1])
    elseif wr[4] then
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

-- Demands and blocks are written allowed or denied; the watched charges
-- only with the call's, and only when every watched limit has room.
local charge_watched = all and watched_ok
if commit then
  local n_new = count(fresh_always)
  if all then n_new = n_new + n_fresh end
  if charge_watched then n_new = n_new + count(fresh_watched) end
  if budget > 0 and n_new > 0 then
    redis.call('ZREMRANGEBYSCORE', ledger, '-inf', fmt(now))
    local live = redis.call('ZCARD', ledger)
    if live + n_new > budget then
      return redis.error_reply('KEYBUDGET ratelimit: ' .. fmt(live) .. ' live keys of '
        .. fmt(budget) .. ', ' .. fmt(n_new) .. ' more refused')
    end
  end
  set_all(always)
  for _, wr in ipairs(always) do
    if wr[2] ~= nil then track(wr[1], now + ttl(wr[3])) end
  end
  if charge_watched then
    set_all(watched_writes)
    for _, wr in ipairs(watched_writes) do track(wr[1], now + ttl(wr[3])) end
  end
  if #always > 0 and not all and budget > 0 then ledger_keep(ledger, now) end
end

if not all then
  out[1] = 0
  if commit then set_all(bounds) end
elseif commit then
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
      local sp = special[i]
      -- Only what was charged: a watched limit only with the watched charge.
      if not (sp and sp[1]) or charge_watched then
        fields[#fields + 1] = KEYS[i]
        fields[#fields + 1] = fmt(cost)
      end
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

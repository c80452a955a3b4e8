-- ratelimit-gateway: lease a batch of tokens of one token bucket, atomically
-- over every limit of the bucket.
--
-- KEYS[1..L]        one Redis key per limit: exactly the keys check.lua gets
--                   for the same bucket (one domain and tag: one cluster slot),
--                   so leases and checks draw from one bucket
-- KEYS[L+1]         the caller's ledger of this bucket (same slot): the tokens
--                   it was granted and has not given back
-- ARGV[1]           "": time comes from Redis TIME; else a time in ms the
--                   script runs at (as in check.lua). Every key gets a
--                   expiry (PX; common.lua's ttl).
-- ARGV[2]           want (1..2^53): tokens asked for
-- ARGV[3]           return (0..2^53): unspent tokens of the caller's previous
--                   lease on this bucket; at most what its ledger holds is taken
-- ARGV[4]           the ledger's life in ms (twice the policy's lease.ttl_ms)
-- ARGV[2i+3..2i+4]  per limit i (i = 1..L): requests (C), window_ms (W); every
--                   limit is a token bucket
--
-- Returns { granted, taken back, then per limit: remaining, reset_ms,
-- retry_after_ms }.
--
-- 0. The caller gives back at most what its ledger holds: return is capped
--    there. The ledger then holds held - taken back + granted, for ARGV[4] ms
--    from this call (deleted at 0): tokens granted and not given back, spent
--    or not, so a caller can refill a bucket with its own grants only.
-- 1. Give back: in every limit the TAT goes back by return * W / C ms,
--    floored at now (as refund.lua gives back a token-bucket charge).
-- 2. Grant g = min(want, every C, every limit's whole tokens free now), and
--    charge g in every limit as check.lua charges a cost of g. When g is 0
--    nothing is charged, but what step 1 gave back is still written.
-- 3. Every write sets PX to the time until the limit is full again (reset_ms),
--    as check.lua does; a limit full again is deleted. A TAT more than a full
--    bucket ahead (Redis time went backwards) reads, after step 1, as an
--    empty bucket, and that bound is written, as check.lua.
--
-- State "tat_ms:rem" and arithmetic exactly as check.lua: every quantity is
-- an integer of at most 2^53 (the gateway rejects requests * window_ms > 2^53,
-- want and return > 2^53), so every + - * is exact, and divisions go through
-- divmod (math.fmod is exact).

-- clock, ttl, divmod, ceildiv, fmt and tb_use come from common.lua, which script.rs puts
-- in front: the same rounding as check.lua.

local now = clock(ARGV[1])
local want = tonumber(ARGV[2])
local give = tonumber(ARGV[3])
local ledger_ttl = ARGV[4]
local L = #KEYS - 1
local ledger = KEYS[L + 1]
local held = tonumber(redis.call('GET', ledger) or '0') or 0
if give > held then give = held end

-- (d, r) with n tokens given back: n*W/C ms less, floored at now. With
-- n = a*C + b the products stay below 2^53: b*W < C*W, and a*W is formed only
-- when a <= floor(d/W) + 1 (a larger a takes back more than d + 1 ms).
local function use_less(d, r, c, w, n)
  local a, b = divmod(n, c)
  if a > divmod(d, w) + 1 then return 0, 0 end
  local q1, r1 = divmod(b * w, c)
  d, r = d - a * w - q1, r - r1
  if r < 0 then
    d, r = d - 1, r + c
  end
  if d < 0 or (d == 0 and r == 0) then return 0, 0 end
  return d, r
end

local limits = {}
local granted = want
for i = 1, L do
  local c = tonumber(ARGV[2 * i + 3])
  local w = tonumber(ARGV[2 * i + 4])
  -- The bucket's use as check.lua reads it (common.lua's tb_use).
  local d0, r0 = tb_use(redis.call('GET', KEYS[i]), now)
  local d, r = use_less(d0, r0, c, w, give)
  -- More than a full bucket of use only comes from Redis time that went
  -- backwards: it reads as an empty bucket and that bound is stored, as in
  -- check.lua (bounded after the give-back, as the filter's refund then check).
  if d > w or (d == w and r > 0) then
    d, r = w, 0
  end
  -- Free use in units of 1/C ms, as check.lua.
  local free = 0
  if d < w then free = w * c - (d * c + r) end
  local whole = 0
  if free > 0 then whole = divmod(free, w) end
  if c < granted then granted = c end
  if whole < granted then granted = whole end
  limits[i] = { c = c, w = w, d = d, r = r, free = free, whole = whole,
                given = d ~= d0 or r ~= r0 }
end

local out = { granted, give }
for i, l in ipairs(limits) do
  local c, w, d, r = l.c, l.w, l.d, l.r
  local state, remaining, reset, retry
  if granted > 0 then
    -- granted <= whole here, so d < W and need <= W*C: exact.
    local need = d * c + r + granted * w
    local q, rem = divmod(need, c)
    state = fmt(now + q) .. ':' .. fmt(rem)
    remaining = divmod(l.free - granted * w, w)
    reset = ceildiv(need, c)
    retry = 0
  else
    remaining = l.whole
    reset = d
    if r > 0 then reset = d + 1 end
    retry = 0
    if l.whole < 1 then
      -- check.lua's retry for cost 1: (d - W) + ceil((r + W) / C).
      local q1, r1 = divmod(w, c)
      retry = d - w + q1
      if r + r1 > 0 then
        if r1 <= c - r then retry = retry + 1 else retry = retry + 2 end
      end
    end
    if l.given then
      if reset == 0 then state = false else state = fmt(now + d) .. ':' .. fmt(r) end
    end
  end
  if state == false then
    redis.call('DEL', KEYS[i])
  elseif state then
    redis.call('SET', KEYS[i], state, 'PX', fmt(ttl(reset)))
  end
  out[#out + 1] = remaining
  out[#out + 1] = reset
  out[#out + 1] = retry
end
-- The ledger is written only when it changes: a call that grants and
-- takes back nothing writes nothing at all.
local now_held = held - give + granted
if now_held > 0 and (give > 0 or granted > 0) then
  redis.call('SET', ledger, fmt(now_held), 'PX', fmt(ttl(tonumber(ledger_ttl))))
elseif now_held == 0 and held > 0 then
  redis.call('DEL', ledger)
end
return out

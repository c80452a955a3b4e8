-- ratelimit-gateway: check-and-consume for every limit of one call, atomically.
--
-- KEYS[i]          one Redis key per limit (all in one cluster slot)
-- ARGV[1]          "1": charge every key when every limit passes; "0": dry run
--                  (evaluate only, write nothing)
-- ARGV[2]          "" in production: time comes from Redis TIME. TEST ONLY: a
--                  time in ms overrides it, and then keys are written without
--                  an expiry (Redis expires on its own clock, which the
--                  overridden time does not follow). Used only by the
--                  differential test against the Rust buckets.
-- ARGV[4i-1..4i+2] per key i: algorithm ("token_bucket" | "sliding_window"),
--                  requests (N or C), window_ms (W), cost (>= 1)
--
-- Returns { all_allowed (1|0), now_ms,
--           then per key: allowed (1|0), remaining, reset_ms, retry_after_ms }.
--
-- Lua numbers are doubles: every quantity below is an integer of at most
-- 2^53 (the gateway rejects requests * window_ms > 2^53 and costs > 2^53), so
-- every + - * is exact. Division is never trusted near integers: divmod uses
-- fmod, which is exact for doubles, and then divides an exact multiple.

local commit = ARGV[1] == '1'
local now
local override = ARGV[2] ~= ''
if override then
  now = tonumber(ARGV[2])
else
  local t = redis.call('TIME')
  now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
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

-- Token bucket (GCRA). State "tat_ms:rem": TAT = tat_ms + rem/C ms, 0 <= rem < C.
-- The bucket holds TAT - now = d + r/C ms of use (0 when the TAT is past), i.e.
-- used = d*C + r in units of 1/C ms, below tol = W*C <= 2^53 whenever the
-- request can pass. Only when Redis time went backwards can d exceed W; then
-- the request is denied and reset / retry are computed from d and r directly,
-- so they stay exact too.
local function token_bucket(state, c, w, cost)
  local d, r = 0, 0
  if state then
    local t, rr = string.match(state, '^(%d+):(%d+)$')
    t, rr = tonumber(t), tonumber(rr)
    if t and rr and (t > now or (t == now and rr > 0)) then
      d, r = t - now, rr
    end
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
  return false, nil, remaining, reset, retry, 0
end

-- Sliding-window counter. State "k:cur:prev", k = floor(now / W).
local function sliding_window(state, n, w, cost)
  local k, elapsed = divmod(now, w)
  local cur, prev = 0, 0
  if state then
    local sk, sc, sp = string.match(state, '^(%d+):(%d+):(%d+)$')
    sk, sc, sp = tonumber(sk), tonumber(sc), tonumber(sp)
    if sk and sc and sp then
      if sk == k then
        cur, prev = sc, sp
      elseif sk + 1 == k then
        cur, prev = 0, sc
      end
    end
  end
  -- Everything is multiplied by W to stay in integers.
  local room = n * w - (prev * (w - elapsed) + cur * w)
  local window_end = w - elapsed
  if cost <= n and cost * w <= room then
    local reset = window_end + w
    return true, fmt(k) .. ':' .. fmt(cur + cost) .. ':' .. fmt(prev),
      divmod(room - cost * w, w), reset, 0, reset
  end
  local remaining = 0
  if room > 0 then remaining = divmod(room, w) end
  local reset = 0
  if cur > 0 then reset = window_end + w elseif prev > 0 then reset = window_end end
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
  return false, nil, remaining, reset, retry, 0
end

local out = { 1, now }
local pending = {} -- state written by an earlier limit of this call (same key twice)
local writes = {}
local all = true
for i = 1, #KEYS do
  local key = KEYS[i]
  local algorithm = ARGV[4 * i - 1]
  local requests = tonumber(ARGV[4 * i])
  local window = tonumber(ARGV[4 * i + 1])
  local cost = tonumber(ARGV[4 * i + 2])
  local state = pending[key]
  if state == nil then state = redis.call('GET', key) end
  local ok, new_state, remaining, reset, retry, ttl
  if algorithm == 'token_bucket' then
    ok, new_state, remaining, reset, retry, ttl = token_bucket(state, requests, window, cost)
  elseif algorithm == 'sliding_window' then
    ok, new_state, remaining, reset, retry, ttl = sliding_window(state, requests, window, cost)
  else
    return redis.error_reply('ERR ratelimit: unknown algorithm ' .. tostring(algorithm))
  end
  if ok then
    pending[key] = new_state
    writes[#writes + 1] = { key, new_state, ttl }
    out[#out + 1] = 1
  else
    all = false
    out[#out + 1] = 0
  end
  out[#out + 1] = remaining
  out[#out + 1] = reset
  out[#out + 1] = retry
end

if not all then
  out[1] = 0
elseif commit then
  -- A later write to the same key carries every earlier charge of this call.
  for _, wr in ipairs(writes) do
    if override then
      redis.call('SET', wr[1], wr[2])
    else
      redis.call('SET', wr[1], wr[2], 'PX', fmt(wr[3]))
    end
  end
end
return out

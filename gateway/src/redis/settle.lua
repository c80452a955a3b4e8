-- ratelimit-gateway: settle what check.lua reserved for one request, once.
--
-- KEYS[1..L]       limit keys of the buckets settled (one slot)
-- KEYS[L+1..L+Q]   quota key bases of the quotas settled
-- KEYS[L+Q+1]      the reservation record check.lua wrote for the request in
--                  this slot (a hash: "@at" -> charged at, ms; key -> reserved)
-- KEYS[L+Q+2]      the domain's ledger of live keys in this slot, when the key
--                  budget keeps one: a key a settlement writes gets its
--                  expiry there, a key it creates (a quota's new period, a
--                  bucket that had expired) too, so that the budget counts
--                  every live key
-- ARGV[1]          the key budget (0: none, and no ledger is kept)
-- ARGV[2]          "" (time from Redis TIME), or a time in ms the script runs at
-- ARGV[3]          L, the number of limit keys
-- ARGV[5i-1..5i+3] per limit key i (i = 1..L): as for check.lua (common.lua's
--                  limit_args), the cost the response's real cost
-- ARGV[5L+2j+2..5L+2j+3]
--                  per quota j (j = 1..Q): period, the real amount
--
-- The record is read and deleted first: a settlement replayed (or of an id
-- never reserved, or expired) finds none and changes nothing. Only a key the
-- record holds is settled, from what it reserved there:
-- - real > reserved: the difference is charged whatever the limit holds
--   (common.lua's force: at most to the ceiling's debt), and a quota counts
--   it in the current period;
-- - real < reserved: the difference is given back as refund.lua gives back
--   (common.lua's give_back, quota_give_back), from when it was charged; a
--   concurrency slot (reserved 1, real 0: its stream ended) is released.
--   The gateway's policy bounds a concurrency limit's real cost at 0, so a
--   slot is never forced.
-- Returns { found (1|0), keys changed }.

-- clock, divmod, fmt, limit_args, force, give_back, quota_give_back,
-- ledger_track and ledger_keep come from common.lua, which script.rs puts in front.

local now = clock(ARGV[2])
local n_limits = tonumber(ARGV[3])
local n_quotas = (#ARGV - 3 - 5 * n_limits) / 2
local record = KEYS[n_limits + n_quotas + 1]
local ledger = KEYS[n_limits + n_quotas + 2]
local fields = redis.call('HGETALL', record)
if #fields == 0 then
  return { 0, 0 }
end
redis.call('DEL', record)
local held = {}
for f = 1, #fields, 2 do
  held[fields[f]] = tonumber(fields[f + 1])
end
local at = held['@at'] or now

local budgeted = (tonumber(ARGV[1]) or 0) > 0
local function track(key, expire_ms)
  if budgeted then ledger_track(ledger, key, expire_ms) end
end

local changed = 0
for i = 1, n_limits do
  local key = KEYS[i]
  local algorithm, n, w, real, ceiling = limit_args(i)
  local reserved = held[key]
  if reserved and real > reserved then
    local expires = force(key, algorithm, n, w, real - reserved, ceiling, now)
    track(key, expires)
    changed = changed + 1
  elseif reserved and real < reserved then
    if give_back(key, algorithm, n, w, reserved - real, at, record) then
      changed = changed + 1
    end
  end
end
for j = 1, n_quotas do
  local a = 5 * n_limits + 2 * j
  local base, period, real = KEYS[n_limits + j], ARGV[a + 2], tonumber(ARGV[a + 3])
  local reserved = held[base]
  if reserved and real > reserved then
    local start, stop = period_bounds(period, divmod(now, 1000))
    if start then
      local key = base .. '|' .. fmt(start)
      redis.call('INCRBY', key, fmt(real - reserved))
      redis.call('PEXPIREAT', key, fmt(expire_at(stop * 1000 - now)))
      track(key, now + ttl(stop * 1000 - now))
      changed = changed + 1
    end
  elseif reserved and real < reserved then
    if quota_give_back(base, period, reserved - real, at, now) then
      changed = changed + 1
    end
  end
end
if budgeted then ledger_keep(ledger, now) end
return { 1, changed }

-- ratelimit-gateway: give back what check.lua charged, for a call whose keys
-- span several cluster slots and whose later slot group was denied.
--
-- KEYS[1..L]       the limit keys check.lua charged (one slot)
-- KEYS[L+1..L+Q]   the quota key bases check.lua charged
-- KEYS[L+Q+1]      (optional) the reservation record check.lua wrote: deleted,
--                  so that no settlement can give the charge back again; also
--                  the member whose concurrency slots are given back (a
--                  "concurrent" limit is given back only with it)
-- ARGV[1]          now_ms that check.lua returned for the charge
-- ARGV[2]          "" (time from Redis TIME), or a time in ms the script runs at
-- ARGV[3]          L, the number of limit keys
-- ARGV[5i-1..5i+3] per limit key i (i = 1..L): as for check.lua (common.lua's
--                  limit_args), the cost the one charged
-- ARGV[5L+2j+2..5L+2j+3]
--                  per quota j (j = 1..Q): period, amount charged
--
-- What giving back means for each algorithm and for quotas: common.lua's
-- give_back and quota_give_back.
-- Returns the number of keys changed.

-- clock, divmod, fmt, limit_args, give_back and quota_give_back come from
-- common.lua, which script.rs puts in front.

local charged_at = tonumber(ARGV[1])
local now = clock(ARGV[2])

local changed = 0
local n_limits = tonumber(ARGV[3])
local n_quotas = (#ARGV - 3 - 5 * n_limits) / 2
local record = nil
if #KEYS > n_limits + n_quotas then record = KEYS[#KEYS] end
for i = 1, n_limits do
  local algorithm, n, w, cost = limit_args(i)
  if give_back(KEYS[i], algorithm, n, w, cost, charged_at, record) then
    changed = changed + 1
  end
end
for j = 1, n_quotas do
  local a = 5 * n_limits + 2 * j
  if quota_give_back(KEYS[n_limits + j], ARGV[a + 2], tonumber(ARGV[a + 3]), charged_at, now) then
    changed = changed + 1
  end
end
if record then
  redis.call('DEL', record)
end
return changed

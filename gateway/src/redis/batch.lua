-- ratelimit-gateway: the checks of one batch (POST /v3/check), each decided
-- by check.lua exactly as if it had come alone, one after the other in
-- order, in one call.
--
-- script.rs puts `local function check_one(KEYS, ARGV)`, common.lua,
-- check.lua and `end` in front of this file: check.lua and common.lua stay
-- the one source of a check, and read their own slice of KEYS and ARGV
-- through the wrapper's parameters. check_one holds every top-level local
-- of both files: about 60 of the 200 Lua 5.1 allows one function
-- (script.rs tests the margin); it has no upvalues.
--
-- ARGV[1]          N, the number of checks (1..MAX_BATCH)
-- ARGV[2c..2c+1]   per check c (c = 1..N): the number of its keys, the
--                  number of its arguments
-- ARGV[2N+2..]     the checks' arguments, one check after the other, each
--                  laid out as check.lua's ARGV (its header)
-- KEYS             the checks' keys, one check after the other, each laid
--                  out as check.lua's KEYS (on a cluster every key of the
--                  call in one slot)
--
-- Returns one entry per check, in order: check.lua's reply (an array of
-- integers), or the error of that check as a string (what check.lua
-- returned with redis.error_reply, e.g. "KEYBUDGET ...", or an error a
-- Redis command raised in it, e.g. "OOM ..."). A check's error ends that
-- check only; the next ones are decided.

local n = tonumber(ARGV[1]) or 0
local key_at, arg_at = 0, 2 * n + 1
local replies = {}
for c = 1, n do
  local n_keys, n_args = tonumber(ARGV[2 * c]), tonumber(ARGV[2 * c + 1])
  local keys, args = {}, {}
  for i = 1, n_keys do keys[i] = KEYS[key_at + i] end
  for i = 1, n_args do args[i] = ARGV[arg_at + i] end
  key_at, arg_at = key_at + n_keys, arg_at + n_args
  local ok, reply = pcall(check_one, keys, args)
  if type(reply) == 'table' and reply.err then
    replies[c] = tostring(reply.err)
  elseif not ok then
    replies[c] = tostring(reply)
  else
    replies[c] = reply
  end
end
return replies

-- wrk script of `make bench`: POST /v1/check to ratelimit-gateway (protocol
-- version 2), one bucket of d.json's rule `global` (10^9 per second in the
-- gateway's policy: never denies) per request, cycling through the client
-- keys c0 .. c<clients-1> as the Envoy bench does, with the key and tag the
-- filter writes for them. With a batch size, POST /v3/check (version 3)
-- instead: that many such checks per request, of consecutive clients.
-- Arguments (after `--`): clients (default 1000); a bearer token, sent as
-- `authorization` (the gateway with --auth-tokens), when given and not
-- empty; the checks per batch, when given.
local reqs = {}
local i = 0

local function check(k)
  return string.format(
    '{"rule":"global","key":"global/c=c%d","tag":"c=c%d","variant":"default","cost":1}', k, k)
end

function init(args)
  local clients = tonumber(args[1] or "1000")
  local headers = { ["content-type"] = "application/json" }
  if args[2] and args[2] ~= "" then
    headers["authorization"] = "Bearer " .. args[2]
  end
  local batch = tonumber(args[3] or "0")
  for k = 0, clients - 1 do
    if batch > 0 then
      local checks = {}
      for j = 0, batch - 1 do
        checks[#checks + 1] = '{"buckets":[' .. check((k + j) % clients) .. ']}'
      end
      local body = '{"version":3,"domain":"bench","checks":[' .. table.concat(checks, ",") .. ']}'
      reqs[#reqs + 1] = wrk.format("POST", "/v3/check", headers, body)
    else
      local body = '{"version":2,"domain":"bench","buckets":[' .. check(k) .. ']}'
      reqs[#reqs + 1] = wrk.format("POST", "/v1/check", headers, body)
    end
  end
end

function request()
  i = i % #reqs + 1
  return reqs[i]
end

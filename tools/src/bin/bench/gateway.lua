-- wrk script of `make bench`: POST /v1/check to ratelimit-gateway (protocol
-- version 2), one bucket of d.json's rule `global` (10^9 per second in the
-- gateway's policy: never denies) per request, cycling through the client
-- keys c0 .. c<clients-1> as the Envoy bench does, with the key and tag the
-- filter writes for them.
-- Arguments (after `--`): clients (default 1000); a bearer token, sent as
-- `authorization` (the gateway with --auth-tokens), when given.
local reqs = {}
local i = 0

function init(args)
  local clients = tonumber(args[1] or "1000")
  local headers = { ["content-type"] = "application/json" }
  if args[2] then
    headers["authorization"] = "Bearer " .. args[2]
  end
  for k = 0, clients - 1 do
    local body = string.format(
      '{"version":2,"domain":"bench","buckets":[{"rule":"global","key":"global/c=c%d",'
        .. '"tag":"c=c%d","variant":"default","cost":1}]}',
      k, k)
    reqs[#reqs + 1] = wrk.format("POST", "/v1/check", headers, body)
  end
end

function request()
  i = i % #reqs + 1
  return reqs[i]
end

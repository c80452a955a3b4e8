-- wrk script of `make bench`: POST /v1/check to ratelimit-gateway, one bucket
-- with one token-bucket limit (10^9 per second: never denies) per request,
-- cycling through the client keys c0 .. c<clients-1> as the Envoy bench does.
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
      '{"version":1,"domain":"bench","cost":1,"buckets":[{"key":"c%d","tag":"c%d",'
        .. '"limits":[{"requests":1000000000,"window_ms":1000,"algorithm":"token_bucket"}]}]}',
      k, k)
    reqs[#reqs + 1] = wrk.format("POST", "/v1/check", headers, body)
  end
end

function request()
  i = i % #reqs + 1
  return reqs[i]
end

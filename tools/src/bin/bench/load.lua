-- wrk script of `make bench` (tools/src/bin/bench.rs): GET / with an
-- `x-client-id` header, cycling through the ids c0 .. c<clients-1>.
-- Arguments (after `--`): mode, clients, path (default "spread", 1000, "/").
-- Mode "matched": as "spread", with `Host: api.example.com` (variant cm).
-- Mode "half": every other request is from client "over" instead, whom every
-- limiter under test lets through once a day: half of the load is rejected.
-- The requests are formatted once in init(), so that the load generator does
-- the same (little) work per request in every variant.
local reqs = {}
local i = 0

function init(args)
  local mode = args[1] or "spread"
  local clients = tonumber(args[2] or "1000")
  local path = args[3] or "/"
  for k = 0, clients - 1 do
    local headers = { ["x-client-id"] = "c" .. k }
    if mode == "matched" then
      headers["Host"] = "api.example.com"
    end
    reqs[#reqs + 1] = wrk.format("GET", path, headers)
    if mode == "half" then
      reqs[#reqs + 1] = wrk.format("GET", path, { ["x-client-id"] = "over" })
    end
  end
end

function request()
  i = i % #reqs + 1
  return reqs[i]
end

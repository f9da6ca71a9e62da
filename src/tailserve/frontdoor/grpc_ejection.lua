-- tailserve's front door: outlier ejection for gRPC calls (see frontdoor/grpc_config.py).
--
-- HAProxy's `observe layer7` counts HTTP 5xx answers; a gRPC call that failed is answered with
-- HTTP status 200 and its grpc-status among the answer's headers. This action, run on each
-- gRPC answer, counts a worker's failures in a row in each backend, and at `limit` marks the
-- worker down: its health checks bring it back once they pass, as after `observe layer7`.

-- UNKNOWN, DEADLINE_EXCEEDED, INTERNAL, UNAVAILABLE: the worker's 500, 504 and 503.
local failures = { ["2"] = true, ["4"] = true, ["13"] = true, ["14"] = true }
-- "backend/server" -> failures in a row
local streaks = {}

core.register_action("grpc_outcome", { "http-res" }, function(txn, limit)
    local backend = txn.sf:be_name()
    local server = txn.sf:srv_name()
    if backend == nil or server == nil then
        return
    end
    local key = backend .. "/" .. server
    local status = txn.sf:res_hdr("grpc-status")
    if status == nil or not failures[status] then
        streaks[key] = nil
        return
    end
    local count = (streaks[key] or 0) + 1
    if count >= tonumber(limit) then
        count = 0
        local proxy = core.backends[backend]
        local target = proxy and proxy.servers[server]
        if target ~= nil then
            target:check_force_down()
            core.Warning("gRPC ejection: " .. key .. " failed " .. limit .. " calls in a row")
        end
    end
    streaks[key] = count
end, 1)

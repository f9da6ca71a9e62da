-- tailserve's front door: a request that finds no worker up waits for one (frontdoor/config.py).
--
-- HAProxy answers 503 at once when a backend has no server up, as while the only worker
-- restarts or before any is ready. This action holds such a request, checking every 10 ms,
-- until each of `backends` (names, comma-separated: those its routing may choose) has a
-- worker up, or its time is out: the deadline it carries (X-Deadline-Ms, or gRPC's
-- grpc-timeout), else `default_ms`. Then the routing rules run as usual.

local units = { H = 3600000, M = 60000, S = 1000, m = 1, u = 0.001, n = 0.000001 }

-- The wait a request allows, in milliseconds (nil: it says none).
local function deadline_ms(txn)
    local ms = tonumber(txn.sf:req_hdr("x-deadline-ms") or "")
    if ms ~= nil then
        return ms
    end
    local timeout = txn.sf:req_hdr("grpc-timeout")
    if timeout ~= nil then
        local value, unit = string.match(timeout, "^(%d+)(%a)$")
        if value ~= nil and units[unit] ~= nil then
            return tonumber(value) * units[unit]
        end
    end
    return nil
end

local function all_up(txn, backends)
    for name in string.gmatch(backends, "[^,]+") do
        if tonumber(txn.f:nbsrv(name)) == 0 then
            return false
        end
    end
    return true
end

core.register_action("await_server", { "http-req" }, function(txn, backends, default_ms)
    local wait = deadline_ms(txn) or tonumber(default_ms)
    local waited = 0
    while waited < wait and not all_up(txn, backends) do
        core.msleep(10)
        waited = waited + 10
    end
end, 2)

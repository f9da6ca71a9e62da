"""The front door: HAProxy before the workers, HTTP and gRPC.

Its config, rendered from one policy (config.py: the whole file and the HTTP side;
grpc_config.py: the gRPC side; policy.py: the policy, the members and the helpers both sides
share, the first server state), the Lua actions HAProxy loads (grpc_ejection.lua: a worker
failing gRPC calls marked down; await_server.lua: a request held while no worker is up), and
the supervision of the HAProxy process (haproxy.py: write, check, start, reload, runtime
commands). `tailserve up` (assembly/stack.py) and the Kubernetes renderer (deploy/kube) use it;
it imports nothing of tailserve's but its errors."""

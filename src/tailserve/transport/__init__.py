"""HTTP on both sides of a socket, with nothing of the inference protocol in it.

Server side: the worker's and the supervisor's HTTP/1.1 server (server.py: a bare asyncio
protocol on httptools' parser), the request it hands an application (request.py) and the
reading of request heads it shares with the rest (inbound.py); the HTTP/2 server of the
worker's gRPC port (http2.py, a bare asyncio protocol, over http2_wire.py: the protocol's
frames, streams and flow control without I/O). Client side: the
connection pool the bench and the routing lane use (http1.py) and the contract the router's
dispatcher asks of it (base.py). Between them, in_memory.py: an application served without a
socket, through the client's contract (the routing lane's tests and its in-process replicas)."""

"""Clients of other servers: the HTTP/1.1 connection pool the bench and the router use
(http1.py), the contract the router's dispatcher asks of it (base.py); and the inbound side's
shared reading of request heads (inbound.py). The pool's in-process twin serves an HTTP
application without a socket, so it lives with the HTTP adapter (protocols/http/memory.py)."""

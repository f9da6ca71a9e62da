"""Clients of other servers: the HTTP/1.1 connection pool the bench and the router use
(http1.py), the contract the router's dispatcher asks of it (base.py) and its in-process twin
(memory.py); and the inbound side's shared reading of request heads (inbound.py)."""

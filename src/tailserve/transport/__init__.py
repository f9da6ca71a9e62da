"""Clients of other servers: the HTTP/1.1 connection pool the bench and the router use."""

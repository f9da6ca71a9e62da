"""The fleet on one machine (`tailserve up`): a supervisor that runs worker processes on
loopback ports behind the router, restarts a worker that dies, and drains it all on SIGTERM.
Its restart decision is a pure policy (`restarts`); processes and signals stay in
`supervisor`."""

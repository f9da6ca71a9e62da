"""`tailserve bench`: an open-loop load generator for the Open Inference Protocol.

A workload file (`workload`) becomes a plan of requests with their intended send times
(`plan`, `schedule`, `inputs`); the runner sends each at its time over HTTP or gRPC
(`runner`, `sending`), whatever came back before; the result is latency percentiles counted
from those times, errors by kind, and the server's own account (`stats`, `report`). `capacity`
searches the highest rate within an SLO."""

"""What the worker tells about itself: Prometheus metrics (`metrics`), traces and their spans
(`tracing`, `worker_spans`, `trace_log`), the event loop's lag and CPU (`loop_lag`,
`loop_metrics`), the machine's idle CPU (`host_cpu`), and the work done per unit: batch
efficiency and computational debt (`efficiency`, `work`)."""

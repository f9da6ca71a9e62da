"""The Open Inference Protocol (KServe v2) and KServe v1 on the wire: adapters that turn HTTP
requests (`http/`) and gRPC calls (`grpc/`) into the data plane's calls and its answers back,
with the one word a refusal is given for (`refusals`)."""

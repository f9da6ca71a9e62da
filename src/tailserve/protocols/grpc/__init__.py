"""The Open Inference Protocol over gRPC: the messages (`schema`), the service's handlers into
the data plane (`service`), a call answered from its bytes (`calls`) over HTTP/1.1 as the front
door forwards unary calls (`over_http1`) and over the worker's HTTP/2 port (`over_http2`), and
grpcio's server for the routing lane (`common`, `startup`)."""

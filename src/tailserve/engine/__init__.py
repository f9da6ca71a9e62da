"""The data plane: a request's way from the protocol adapters to a model and back.

`dataplane` is its one entry for every protocol (health, metadata, inference, the
repository). Below it, each model version's `scheduler` with its `deadline_batcher` and
`admission`, the request's options and checks (`options`, `validation`), the variants and cost
classes a batch may run at, the refusals kept for the next moment, and pipelines of several
models (`pipeline`). The policies among them are pure: no event loop, socket or thread."""

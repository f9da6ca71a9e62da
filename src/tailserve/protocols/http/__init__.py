"""The inference protocols over HTTP: the worker's application on the HTTP server (`app`), its
route table and OpenAPI document, request options read from headers (`headers`), the OIP v2
codec (`oip`, and each model's typed JSON decoder `oip_typed`), KServe v1 records, the jobs
routes, replies kept for repeats (`replay`), and errors as statuses."""

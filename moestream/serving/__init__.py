"""Serving: sampling parameters, the offline `LLM` API, the engine thread that batches requests,
the OpenAI-compatible HTTP server and the load generator. It drives the runtime's `Engine` and
knows no policy, family or store internals."""

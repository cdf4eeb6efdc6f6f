"""Serving: sampling parameters, the offline `LLM` API, the engine thread that batches requests and the
OpenAI-compatible HTTP server. It drives the runtime's `Engine` and knows no policy, family or store internals."""

"""The scheduling room: which sequences run together, and when. `scheduler.py` admits sequences (max
sequences, KV budget) and runs schedule -> (the engine's forward) -> postprocess; its batching rules are
static batches (there) and continuous batches (`continuous.py`, with `open_scheduler`, the scheduler
of a BatchingConfig that the server and `LLM` drive); `token_scheduler.py` groups running sequences
into decode batches. It knows no request and no HTTP; `token_scheduler` imports without torch."""

"""Offline bounds that see the replayed trace's future (belady, oracle, lookahead-N, default-lookahead-4),
run only in the simulator (`Policy.offline`), which hands them the trace through prepare()."""

"""What the benches, `moestream sim` and `moestream loadgen` measure with: cold disk bandwidth, a load
generator and the workloads it replays, PNG plots, the simulator's expert-parallel scaling report, and
`bench policies`' comparison of policies (compare.py), its replay that times each decision (overhead.py)
and its reuse-distance profile of a trace (reuse.py).
The product never imports it."""

"""What the benches, `moestream sim` and `moestream loadgen` measure with: cold disk bandwidth, a load
generator and the workloads it replays, PNG plots, the simulator's expert-parallel scaling report, and
`bench policies`' comparison of policies (compare.py) with its replay that times each decision (overhead.py).
The product never imports it."""

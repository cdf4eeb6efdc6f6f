"""What the benches, `moestream sim` and `moestream loadgen` measure with: cold disk bandwidth, a load
generator and the workloads it replays, PNG plots and the simulator's expert-parallel scaling report.
The product never imports it."""

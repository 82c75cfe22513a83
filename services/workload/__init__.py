"""Workloads and their measures, shared by the simulator, the predictor and the benchmarks:
traces (`traces/`), serving metrics, capacity search, JSON reports and plots.
See docs/workloads.md."""

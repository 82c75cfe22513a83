"""Workloads and their measures, shared by the simulator and the benchmarks:
traces (`traces/`), serving metrics, capacity search, JSON reports and plots.
See docs/workloads.md."""

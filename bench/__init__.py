"""Benchmarks, traces and metrics shared by the simulator and the live load generator."""

"""Workload traces shared by the simulator and the live benchmark."""

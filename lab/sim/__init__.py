"""Discrete-event simulator: drives the same scheduling core as the live scheduler, with the
cost model as its clock. See docs/simulator.md."""

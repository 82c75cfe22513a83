"""Discrete-event simulator: drives the same scheduling core as the live scheduler, with the
cost model as its clock (DESIGN.md section 7 item 4). See docs/simulator.md."""

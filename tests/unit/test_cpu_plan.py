"""`alise serve`'s CPU plan (services/launcher/cpu_plan.py): executors split the cores and spin
briefly at barriers, the control plane runs at a lower priority, and the services apply
their nice."""

from __future__ import annotations

import os
import subprocess
import sys

from services.launcher import cpu_plan
from services.launcher.topology import local_topology


def test_executors_split_the_cores_unless_told():
    assert cpu_plan.plan(1, 0, 10, cores=2).executor_threads == 2
    assert cpu_plan.plan(2, 0, 10, cores=2).executor_threads == 1
    assert cpu_plan.plan(3, 0, 10, cores=16).executor_threads == 5
    assert cpu_plan.plan(4, 0, 10, cores=2).executor_threads == 1
    told = cpu_plan.plan(1, 3, 10, cores=2)
    assert told.executor_threads == 3 and "ALISE_NUM_THREADS" in told.describe({})


def test_every_service_gets_its_side_of_the_plan():
    specs = local_topology(2, "redis://127.0.0.1:1")
    cpu = cpu_plan.plan(2, 0, 7, cores=8)
    planned = {s.name: s.env for s in cpu_plan.apply(specs, cpu, {})}
    for name, env in planned.items():
        if name.startswith("executor"):
            assert env["ALISE_NUM_THREADS"] == "4" and env["GOMP_SPINCOUNT"] == "20000"
            assert "ALISE_NICE" not in env
        else:
            assert env["ALISE_NICE"] == "7" and "ALISE_NUM_THREADS" not in env
    # a wait policy the user chose stays theirs; nice 0 leaves the control plane alone
    again = cpu_plan.apply(specs, cpu_plan.plan(2, 0, 0, cores=8), {"OMP_WAIT_POLICY": "ACTIVE"})
    assert all("GOMP_SPINCOUNT" not in s.env and "ALISE_NICE" not in s.env for s in again)
    text = cpu.describe({})
    assert "4 thread(s)" in text and "nice 7" in text and "spinning 20000 rounds" in text
    assert "OMP_WAIT_POLICY=ACTIVE" in cpu.describe({"OMP_WAIT_POLICY": "ACTIVE"})


def test_a_service_lowers_its_own_priority_at_start():
    probe = "import os, services.main as c; c._apply_nice(); print(os.nice(0))"
    env = dict(os.environ, ALISE_NICE="5")
    before = os.nice(0)
    out = subprocess.run(
        [sys.executable, "-c", probe], env=env, capture_output=True, text=True, check=True
    )
    assert int(out.stdout) == min(19, before + 5)

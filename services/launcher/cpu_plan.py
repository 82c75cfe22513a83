"""How `alise serve` shares one machine's cores between the executors and the control plane.

A CPU executor's step time falls with its threads, while the gateway, scheduler, predictor
and Redis each need a small, bursty share (measured by `alise bench stack`: docs/executor.md
gives the figures). Holding a core back for them (one thread on two cores) leaves half the
machine idle at saturation; giving the executor every core with OpenMP's default waiting
makes its idle threads spin for ~300k iterations at each barrier against the control plane's
bursts, and passive waiting (OMP_WAIT_POLICY=PASSIVE) makes every one of a step's ~400 small
ops wake a sleeping thread (measured: a one-row decode step 2x slower). The plan:
- the executors split every core (threads = cores / executors, at least 1) unless
  ALISE_NUM_THREADS says otherwise;
- their OpenMP threads spin briefly, then sleep (GOMP_SPINCOUNT=SPIN_COUNT: tens of
  microseconds, longer than the gap between two ops of a step, far shorter than the gap
  between two steps), unless the environment already sets OMP_WAIT_POLICY or GOMP_SPINCOUNT;
- the control plane runs at a lower priority (nice ALISE_CONTROL_NICE, 10 by default: a
  burst still runs at once on an idle core, and otherwise takes a short slice from the
  executor's threads instead of a full one).
The services apply it themselves at start (services/main.py: ALISE_NICE), so Redis started by
its runner inherits it.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass, replace

from services.launcher.topology import ServiceSpec

SPIN_COUNT = "20000"  # measured equal to the default spinning on a quiet machine


@dataclass(frozen=True)
class CpuPlan:
    cores: int
    num_executors: int
    executor_threads: int
    threads_given: bool  # ALISE_NUM_THREADS set: the executors' threads are the user's
    control_nice: int

    def executor_env(self, environ: dict[str, str]) -> dict[str, str]:
        env = {"ALISE_NUM_THREADS": str(self.executor_threads)}
        if "OMP_WAIT_POLICY" not in environ and "GOMP_SPINCOUNT" not in environ:
            env["GOMP_SPINCOUNT"] = SPIN_COUNT
        return env

    def control_env(self) -> dict[str, str]:
        return {"ALISE_NICE": str(self.control_nice)} if self.control_nice else {}

    def describe(self, environ: dict[str, str]) -> str:
        why = (
            "ALISE_NUM_THREADS"
            if self.threads_given
            else f"{self.cores} core(s) / {self.num_executors} executor(s)"
        )
        given = [f"{k}={environ[k]}" for k in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT") if k in environ]
        wait = ", ".join(given) if given else f"spinning {SPIN_COUNT} rounds, then sleeping"
        control = (
            f"gateway, scheduler, predictor and Redis at nice {self.control_nice} "
            "(ALISE_CONTROL_NICE)"
            if self.control_nice
            else "control plane at normal priority (ALISE_CONTROL_NICE=0)"
        )
        return (
            f"cpu: each executor {self.executor_threads} thread(s) ({why}), OpenMP threads "
            f"{wait}; {control}"
        )


def plan(num_executors: int, num_threads: int, control_nice: int, cores: int = 0) -> CpuPlan:
    """The plan for `num_executors` CPU executors (num_threads 0: split the cores)."""
    cores = cores or len(os.sched_getaffinity(0))
    threads = num_threads or max(1, cores // max(1, num_executors))
    return CpuPlan(cores, num_executors, threads, num_threads > 0, control_nice)


def apply(specs: Iterable[ServiceSpec], cpu: CpuPlan, environ: dict[str, str]) -> list[ServiceSpec]:
    """The specs with the plan's variables: executors' threads and waiting, others' nice."""
    out = []
    for spec in specs:
        extra = cpu.executor_env(environ) if spec.command[0] == "executor" else cpu.control_env()
        out.append(replace(spec, env={**spec.env, **extra}))
    return out

"""Optional per-Step trace (`ALISE_STEP_TRACE=FILE`): one JSON line per executed Step with
the batch's shape, the cost model's estimate and what the executor and the round trip took,
and the remaining-length forecasts the executor's probe made in it (`forecasts`: one
`[request id, generated, q10, q50, q90, p_cap]` per request at a checkpoint; absent when
none), which `forecasts_from_step_trace` turns into the simulator's replay file.

It is how a live run is compared with the simulator step by step (the cost model is fitted on
an idle machine; this shows what each shape costs under real load). The file is line-buffered
(one write per Step, a few microseconds), so it can be followed while the server runs.
"""

from __future__ import annotations

import json
from pathlib import Path


class StepTrace:
    def __init__(self, path: Path | str) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "a", buffering=1)

    def write(
        self,
        executor: str,
        sent_at: float,
        out,
        shape,
        result,
        estimate_s: float,
        round_trip_s: float,
    ) -> None:
        """`sent_at`: wall-clock time the Step went out; `round_trip_s`: send to result."""
        t = result.timings
        row = {
            "t": round(sent_at, 6),
            "executor": executor,
            "step_id": out.step_id,
            "prefill": shape.num_prefill_tokens,
            "decode": shape.num_decode_tokens,
            "context": shape.num_context_tokens,
            "seqs": len(out.num_scheduled_tokens),
            "budget": shape.token_budget,
            "swap_out": len(out.swap_out),
            "swap_in": len(out.swap_in),
            "preempted": len(shape.preempted_request_ids),
            "estimate_s": round(estimate_s, 6),
            "exec_s": round(t.total_s, 6),
            "forward_s": round(t.forward_s, 6),
            "round_trip_s": round(round_trip_s, 6),
        }
        if result.forecasts:
            row["forecasts"] = [
                [f.request_id, f.generated, f.q10, f.q50, f.q90, f.p_cap] for f in result.forecasts
            ]
        self._file.write(json.dumps(row) + "\n")

    def close(self) -> None:
        self._file.close()

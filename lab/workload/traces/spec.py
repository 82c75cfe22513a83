"""Build a trace from short text specs (what the CLIs take).

Workload specs (`name` or `name:key=value,key=value`):
- `sharegpt` (`split=test|train`)
- `mixed` (`split`, `long_share=0.35`, `long_min=4096`, `long_max=32768`, `max_output=2048`)
- `csv:PATH` (Azure or BurstGPT columns; arrivals default to the file's own timestamps)
- `multiturn` (`turns=8`, `think=5`): ShareGPT conversations turn by turn, n = conversations
  (traces/multiturn.py)
- `sysprompt` (`system=1024`, `systems=1`, `split`): ShareGPT prompts behind shared system
  prompts
- `jsonl:PATH` (a trace saved by `save_jsonl`; its arrival times and SLOs are kept unless an
  arrival process / SLO scheme is given)
SLO specs: `none`, `uniform:tbt=0.2[,ttft=1.0]`,
`heterogeneous[:scales=0.25/0.5/1/2,ttft_lo=0.5,ttft_hi=1.5]`; any of them `,jct_share=0.1`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from lab.workload.traces.arrivals import make_arrivals, scale_timestamps
from lab.workload.traces.csv_replay import load_csv
from lab.workload.traces.slo import assign_slos
from lab.workload.traces.trace import TraceItem, build_trace, load_jsonl
from lab.workload.traces.workloads import mixed_long_prompt_shapes, sample_shapes, sharegpt_pool


def parse_spec(spec: str) -> tuple[str, dict[str, str]]:
    """`name:k=v,k=v` -> (name, {k: v}); `name:PATH` -> (name, {"path": PATH})."""
    name, _, rest = spec.partition(":")
    if not name:
        raise ValueError(f"empty spec {spec!r}")
    if not rest:
        return name, {}
    if name in ("csv", "jsonl", "file", "replay") and "=" not in rest.split(",")[0]:
        return name, {"path": rest}
    opts = {}
    for part in rest.split(","):
        key, eq, value = part.partition("=")
        if not eq or not key:
            raise ValueError(f"bad option {part!r} in spec {spec!r}: expected key=value")
        opts[key.strip()] = value.strip()
    return name, opts


def _pop(opts: dict, key: str, cast, default):
    value = opts.pop(key, None)
    try:
        return default if value is None else cast(value)
    except ValueError as exc:
        raise ValueError(f"option {key}={value!r}: {exc}") from exc


def _reject_unknown(kind: str, opts: dict) -> None:
    if opts:
        raise ValueError(f"unknown option(s) for {kind}: {', '.join(sorted(opts))}")


def _shapes(name: str, opts: dict, n: int | None, seed: int, model: str):
    """(shapes, native timestamps or None, saved items or None)."""
    if name == "sharegpt":
        pool = sharegpt_pool(_pop(opts, "split", str, "test"), model)
        _reject_unknown(name, opts)
        return sample_shapes(pool, n, seed), None, None
    if name == "mixed":
        pool = sharegpt_pool(_pop(opts, "split", str, "test"), model)
        kw = dict(
            long_share=_pop(opts, "long_share", float, 0.35),
            long_min=_pop(opts, "long_min", int, 4096),
            long_max=_pop(opts, "long_max", int, 32768),
            max_output=_pop(opts, "max_output", int, 2048),
        )
        _reject_unknown(name, opts)
        return mixed_long_prompt_shapes(pool, n or len(pool), seed=seed, **kw), None, None
    if name == "csv":
        csv_trace = load_csv(opts.pop("path"), limit=n)
        _reject_unknown(name, opts)
        return csv_trace.shapes, csv_trace.timestamps, None
    if name == "jsonl":
        items = load_jsonl(opts.pop("path"))[:n]
        _reject_unknown(name, opts)
        return None, [i.arrival_s for i in items], items
    raise ValueError(
        f"unknown workload {name!r}: sharegpt, mixed, multiturn, sysprompt, csv:PATH, jsonl:PATH"
    )


def _repeating(name: str, opts: dict, n: int | None, rate: float, seed: int, model: str):
    """Multi-turn conversations (n = conversations) or a shared system prompt (n = requests)."""
    from lab.workload.traces.multiturn import (
        multiturn_trace,
        shared_prompt_trace,
        sharegpt_conversations,
    )

    if name == "multiturn":
        max_turns = _pop(opts, "turns", int, 8)
        think = _pop(opts, "think", float, 5.0)
        _reject_unknown(name, opts)
        convs = sharegpt_conversations(n or 100, model, max_turns=max_turns)
        return multiturn_trace(convs, rate, think, seed)
    pool = sharegpt_pool(_pop(opts, "split", str, "test"), model)
    system, systems = _pop(opts, "system", int, 1024), _pop(opts, "systems", int, 1)
    _reject_unknown(name, opts)
    shapes = sample_shapes(pool, n, seed)
    times = make_arrivals(len(shapes), "poisson", rate, 1.0, seed, None)
    return shared_prompt_trace(shapes, times, system, systems, seed)


def _slos(items, slo: str, seed: int, prefill_time):
    name, opts = parse_spec(slo)
    kw = dict(jct_share=_pop(opts, "jct_share", float, 0.0))
    if name == "uniform":
        kw.update(tbt_s=_pop(opts, "tbt", float, 0.1875), ttft_s=_pop(opts, "ttft", float, None))
    elif name == "heterogeneous":
        kw.update(
            tbt_scales=_pop(
                opts, "scales", lambda v: [float(x) for x in v.split("/")], (0.25, 0.5, 1.0, 2.0)
            ),
            ttft_scale=(_pop(opts, "ttft_lo", float, 0.5), _pop(opts, "ttft_hi", float, 1.5)),
        )
    _reject_unknown(f"SLO scheme {name}", opts)
    return assign_slos(items, name, seed=seed, prefill_time=prefill_time, **kw)


def make_trace(
    workload: str,
    n: int | None,
    rate: float | None,
    arrival: str | None = None,
    burstiness: float = 1.0,
    slo: str | None = None,
    seed: int = 0,
    prefill_time: Callable[[int], float] | None = None,
    model: str = "smollm2-135m-instruct",
) -> list[TraceItem]:
    """The full trace: shapes + arrivals (`poisson`/`gamma`/`uniform`/`trace`; default
    `trace` for csv/jsonl workloads, else `poisson`) + SLOs (default `none`)."""
    name, opts = parse_spec(workload)
    if name in ("multiturn", "sysprompt"):
        if rate is None:
            raise ValueError(f"the {name} workload needs a rate")
        items = _repeating(name, opts, n, rate, seed, model)
        return _slos(items, slo or "none", seed, prefill_time)
    shapes, timestamps, saved = _shapes(name, opts, n, seed, model)
    process = arrival or ("trace" if timestamps is not None else "poisson")
    if saved is not None:
        if process != "trace":
            raise ValueError("a jsonl trace keeps its own arrival times (arrival=trace)")
        times = scale_timestamps(timestamps, rate)
        items = [replace(i, arrival_s=t) for i, t in zip(saved, times)]
        return items if slo is None else _slos(items, slo, seed, prefill_time)
    if rate is None and process != "trace":
        raise ValueError(f"arrival process {process!r} needs a rate")
    times = make_arrivals(len(shapes), process, rate, burstiness, seed, timestamps)
    items = build_trace(shapes, times)
    return _slos(items, slo or "none", seed, prefill_time)

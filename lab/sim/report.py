"""Markdown tables from a sweep's results.json: capacities with ratios to a baseline, and one
metric per rate across policies (`alise sim report`)."""

from __future__ import annotations

from collections import defaultdict


def _fmt(value) -> str:
    if value is None:
        return "–"
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 1000 else f"{value:.0f}"
    return str(value)


def capacity_table(results: dict, baseline: str = "fcfs") -> str:
    cap, detail = results["capacity"], results.get("capacity_detail", {})
    crits = sorted({c for v in cap.values() for c in v})
    head = "| policy | " + " | ".join(f"capacity {c} (req/s) | × {baseline}" for c in crits)
    lines = [head + " |", "|---" * (1 + 2 * len(crits)) + "|"]
    for policy in sorted(cap):
        cells = []
        for c in crits:
            rate = cap[policy].get(c)
            base = cap.get(baseline, {}).get(c)
            bounded = detail.get(policy, {}).get(c, {}).get("bounded", True)
            mark = "" if bounded else (" (≥)" if rate else " (<min)")
            cells += [_fmt(rate) + mark, _fmt(rate / base) if rate and base else "–"]
        lines.append(f"| {policy} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def metric_table(
    results: dict, metric: str, rates: list[float] | None = None, policies: list[str] | None = None
) -> str:
    grid: dict[float, dict[str, object]] = defaultdict(dict)
    for p in results["points"]:
        grid[p["rate"]][p["policy"]] = p.get(metric)
    policies = policies or sorted({p["policy"] for p in results["points"]})
    rates = rates or sorted(r for r in grid if all(q in grid[r] for q in policies))
    lines = [
        f"| {metric} \\ rate | " + " | ".join(policies) + " |",
        "|---" * (1 + len(policies)) + "|",
    ]
    for r in rates:
        lines.append(f"| {_fmt(r)} | " + " | ".join(_fmt(grid[r].get(q)) for q in policies) + " |")
    return "\n".join(lines)


def report(results: dict, metrics: list[str], baseline: str = "fcfs") -> str:
    parts = [capacity_table(results, baseline)] if results.get("capacity") else []
    parts += [metric_table(results, m) for m in metrics]
    return "\n\n".join(parts)

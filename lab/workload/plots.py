"""PNG plots from a sweep's results.json (matplotlib, headless).

- normalized_latency.png: mean normalized latency vs rate per policy (ALISE Fig. 6);
- tbt_ttft.png: P99 TBT and median TTFT vs rate (Sarathi-Serve);
- slo_goodput.png: iteration SLO attainment, request SLO attainment and goodput vs rate
  (AccelGen);
- latency_cdf.png: CDFs of normalized latency and TTFT at one rate.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _series(points: list[dict], metric: str) -> dict[str, tuple[list, list]]:
    by_policy: dict[str, list] = defaultdict(list)
    for p in points:
        if p.get(metric) is not None:
            by_policy[p["policy"]].append((p["rate"], p[metric]))
    return {k: tuple(zip(*sorted(v))) for k, v in sorted(by_policy.items())}


def _panel(ax, points, metric, ylabel, log=False, hline=None):
    for policy, (rates, values) in _series(points, metric).items():
        ax.plot(rates, values, marker="o", markersize=3, label=policy)
    if hline is not None:
        ax.axhline(hline, color="grey", linestyle="--", linewidth=1)
    if log:
        ax.set_yscale("log")
    ax.set_xlabel("request rate (req/s)")
    ax.set_ylabel(ylabel)
    ax.grid(True, alpha=0.3)


def _figure(panels, path: Path, title: str) -> Path:
    plt = _plt()
    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4), squeeze=False)
    for ax, draw in zip(axes[0], panels):
        draw(ax)
    if axes[0][0].get_legend_handles_labels()[0]:
        axes[0][0].legend(fontsize=7)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_results(results: dict, out_dir: str | Path) -> list[Path]:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    pts = results["points"]
    crit = results.get("criteria", {})
    nl_bound = crit.get("normalized_latency", {}).get("bound")
    tbt_slo = crit.get("p99_tbt", {}).get("bound")
    paths = [
        _figure(
            [
                lambda ax: _panel(
                    ax,
                    pts,
                    "mean_normalized_latency",
                    "mean normalized latency (s/token)",
                    True,
                    nl_bound,
                )
            ],
            out / "normalized_latency.png",
            "Normalized latency vs rate",
        ),
        _figure(
            [
                lambda ax: _panel(ax, pts, "p99_tbt", "P99 TBT (s)", True, tbt_slo),
                lambda ax: _panel(ax, pts, "median_ttft", "median TTFT (s)", True),
            ],
            out / "tbt_ttft.png",
            "Tail TBT and median TTFT vs rate",
        ),
        _figure(
            [
                lambda ax: _panel(ax, pts, "iteration_slo_attainment", "iteration SLO attainment"),
                lambda ax: _panel(ax, pts, "slo_attainment", "request SLO attainment"),
                lambda ax: _panel(ax, pts, "goodput", "goodput (req/s)"),
            ],
            out / "slo_goodput.png",
            "SLO attainment and goodput vs rate",
        ),
    ]
    if results.get("cdf"):
        paths.append(_cdf(results["cdf"], out / "latency_cdf.png"))
    return paths


def _cdf(cdf: dict, path: Path) -> Path:
    def draw(metric, xlabel):
        def panel(ax):
            for policy, data in sorted(cdf.items()):
                values = data.get(metric) or []
                n = len(values)
                ax.plot(values, [(i + 1) / n for i in range(n)], label=policy)
            ax.set_xscale("log")
            ax.set_xlabel(xlabel)
            ax.set_ylabel("CDF")
            ax.grid(True, alpha=0.3)

        return panel

    rate = next(iter(cdf.values()))["rate"]
    return _figure(
        [draw("normalized_latency", "normalized latency (s/token)"), draw("ttft", "TTFT (s)")],
        path,
        f"Latency CDFs at {rate} req/s",
    )

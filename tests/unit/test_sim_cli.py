"""`alise sim run|sweep` end to end on a small saved trace; capacity bisection on its own."""

import json

import pytest

from cli.main import main
from lab.workload.capacity import Criterion, Search, bisect_many, sarathi_tbt_slo
from lab.workload.traces.arrivals import poisson_arrivals
from lab.workload.traces.trace import TraceItem, save_jsonl


@pytest.fixture
def trace_file(tmp_path):
    times = poisson_arrivals(150, 1.0, seed=4)
    items = [
        TraceItem(f"r{i}", t, 30 + (i * 97) % 700, 10 + (i * 61) % 300) for i, t in enumerate(times)
    ]
    path = tmp_path / "trace.jsonl"
    save_jsonl(items, path)
    return path


def test_sim_run_prints_metrics(trace_file, tmp_path, capsys):
    out = tmp_path / "run.json"
    recs = tmp_path / "records.jsonl"
    assert (
        main(
            [
                "sim",
                "run",
                "--policy",
                "fcfs:preemption_mode=swap",
                "--rate",
                "10",
                "--trace",
                f"jsonl:{trace_file}",
                "--json",
                str(out),
                "--records",
                str(recs),
            ]
        )
        == 0
    )
    summary = json.loads(out.read_text())
    assert summary["completed"] == 150 and summary["policy"] == "fcfs:preemption_mode=swap"
    assert json.loads(capsys.readouterr().out)["mean_e2e"] == summary["mean_e2e"]
    assert len(recs.read_text().splitlines()) == 150


def test_sim_sweep_writes_results_and_plots(trace_file, tmp_path):
    out = tmp_path / "sweep"
    assert (
        main(
            [
                "sim",
                "sweep",
                "--policies",
                "fcfs",
                "fcfs:max_num_seqs=8",
                "--rates",
                "5,200",
                "--trace",
                f"jsonl:{trace_file}",
                "--out",
                str(out),
                "--rounds",
                "2",
                "--jobs",
                "2",
                "--nl-bound",
                "0.05",
            ]
        )
        == 0
    )
    results = json.loads((out / "results.json").read_text())
    keys = {
        "policy",
        "rate",
        "mean_normalized_latency",
        "p99_tbt",
        "median_ttft",
        "slo_attainment",
        "goodput",
        "throughput_tok_s",
    }
    assert len(results["points"]) >= 4 and all(keys <= set(p) for p in results["points"])
    cap = results["capacity"]
    assert set(cap) == {"fcfs", "fcfs:max_num_seqs=8"}
    assert set(cap["fcfs"]) == {"normalized_latency", "p99_tbt"}
    # the bisection probed between the grid rates, and a batch cap of 8 cannot do better
    assert any(5 < p["rate"] < 200 for p in results["points"])
    assert cap["fcfs:max_num_seqs=8"]["normalized_latency"] <= cap["fcfs"]["normalized_latency"]
    for name in ("normalized_latency.png", "tbt_ttft.png", "slo_goodput.png"):
        assert (out / name).stat().st_size > 1000


def test_bad_arguments_fail_clearly(trace_file, tmp_path):
    with pytest.raises(ValueError, match="unknown policy"):
        main(["sim", "run", "--policy", "nosuch", "--rate", "1", "--trace", f"jsonl:{trace_file}"])
    with pytest.raises(SystemExit):
        main(["sim", "sweep", "--policies", "fcfs", "--rates", "0,-1", "--out", str(tmp_path)])


def test_bisection_finds_the_threshold():
    crit = Criterion("normalized_latency", 1.0)
    search = Search("p", crit)
    for rate in (1.0, 16.0):
        search.observe(rate, {"mean_normalized_latency": rate / 10.0})  # passes below 10

    def evaluate_all(keys):
        return {(k, r): {"mean_normalized_latency": r / 10.0} for k, r in keys}

    bisect_many([search], evaluate_all, rel_tol=0.01, max_rounds=20)
    assert search.lo <= 10.0 < search.hi and search.hi - search.lo <= 0.01 * search.hi
    assert search.result()["bounded"]
    strict = Criterion("p99_tbt", 0.1)
    assert strict.passes({"p99_tbt": 0.05, "median_scheduling_delay": 1.0})
    assert not strict.passes({"p99_tbt": 0.05, "median_scheduling_delay": 3.0})
    assert sarathi_tbt_slo(lambda p, d, c: 0.001 * d + 1e-6 * c) == pytest.approx(
        5 * (0.032 + 0.131072)
    )


def test_report_tables():
    from lab.sim.report import capacity_table, metric_table

    results = {
        "capacity": {"fcfs": {"normalized_latency": 10.0}, "alise": {"normalized_latency": 15.0}},
        "capacity_detail": {"alise": {"normalized_latency": {"bounded": False}}},
        "points": [
            {"policy": "fcfs", "rate": 4.0, "p99_tbt": 0.2},
            {"policy": "alise", "rate": 4.0, "p99_tbt": 0.1},
        ],
    }
    cap = capacity_table(results)
    assert "| alise | 15 (≥) | 1.5 |" in cap and "| fcfs | 10 | 1 |" in cap
    assert "| 4 | 0.1 | 0.2 |" in metric_table(results, "p99_tbt")


def test_runaway_points_are_recorded_as_failures(trace_file, tmp_path):
    out = tmp_path / "sweep"
    assert (
        main(
            [
                "sim",
                "sweep",
                "--policies",
                "fcfs",
                "--rates",
                "5",
                "--jobs",
                "1",
                "--trace",
                f"jsonl:{trace_file}",
                "--out",
                str(out),
                "--no-plots",
                "--max-iterations",
                "20",
            ]
        )
        == 0
    )
    results = json.loads((out / "results.json").read_text())
    (point,) = results["points"]
    assert "more than 20 iterations" in point["error"] and point["completed"] == 0
    assert results["capacity"]["fcfs"] == {"normalized_latency": 0.0, "p99_tbt": 0.0}

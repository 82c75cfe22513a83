"""CUDA graphs on and off give identical greedy tokens for 64 requests on SmolLM2 (fp32, so
that the comparison is about the graphs and padding, not about bf16 rounding of different
matmul shapes), and the graphs were really replayed."""

from __future__ import annotations

import random

from lab.executor.driver import Driver
from services.executor.cuda_runtime import RuntimeOptions
from services.executor.engine import Engine
from tests.gpu import GPU_ONLY

pytestmark = GPU_ONLY


def _generate(model_dir, graphs: bool, prompts, lens):
    engine = Engine(
        model_dir,
        device="cuda",
        dtype="fp32",
        num_device_blocks=2048,
        num_host_blocks=1,
        runtime=RuntimeOptions(cuda_graphs=graphs, graph_max_batch=64),
    )
    report = engine.warm_up()
    seqs = Driver(engine, token_budget=512, max_batch=64).generate(prompts, lens)
    replayed = dict(engine.runtime.graphs.replayed)
    engine.close()
    return [s.output for s in seqs], report, replayed


def test_graphs_on_and_off_give_identical_greedy_tokens(smollm2_dir):
    rng = random.Random(0)
    prompts = [[rng.randrange(100, 40000) for _ in range(rng.randint(8, 300))] for _ in range(64)]
    lens = [rng.randint(16, 64) for _ in range(64)]  # finishing at different steps
    on, report_on, replayed_on = _generate(smollm2_dir, True, prompts, lens)
    off, report_off, replayed_off = _generate(smollm2_dir, False, prompts, lens)
    assert report_on["cuda_graphs"] == [1, 2, 4, 8, 16, 32, 64], report_on
    assert report_on["cuda_graph_failure"] == ""
    assert report_off["cuda_graphs"] == [] and replayed_off == {}
    assert replayed_on.get(64, 0) > 0 and len(replayed_on) >= 4, replayed_on
    assert [len(o) for o in on] == lens
    assert on == off

"""INT8 KV on CUDA (Triton kernels, bf16 model): perplexity of the fixed 512-token passage
within 1% of bf16 KV, greedy agreement, and a third of the bytes."""

from __future__ import annotations

from lab.executor.quality import measure
from services.common.models import load_tokenizer
from services.common.settings import ExecutorSettings
from services.executor.engine import Engine
from tests.gpu import GPU_ONLY

pytestmark = GPU_ONLY


def test_int8_kv_perplexity_within_one_percent_of_bf16(smollm2_dir):
    settings = ExecutorSettings()
    kw = dict(device="cuda", dtype="bf16", num_device_blocks=400, num_host_blocks=1)
    fp, q = Engine(smollm2_dir, **kw), Engine(smollm2_dir, kv_dtype="int8", **kw)
    for engine in (fp, q):
        engine.warm_up()
    result = measure(fp, q, load_tokenizer(settings.model, settings.data_dir), 8, 64)
    assert abs(result["ppl_rel_diff"]) <= 0.01, result
    assert result["greedy_agreement"] >= 0.9, result
    assert result["kv_bytes_ratio"] <= 0.6, result  # vs bf16 (0.3 vs fp32), scales included

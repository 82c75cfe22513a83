"""`alise predictor state-ceiling`: how well *any* predictor that reads a running request's
state after G generated tokens could order its remaining length.

The probe (services/executor/probe.py) sees the served model's state after G output tokens;
the most that state can say about the remaining length is its distribution given that exact
state. This command measures it directly: for held-out (test-split) prompts it samples one
answer's first G tokens, then answers the same prompt-plus-prefix K more times from there
(same model, temperature, cap and EOS as serving: the prefix is fed as prompt tokens, which
leaves the model's state unchanged), and scores each continuation's remaining tokens by the
mean of the other continuations' (a predictor that knows the state's own distribution, up to
the noise of K - 1 draws): Kendall τ-b (continuations cut by the cap tie at cap - G, as in
`alise predictor eval --progressive`) and the AUC of the others' capped share against the
continuation's running to the cap. Reported for 1..K-1 other continuations, so the trend
towards the noise-free value shows. This is the bound a probe's figures at checkpoint G are
to be read against: the state's own draws, not two answers of the prompt.
"""

from __future__ import annotations

import argparse
import logging
import time
from pathlib import Path

log = logging.getLogger(__name__)


def _prefixes(driver, prompts, generated, temperature, seed, eos) -> list[list[int] | None]:
    """One answer's first `generated` tokens per prompt (None where it ended before)."""
    from services.common.sampling import SamplingParams

    params = [
        SamplingParams(temperature=temperature, seed=seed * 7919 + i) for i in range(len(prompts))
    ]
    seqs = driver.generate(prompts, generated, params, eos)
    stop = set(eos)
    return [
        list(q.output) if len(q.output) == generated and not (stop & set(q.output)) else None
        for q in seqs
    ]


def _continue(driver, starts, left, k, temperature, seed, eos) -> list[list[tuple[int, bool]]]:
    """K continuations of each start (prompt + prefix): (remaining tokens, cut by the cap)."""
    from services.common.sampling import SamplingParams

    flat = [s for s in starts for _ in range(k)]
    params = [
        SamplingParams(temperature=temperature, seed=seed * 104_729 + 1000 * i + j)
        for i in range(len(starts))
        for j in range(k)
    ]
    seqs = driver.generate(flat, left, params, eos)
    stop = set(eos)
    out = [(len(q.output), len(q.output) >= left and q.output[-1] not in stop) for q in seqs]
    return [out[i * k : (i + 1) * k] for i in range(len(starts))]


def scores(runs: list[list[tuple[int, bool]]], others: int) -> dict:
    """τ and cap-AUC when each continuation is scored by the mean of `others` of its
    siblings (every choice of held-out continuation, the next `others` cyclically)."""
    import numpy as np

    from lab.predictor.progressive import _auc, _tau

    pred, true, share, cut = [], [], [], []
    for conts in runs:
        k = len(conts)
        for i in range(k):
            sib = [conts[(i + j) % k] for j in range(1, others + 1)]
            pred.append(np.mean([s[0] for s in sib]))
            share.append(np.mean([s[1] for s in sib]))
            true.append(conts[i][0])
            cut.append(conts[i][1])
    return {
        "others": others,
        "tau": _tau(np.asarray(pred), np.asarray(true, float)),
        "cap_auc": _auc(np.asarray(share), np.asarray(cut, bool)),
    }


def run(settings, n: int, generated: int, k: int, cap: int, temperature: float, seed: int,
        batch: int) -> dict:  # fmt: skip
    from lab.executor.driver import Driver
    from lab.predictor.calibrate import _chat_ids
    from services.common.models import load_tokenizer, served_model_id, weights_dir
    from services.executor.engine import Engine
    from services.predictor.sharegpt import load_split

    t0 = time.perf_counter()
    samples = load_split("test", settings.model, settings.data_dir)[:n]
    tokenizer = load_tokenizer(settings.model, settings.data_dir)
    engine = Engine(weights_dir(settings.model, settings.data_dir), device="cpu")
    driver = Driver(engine, token_budget=512, max_batch=batch)
    eos = list(engine.spec.eos_token_ids)
    prompts = [_chat_ids(tokenizer, s.prompt) for s in samples]
    heads = _prefixes(driver, prompts, generated, temperature, seed, eos)
    starts = [p + h for p, h in zip(prompts, heads, strict=True) if h is not None]
    runs: list[list[tuple[int, bool]]] = []
    per_chunk = max(1, batch // k)
    for i in range(0, len(starts), per_chunk):
        runs += _continue(driver, starts[i : i + per_chunk], cap - generated, k, temperature,
                          seed + i, eos)  # fmt: skip
        log.info("continued %d/%d prompts", len(runs), len(starts))
    engine.close()
    return {
        "model": served_model_id(settings.model),
        "cap": cap,
        "temperature": temperature,
        "generated": generated,
        "continuations": k,
        "test_prompts": len(samples),
        "running_at_generated": len(starts),
        "capped_share": round(sum(c[1] for r in runs for c in r) / max(1, sum(map(len, runs))), 4),
        "by_others": [scores(runs, m) for m in range(1, k)],
        "runs": [[list(c) for c in r] for r in runs],
        "seconds": round(time.perf_counter() - t0, 1),
    }


def main(args: argparse.Namespace) -> int:
    from lab.workload.report import emit_json
    from services.common.settings import PredictorSettings

    logging.basicConfig(level=logging.INFO)
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    result = run(PredictorSettings(), args.n, args.generated, args.continuations, args.cap,
                 args.temperature, args.seed, args.batch)  # fmt: skip
    emit_json(result, Path(args.json) if args.json else None)
    return 0


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "state-ceiling",
        help="how well the state after G generated tokens can order the remaining length "
        "(K continuations of the same state)",
    )
    p.add_argument("--n", type=int, default=100, help="test-split prompts")
    p.add_argument("--generated", type=int, default=32, help="G: the checkpoint")
    p.add_argument("--continuations", type=int, default=4, help="K continuations per state")
    p.add_argument("--cap", type=int, default=256, help="max_tokens of the whole answer")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch", type=int, default=64, help="sequences decoded together")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0 = default)")
    p.add_argument("--json", default=None, help="write the result here")
    p.set_defaults(func=main)

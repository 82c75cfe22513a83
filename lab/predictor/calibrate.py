"""`alise predictor calibrate`: the served model's own output lengths for train-split prompts.

ALISE's retrieval predictor is only as good as the lengths in its store, and the paper fills
it with the served LLM's generations. This runs N ShareGPT train-split prompts the way a chat
client sends them (the model's chat template, EOS honoured, one `max_tokens` cap, the API's
default temperature 1.0) through an in-process engine with continuous batching, and appends
one JSON line per prompt to a calibration file:

    {"id": ..., "length": 137, "censored": false, "prompt_len": 52}

`censored` is true when the answer was cut by the cap (its true length is only known to be
>= `length`). The file holds one model at one cap (its first line says which); the command is
resumable: prompts already in the file are skipped, and every batch is appended as it
finishes. Reading the files is serving's part: services/predictor/calibration_files.py.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING

from services.predictor.calibration_files import DEFAULT_CAP, calibration_name, read_calibration

if TYPE_CHECKING:
    from services.common.settings import PredictorSettings

log = logging.getLogger(__name__)


def calibrate(
    settings: PredictorSettings,
    n: int,
    max_tokens: int = DEFAULT_CAP,
    out: Path | None = None,
    batch: int = 32,
    temperature: float = 1.0,
    seed: int = 0,
    threads: int = 0,
    split: str = "train",
) -> dict:
    """Run up to `n` prompts of `split` (those not yet in `out`) and append their lengths.
    The train split seeds the predictor; the test split is held out to score it."""
    from lab.executor.driver import Driver
    from services.common.models import load_tokenizer, served_model_id, weights_dir
    from services.common.sampling import SamplingParams
    from services.executor.engine import Engine
    from services.workload.traces.sharegpt import load_split

    model = served_model_id(settings.model)
    out = out or settings.data_dir / "calibration" / calibration_name(model, max_tokens, split)
    header = dict(model=model, max_tokens=max_tokens, temperature=temperature, seed=seed)
    done = _open(out, {**header, "split": split})
    todo = [s for s in load_split(split, settings.model, settings.data_dir) if s.id not in done]
    todo = todo[: max(0, n - len(done))]
    if threads:
        import torch

        torch.set_num_threads(threads)
    tokenizer = load_tokenizer(settings.model, settings.data_dir)
    engine = Engine(weights_dir(settings.model, settings.data_dir), model_name=model, device="cpu")
    driver = Driver(engine, token_budget=512, max_batch=batch)
    eos = engine.spec.eos_token_ids
    sampling = SamplingParams(temperature=temperature, seed=seed)
    t0, tokens = time.perf_counter(), 0
    for start in range(0, len(todo), batch):
        chunk = todo[start : start + batch]
        prompts = [_chat_ids(tokenizer, s.prompt) for s in chunk]
        seqs = driver.generate(prompts, max_tokens, sampling, eos)
        with open(out, "a", encoding="utf-8") as f:
            for s, p, seq in zip(chunk, prompts, seqs, strict=True):
                f.write(json.dumps(_row(s.id, p, seq.output, max_tokens, eos)) + "\n")
        tokens += sum(len(seq.output) for seq in seqs)
        rate = tokens / (time.perf_counter() - t0)
        log.info("calibrated %d/%d (%.0f tokens/s)", len(done) + start + len(chunk), n, rate)
    engine.close()
    return _report(out, len(todo), tokens, time.perf_counter() - t0)


def _report(out: Path, new: int, tokens: int, run_s: float) -> dict:
    _, rows = read_calibration(out)
    cut = sum(r["censored"] for r in rows.values())
    return {
        "file": str(out),
        "prompts": len(rows),
        "new": new,
        "censored_fraction": round(cut / max(1, len(rows)), 3),
        "run_s": round(run_s, 1),
        "tokens_per_s": round(tokens / max(1e-9, run_s), 1),
    }


def _open(out: Path, header: dict) -> dict[str, dict]:
    """The rows already in `out` (created with `header` when new); refuses another model's
    or cap's file."""
    out.parent.mkdir(parents=True, exist_ok=True)
    if not out.exists():
        out.write_text(json.dumps({"header": header}) + "\n")
        return {}
    old, done = read_calibration(out)
    key = ("model", "max_tokens", "split")
    if old and [old.get(k, "train") for k in key] != [header[k] for k in key]:
        raise ValueError(
            f"{out} holds {old['model']} at cap {old['max_tokens']} "
            f"({old.get('split', 'train')} split)"
        )
    return done


def _row(sample_id: str, prompt: list[int], output: list[int], cap: int, eos) -> dict:
    return {
        "id": sample_id,
        "length": len(output),
        "censored": len(output) >= cap and output[-1] not in eos,  # a lower bound only
        "prompt_len": len(prompt),
    }


def _chat_ids(tokenizer, prompt: str) -> list[int]:
    """The prompt as the gateway renders a one-message chat (template, generation prompt)."""
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
    )
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])

"""`alise predictor calibrate`: the served model's own output lengths for ShareGPT prompts,
several draws per prompt, with the executor probe's features at every checkpoint.

ALISE's retrieval predictor is only as good as the lengths in its store, and the paper fills
it with the served LLM's generations; a prompt's answer length is a distribution at
temperature > 0 (ProD), so each prompt is answered `draws` times (default 4 at temperature
> 0, 1 at temperature 0). Prompts are sent the way a chat client sends them (the model's chat
template, EOS honoured, one `max_tokens` cap) through an in-process engine with continuous
batching, the same Engine that serves (so the features come from exactly the serving code),
and one JSON line per prompt is appended to `{model}-cap{N}-{t0|t1}[-test].jsonl`:

    {"id": ..., "prompt_len": 52, "temperature": 1.0, "lengths": [137, 256, 40, 91],
     "censored": [false, true, false, false]}

`censored` is true when a draw was cut by the cap (its true length is only known to be >=
its length). Next to it, `<stem>.features.npz` holds one row per (prompt, draw, checkpoint):
the probe's features (services/executor/probe.py) after `generated` output tokens, and the
draw's remaining tokens from there (services/predictor/calibration_files.py `FeatureRows`).
Resumable: prompts already in the file are skipped, every batch's features are written to
`<stem>.features.parts/` before its lines are appended, and the parts are packed into the
one compressed file at the end of a run.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from services.predictor.calibration_files import (
    DEFAULT_CAP,
    FeatureRows,
    calibration_name,
    concat_features,
    features_path,
    read_draws,
    read_features,
    regime,
    write_features,
)

if TYPE_CHECKING:
    from lab.executor.driver import DriverSeq
    from services.common.settings import PredictorSettings

log = logging.getLogger(__name__)


def default_draws(temperature: float) -> int:
    return 4 if temperature > 0 else 1


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
    draws: int = 0,
    predict_every: int = 16,
) -> dict:
    """Run up to `n` prompts of `split` (those not yet in `out`), `draws` times each (0 = the
    default for the temperature), and append their lengths (and their features). The train
    split seeds the predictor and trains the probe; the test split is held out to score them.
    `batch` = sequences decoded together (prompts x draws)."""
    from lab.executor.driver import Driver
    from services.common.models import load_tokenizer, served_model_id, weights_dir
    from services.executor.engine import Engine
    from services.predictor.sharegpt import load_split

    draws = draws or default_draws(temperature)
    model = served_model_id(settings.model)
    out = out or settings.data_dir / "calibration" / calibration_name(
        model, max_tokens, split, regime(temperature)
    )
    header = dict(
        model=model, max_tokens=max_tokens, temperature=temperature, seed=seed, split=split
    )
    done = _open(out, {**header, "draws": draws, "predict_every": predict_every})
    todo = [s for s in load_split(split, settings.model, settings.data_dir) if s.id not in done]
    todo = todo[: max(0, n - len(done))]
    if threads:
        import torch

        torch.set_num_threads(threads)
    tokenizer = load_tokenizer(settings.model, settings.data_dir)
    engine = Engine(
        weights_dir(settings.model, settings.data_dir),
        model_name=model,
        device="cpu",
        predict_every=predict_every,
        record_features=predict_every > 0,
    )
    driver = Driver(engine, token_budget=512, max_batch=batch)
    per_chunk = max(1, batch // draws)
    t0, tokens = time.perf_counter(), 0
    for start in range(0, len(todo), per_chunk):
        chunk = todo[start : start + per_chunk]
        prompts = [_chat_ids(tokenizer, s.prompt) for s in chunk]
        seqs = _run(driver, prompts, draws, max_tokens, temperature, seed)
        _write(out, chunk, prompts, seqs, draws, max_tokens, temperature, engine)
        tokens += sum(len(seq.output) for seq in seqs)
        rate = tokens / (time.perf_counter() - t0)
        log.info("calibrated %d/%d (%.0f tokens/s)", len(done) + start + len(chunk), n, rate)
    engine.close()
    if predict_every > 0:
        pack_features(out)
    return _report(out, len(todo), tokens, time.perf_counter() - t0)


def _run(driver, prompts, draws, max_tokens, temperature, seed) -> list[DriverSeq]:
    """Every prompt `draws` times (prompt-major), draw d with its own sampling seed."""
    from services.common.sampling import SamplingParams

    params = [SamplingParams(temperature=temperature, seed=seed * 1000 + d) for d in range(draws)]
    all_prompts = [p for p in prompts for _ in range(draws)]
    all_params = [params[d] for _ in prompts for d in range(draws)]
    eos = driver.engine.spec.eos_token_ids
    return driver.generate(all_prompts, max_tokens, all_params, eos)


def _write(out, chunk, prompts, seqs, draws, cap, temperature, engine) -> None:
    """The chunk's features (a part file) first, then its JSON lines."""
    eos = set(engine.spec.eos_token_ids)
    rows, parts = [], []
    for i, (s, p) in enumerate(zip(chunk, prompts, strict=True)):
        mine = seqs[i * draws : (i + 1) * draws]
        cut = [len(q.output) >= cap and q.output[-1] not in eos for q in mine]
        rows.append(
            {
                "id": s.id,
                "prompt_len": len(p),
                "temperature": temperature,
                "lengths": [len(q.output) for q in mine],
                "censored": cut,
            }
        )
        for d, (q, c) in enumerate(zip(mine, cut, strict=True)):
            parts.extend((s.id, d, g, len(q.output) - g, c, x) for g, x in q.features)
    if parts:
        from services.executor.probe import feature_names

        folder = _parts_dir(out)
        folder.mkdir(parents=True, exist_ok=True)
        names = feature_names(engine.spec.hidden_size)
        write_features(folder / f"part-{time.time_ns()}.npz", _rows(parts, names))
    with open(out, "a", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")


def _rows(parts: list[tuple], names: list[str]) -> FeatureRows:
    ids, draw, gen, rem, cen, x = zip(*parts, strict=True)
    return FeatureRows(
        np.asarray(ids),
        np.asarray(draw, dtype=np.int16),
        np.asarray(gen, dtype=np.int16),
        np.asarray(rem, dtype=np.int16),
        np.asarray(cen, dtype=bool),
        np.stack(x).astype(np.float16),
        names,
    )


def _parts_dir(out: Path) -> Path:
    return out.with_name(out.name.removesuffix(".jsonl") + ".features.parts")


def pack_features(out: Path) -> Path | None:
    """Pack the part files (and an earlier packed file) into `<stem>.features.npz`, keeping
    the rows of prompts in the JSONL file, each prompt's from its newest part."""
    folder, packed = _parts_dir(out), features_path(out)
    parts = sorted(folder.glob("part-*.npz")) if folder.exists() else []
    if not parts:
        return packed if packed.exists() else None
    sources = ([packed] if packed.exists() else []) + parts
    _, done = read_draws(out)
    owner: dict[str, int] = {}
    loaded = [read_features(p) for p in sources]
    for k, rows in enumerate(loaded):
        for pid in set(rows.ids.tolist()):
            owner[pid] = k
    kept = [
        rows.select(np.asarray([owner.get(p) == k and p in done for p in rows.ids], dtype=bool))
        for k, rows in enumerate(loaded)
    ]
    write_features(packed, concat_features(kept))
    for p in parts:
        p.unlink()
    folder.rmdir()
    return packed


def _report(out: Path, new: int, tokens: int, run_s: float) -> dict:
    _, rows = read_draws(out)
    cut = [c for r in rows.values() for c in r.censored]
    return {
        "file": str(out),
        "prompts": len(rows),
        "draws": len(cut),
        "new": new,
        "censored_fraction": round(sum(cut) / max(1, len(cut)), 3),
        "run_s": round(run_s, 1),
        "tokens_per_s": round(tokens / max(1e-9, run_s), 1),
    }


def _open(out: Path, header: dict) -> set[str]:
    """The prompt ids already in `out` (created with `header` when new); refuses a file of
    another model, cap, split, temperature or number of draws."""
    out.parent.mkdir(parents=True, exist_ok=True)
    if not out.exists():
        out.write_text(json.dumps({"header": header}) + "\n")
        return set()
    old, done = read_draws(out)
    key = ("model", "max_tokens", "split", "temperature", "draws")
    defaults = {"split": "train", "temperature": 1.0, "draws": 1}
    if old and [old.get(k, defaults.get(k)) for k in key] != [header[k] for k in key]:
        raise ValueError(f"{out} holds another calibration: {old}")
    return set(done)


def _chat_ids(tokenizer, prompt: str) -> list[int]:
    """The prompt as the gateway renders a one-message chat (template, generation prompt)."""
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
    )
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])

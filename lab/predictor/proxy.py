"""Proxy baseline (ALISE Table 2): the embedder fine-tuned end-to-end with a regression head.

Like the proxy-model predictors the ALISE paper compares against (S3, SSJF), every prompt
goes through a fine-tuned encoder; there is no database. Used by `alise predictor eval` only.
Training is kept short for a 2-core CPU: a subset of the train split (default 2000 prompts),
1 epoch, prompts truncated to `train_tokens` word pieces; the target is standardised
`log1p(length)`. Saved under `<data_dir>/predictor/proxy-<model>/` (a sentence-transformers
directory plus `head.pt`).
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import nn

if TYPE_CHECKING:
    from sentence_transformers import SentenceTransformer

    from services.common.settings import PredictorSettings

log = logging.getLogger(__name__)


def proxy_dir(settings: PredictorSettings, model: str) -> Path:
    return Path(settings.data_dir) / "predictor" / f"proxy-{model}"


class ProxyPredictor:
    """Fine-tuned encoder + linear head -> lengths."""

    def __init__(
        self,
        encoder: SentenceTransformer,
        head: nn.Linear,
        y_mean: float,
        y_std: float,
        normalize: bool = True,
    ) -> None:
        self.encoder, self.head = encoder.eval(), head.eval()
        self.y_mean, self.y_std, self.normalize = y_mean, y_std, normalize

    def _forward(self, texts: list[str]) -> torch.Tensor:
        prep = getattr(self.encoder, "preprocess", None) or self.encoder.tokenize
        features = prep(texts)
        return self.head(self.encoder(features)["sentence_embedding"])[:, 0]  # [N]

    @torch.inference_mode()
    def predict(self, prompts: list[str]) -> np.ndarray:
        from services.predictor.embedder import normalize_prompt

        texts = [normalize_prompt(p) for p in prompts] if self.normalize else list(prompts)
        z = self._forward(texts).numpy()  # [N]
        return np.maximum(np.expm1(z * self.y_std + self.y_mean), 1.0)

    def save(self, path: Path) -> None:
        self.encoder.save(str(path))
        torch.save(
            {
                "state_dict": self.head.state_dict(),
                "y_mean": self.y_mean,
                "y_std": self.y_std,
                "normalize": self.normalize,
            },
            path / "head.pt",
        )

    @classmethod
    def load(cls, path: Path, max_seq_length: int | None = None) -> ProxyPredictor:
        from sentence_transformers import SentenceTransformer

        encoder = SentenceTransformer(str(path), device="cpu", local_files_only=True)
        if max_seq_length:
            encoder.max_seq_length = max_seq_length
        ckpt = torch.load(path / "head.pt", map_location="cpu", weights_only=True)
        head = nn.Linear(ckpt["state_dict"]["weight"].shape[1], 1)
        head.load_state_dict(ckpt["state_dict"])
        return cls(encoder, head, ckpt["y_mean"], ckpt["y_std"], ckpt["normalize"])


def train_proxy(
    settings: PredictorSettings,
    limit: int = 2000,
    epochs: int = 1,
    batch: int = 16,
    train_tokens: int = 128,
    lr: float = 3e-5,
    seed: int = 0,
) -> dict:
    """Fine-tune the configured embedder + head on `limit` train prompts; save; report."""
    from sentence_transformers import SentenceTransformer

    from services.predictor.build import served_models, train_samples
    from services.predictor.embedder import embedder_dir

    model_id = served_models(settings)[0]
    if settings.predictor_threads:
        torch.set_num_threads(settings.predictor_threads)
    rng = np.random.default_rng(seed)
    samples = train_samples(settings)
    samples = [samples[i] for i in rng.permutation(len(samples))[:limit]]
    encoder = SentenceTransformer(
        str(embedder_dir(settings.embedder)), device="cpu", local_files_only=True
    )
    encoder.max_seq_length = train_tokens
    y = np.log1p(np.array([s.output_len for s in samples], np.float32))
    y_mean, y_std = float(y.mean()), float(y.std())
    head = nn.Linear(encoder[0].auto_model.config.hidden_size, 1)
    proxy = ProxyPredictor(encoder, head, y_mean, y_std)
    torch.manual_seed(seed)
    opt = torch.optim.AdamW(
        [{"params": encoder.parameters(), "lr": lr}, {"params": head.parameters(), "lr": 1e-3}]
    )
    target = torch.from_numpy((y - y_mean) / y_std)  # [N]
    texts = [s.prompt for s in samples]
    t0 = time.perf_counter()
    losses = _fit(proxy, opt, texts, target, epochs, batch, t0)
    encoder.max_seq_length = settings.predictor_embed_tokens
    path = proxy_dir(settings, model_id)
    proxy.save(path)
    return {
        "path": str(path),
        "samples": len(samples),
        "epochs": epochs,
        "train_tokens": train_tokens,
        "train_s": round(time.perf_counter() - t0, 1),
        "final_loss": round(float(np.mean(losses[-20:])), 4),
    }


def _fit(
    proxy: ProxyPredictor,
    opt: torch.optim.Optimizer,
    texts: list[str],
    target: torch.Tensor,
    epochs: int,
    batch: int,
    t0: float,
) -> list[float]:
    """The training loop (encoder and head in train mode, back in eval mode after): MSE on the
    standardised targets, shuffled batches; returns the loss of every step."""
    losses: list[float] = []
    proxy.encoder.train(), proxy.head.train()
    for _ in range(epochs):
        for idx in torch.randperm(len(texts)).split(batch):
            loss = nn.functional.mse_loss(proxy._forward([texts[i] for i in idx]), target[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
            if len(losses) % 20 == 0:
                log.info(
                    "proxy step %d loss %.4f (%.0f s)",
                    len(losses),
                    float(np.mean(losses[-20:])),
                    time.perf_counter() - t0,
                )
    proxy.encoder.eval(), proxy.head.eval()
    return losses

"""MLP regressor: prompt embedding (+ log prompt length) -> log output length.

Trained on the train split's embeddings with the target `log1p(length)` standardised; the
checkpoint holds the weights, the architecture and the normalisation, so loading needs no
other file. `predict` returns lengths in tokens.

Censored lengths (answers cut by max_tokens, `services.common.censoring`): trained with a
censored flag per sample, the net grows a second output, the logit of P(runs to the cap)
(`predict_capped`), fit by cross-entropy on every sample, while the length output is fit on
the answers that ended on their own only (a cut answer's length is not its length).

Several draws per prompt (`services.predictor.regimes`): the length target is the median of
the draws that ended, the cap head's target the share of draws cut, and a last output (the
spread head) learns the spread of the draws, where a prompt has more than one.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn


@dataclass
class MlpConfig:
    dim: int = 384
    hidden: int = 256
    layers: int = 2
    dropout: float = 0.1
    length_feature: bool = True  # append log1p(prompt chars) to the embedding
    y_mean: float = 0.0  # of log1p(length)
    y_std: float = 1.0
    f_mean: float = 0.0  # of the length feature
    f_std: float = 1.0
    prior: float = 0.0  # mean train length (the `prior` predictor)
    capped_head: bool = False  # a second output: logit of P(the answer runs to the cap)
    spread_head: bool = False  # a last output: the spread of the prompt's draws (log1p std)
    s_mean: float = 0.0  # of the known spreads (the spread head is standardised)
    s_std: float = 1.0


def build(cfg: MlpConfig) -> nn.Sequential:
    width, mods = cfg.dim + int(cfg.length_feature), []
    for _ in range(cfg.layers):
        mods += [nn.Linear(width, cfg.hidden), nn.GELU(), nn.Dropout(cfg.dropout)]
        width = cfg.hidden
    mods.append(nn.Linear(width, 1 + int(cfg.capped_head) + int(cfg.spread_head)))
    return nn.Sequential(*mods)


def length_feature(texts: list[str]) -> np.ndarray:
    """[N] log1p of each (normalised) prompt's character count."""
    return np.log1p(np.array([len(t) for t in texts], np.float32))


class MlpRegressor:
    def __init__(self, cfg: MlpConfig, net: nn.Module | None = None) -> None:
        self.cfg = cfg
        self.net = (net or build(cfg)).eval()

    def _inputs(self, emb: np.ndarray, feat: np.ndarray | None) -> torch.Tensor:
        x = torch.from_numpy(np.ascontiguousarray(emb, np.float32))  # [N, D]
        if self.cfg.length_feature:
            f = np.zeros(len(emb), np.float32) if feat is None else feat
            f = torch.from_numpy((f - self.cfg.f_mean) / self.cfg.f_std).float()  # [N]
            x = torch.cat([x, f[:, None]], dim=1)  # [N, D+1]
        return x

    @torch.inference_mode()
    def predict(self, emb: np.ndarray, feat: np.ndarray | None = None) -> np.ndarray:
        """[N] predicted lengths (tokens, >= 1)."""
        if len(emb) == 0:
            return np.zeros(0, np.float32)
        z = self.net(self._inputs(emb, feat))[:, 0].numpy()  # [N]
        return np.maximum(np.expm1(z * self.cfg.y_std + self.cfg.y_mean), 1.0)

    @torch.inference_mode()
    def predict_capped(self, emb: np.ndarray, feat: np.ndarray | None = None) -> np.ndarray:
        """[N] probability that each answer runs to the cap (0 without a censoring head)."""
        if len(emb) == 0 or not self.cfg.capped_head:
            return np.zeros(len(emb), np.float32)
        return torch.sigmoid(self.net(self._inputs(emb, feat))[:, 1]).numpy()

    @torch.inference_mode()
    def predict_spread(self, emb: np.ndarray, feat: np.ndarray | None = None) -> np.ndarray:
        """[N] predicted spread of each prompt's lengths (0 without a spread head)."""
        if len(emb) == 0 or not self.cfg.spread_head:
            return np.zeros(len(emb), np.float32)
        z = self.net(self._inputs(emb, feat))[:, -1].numpy()  # [N]
        return np.maximum(z * self.cfg.s_std + self.cfg.s_mean, 0.0)

    def save(self, path: Path) -> None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        torch.save({"config": asdict(self.cfg), "state_dict": self.net.state_dict()}, path)

    @classmethod
    def load(cls, path: Path) -> MlpRegressor:
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
        cfg = MlpConfig(**ckpt["config"])
        net = build(cfg)
        net.load_state_dict(ckpt["state_dict"])
        return cls(cfg, net)


def _loss(
    out: torch.Tensor, t: torch.Tensor, cut: torch.Tensor | None, spread: torch.Tensor | None
) -> torch.Tensor:
    """MSE on the lengths of prompts with an answer that ended; plus cross-entropy of the cap
    head against the share of cut draws, and MSE of the spread head where it is known (not
    NaN), when there are those heads."""
    if cut is None:
        loss = nn.functional.mse_loss(out[:, 0], t)
    else:
        ended = cut < 1.0  # at least one draw ended on its own
        mse = (
            nn.functional.mse_loss(out[ended, 0], t[ended]) if ended.any() else out[:, 0].sum() * 0
        )
        loss = mse + nn.functional.binary_cross_entropy_with_logits(out[:, 1], cut)
    if spread is not None:
        known = ~torch.isnan(spread)
        if known.any():
            loss = loss + nn.functional.mse_loss(out[known, -1], spread[known])
    return loss


def _standard_spread(cfg: MlpConfig, spread: np.ndarray | None) -> torch.Tensor:
    """The spread targets standardised over the known ones (NaN stays NaN); sets cfg's."""
    assert spread is not None
    known = spread[np.isfinite(spread)]
    cfg.s_mean, cfg.s_std = float(known.mean()), float(known.std() or 1.0)
    return torch.from_numpy(((spread - cfg.s_mean) / cfg.s_std).astype(np.float32))


def _at(values: torch.Tensor | None, idx: torch.Tensor) -> torch.Tensor | None:
    return None if values is None else values[idx]


def _normalise(
    cfg: MlpConfig,
    feat: np.ndarray,
    lengths: np.ndarray,
    censored: np.ndarray | None,
    spread: np.ndarray | None,
) -> np.ndarray:
    """Set `cfg`'s heads, normalisation and prior for these targets; log1p of the lengths."""
    cfg.capped_head = censored is not None
    cfg.spread_head = spread is not None and bool(np.isfinite(spread).any())
    y = np.log1p(lengths.astype(np.float32))
    ended = y if censored is None or (censored >= 1).all() else y[np.asarray(censored) < 1]
    cfg.y_mean, cfg.y_std = float(ended.mean()), float(ended.std() or 1.0)
    cfg.f_mean, cfg.f_std = float(feat.mean()), float(feat.std() or 1.0)
    cfg.prior = float(lengths.mean())
    return y


def train(
    emb: np.ndarray,
    feat: np.ndarray,
    lengths: np.ndarray,
    cfg: MlpConfig | None = None,
    epochs: int = 60,
    lr: float = 1e-3,
    weight_decay: float = 1e-4,
    batch: int = 256,
    val_fraction: float = 0.1,
    seed: int = 0,
    log: Callable[[str], None] | None = print,
    censored: np.ndarray | None = None,
    spread: np.ndarray | None = None,
    stop: Callable[[], bool] | None = None,
) -> MlpRegressor:
    """Fit on (embeddings [N, D], length feature [N], lengths [N], censored [N] or None, spread
    [N] or None); keep the best val epoch. `censored`: each prompt's flag, or the share of its
    draws cut at the cap (`lengths` then the median of those that ended); `spread`: the spread
    of its draws, NaN where unknown (one draw)."""
    cfg = cfg or MlpConfig(dim=emb.shape[1])
    y = _normalise(cfg, feat, lengths, censored, spread)
    torch.manual_seed(seed)
    model = MlpRegressor(cfg)
    x = model._inputs(emb, feat)  # [N, D(+1)]
    t = torch.from_numpy((y - cfg.y_mean) / cfg.y_std)  # [N]
    cut = None if censored is None else torch.from_numpy(censored.astype(np.float32))  # [N]
    sd = _standard_spread(cfg, spread) if cfg.spread_head else None  # [N]
    perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed))
    n_val = max(1, int(len(x) * val_fraction))
    val, tr = perm[:n_val], perm[n_val:]
    opt = torch.optim.AdamW(model.net.parameters(), lr=lr, weight_decay=weight_decay)
    best, best_state, patience = math.inf, None, 0
    for epoch in range(epochs):
        if stop is not None and stop():
            break  # the caller, which asked, discards the model
        model.net.train()
        for idx in tr[torch.randperm(len(tr))].split(batch):
            loss = _loss(model.net(x[idx]), t[idx], _at(cut, idx), _at(sd, idx))
            opt.zero_grad()
            loss.backward()
            opt.step()
        model.net.eval()
        with torch.no_grad():
            val_loss = _loss(model.net(x[val]), t[val], _at(cut, val), _at(sd, val)).item()
        if val_loss < best - 1e-4:
            best, patience = val_loss, 0
            best_state = {k: v.clone() for k, v in model.net.state_dict().items()}
        else:
            patience += 1
        if log and epoch % 10 == 0:
            log(f"epoch {epoch} val_loss {val_loss:.4f} best {best:.4f}")
        if patience >= 8:
            break
    if best_state is not None:  # None: stopped before the first epoch
        model.net.load_state_dict(best_state)
    model.net.eval()
    return model

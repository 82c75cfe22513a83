"""`alise predictor train-probe`: fit the executor's remaining-length probe
(services/executor/probe.py) on the feature rows of a calibration file.

Each row is one checkpoint of one draw: features after `generated` output tokens, label the
draw's remaining tokens until it ended or hit the cap. A 2-layer MLP (GELU, 64 hidden units by
default) on standardised features outputs q50, two log-gaps (q10 = q50 - softplus, q90 = q50 +
softplus: ordered by construction) of log1p(remaining), fit by pinball loss, and the logit of
P(the draw runs to the cap), fit by cross-entropy. Remaining lengths are counted to the cap,
so a censored draw's label is exact for that cap. AdamW, minibatches of 256, early stopping on
the rows of 10% of the prompts (held out by prompt id, never by row, so no prompt's draws sit
on both sides), fixed seed: the same file gives the same weights on the same machine.
"""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path

import numpy as np
import torch

from services.executor.probe import Probe
from services.predictor.calibration_files import FeatureRows

log = logging.getLogger(__name__)

QUANTILES = (0.1, 0.5, 0.9)


def holdout_mask(ids: np.ndarray, share: float = 0.1) -> np.ndarray:
    """Rows whose prompt id hashes into the held-out `share` (stable across runs)."""

    def bucket(pid: str) -> float:
        return int(hashlib.sha1(pid.encode()).hexdigest()[:8], 16) / 0xFFFFFFFF

    cache: dict[str, bool] = {}
    return np.asarray([cache.setdefault(p, bucket(p) < share) for p in ids.tolist()], dtype=bool)


def _loss(out: torch.Tensor, y: torch.Tensor, cut: torch.Tensor) -> torch.Tensor:
    sp = torch.nn.functional.softplus
    q = torch.stack([out[:, 0] - sp(out[:, 1]), out[:, 0], out[:, 0] + sp(out[:, 2])], dim=1)
    diff = y[:, None] - q
    tau = torch.tensor(QUANTILES)
    pinball = torch.maximum(tau * diff, (tau - 1) * diff).mean()
    bce = torch.nn.functional.binary_cross_entropy_with_logits(out[:, 3], cut)
    return pinball + 0.5 * bce


def _tensors(rows: FeatureRows) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    x = torch.from_numpy(rows.x.astype(np.float32))
    y = torch.from_numpy(np.log1p(rows.remaining.astype(np.float32)))
    cut = torch.from_numpy(rows.censored.astype(np.float32))
    return x, y, cut


def train_probe(
    rows: FeatureRows,
    *,
    model: str,
    cap: int,
    regime: str,
    hidden: int = 64,
    epochs: int = 60,
    seed: int = 0,
    columns: list[int] | None = None,
    source: str = "",
) -> Probe:
    """A Probe fit on `rows`; `columns` restricts the features it reads (the others get zero
    weight: an ablation), None = all."""
    torch.manual_seed(seed)
    held = holdout_mask(rows.ids)
    x, y, cut = _tensors(rows)
    mean, std = x[~torch.from_numpy(held)].mean(0), x[~torch.from_numpy(held)].std(0)
    std = torch.where(std > 1e-6, std, torch.ones_like(std))
    keep = torch.zeros(x.shape[1])
    keep[columns if columns is not None else slice(None)] = 1.0
    xs = (x - mean) / std * keep
    layers = [torch.nn.Linear(x.shape[1], hidden), torch.nn.GELU()] if hidden else []
    net = torch.nn.Sequential(*layers, torch.nn.Linear(hidden or x.shape[1], 4))
    with torch.no_grad():
        net[-1].bias.copy_(torch.tensor([float(y.median()), 0.5, 0.5, 0.0]))
    best = _fit(net, xs, y, cut, torch.from_numpy(held), epochs, seed)
    linears = [m for m in net if isinstance(m, torch.nn.Linear)]
    arrays = {"mean": mean.numpy(), "std": std.numpy()}
    for i, lin in enumerate(linears):
        w = lin.weight.detach() * (keep if i == 0 else 1.0)  # unread columns: zero weight
        arrays[f"w{i}"] = w.T.contiguous().numpy()
        arrays[f"b{i}"] = lin.bias.detach().numpy()
    meta = {
        "model": model,
        "cap": cap,
        "regime": regime,
        "names": rows.names,
        "hidden": hidden,
        "seed": seed,
        "rows": len(rows),
        "prompts": len(set(rows.ids.tolist())),
        "val_loss": round(best, 5),
        "source": source,
        "columns": "all" if columns is None else len(columns),
    }
    return Probe(arrays, meta)


def _fit(net, xs, y, cut, held, epochs: int, seed: int) -> float:
    opt = torch.optim.AdamW(net.parameters(), lr=2e-3, weight_decay=1e-3)
    gen = torch.Generator().manual_seed(seed)
    train_idx = torch.nonzero(~held).squeeze(1)
    val = torch.nonzero(held).squeeze(1)
    best, best_state, patience = float("inf"), None, 0
    for _ in range(epochs):
        net.train()
        for batch in train_idx[torch.randperm(len(train_idx), generator=gen)].split(256):
            opt.zero_grad()
            _loss(net(xs[batch]), y[batch], cut[batch]).backward()
            opt.step()
        net.eval()
        with torch.no_grad():
            v = float(_loss(net(xs[val]), y[val], cut[val])) if len(val) else 0.0
        if v < best - 1e-4:
            best, patience = v, 0
            best_state = {k: t.clone() for k, t in net.state_dict().items()}
        else:
            patience += 1
            if patience >= 8:
                break
    if best_state is not None:
        net.load_state_dict(best_state)
    return best


def probe_path(model: str, cap: int, regime: str, root: Path | None = None) -> Path:
    from services.executor.probe import PROBES_DIR

    return (root or PROBES_DIR) / model / f"cap{cap}-{regime}.npz"


def main(args) -> int:
    """`alise predictor train-probe`: fit and write the probe of each regime whose train-split
    calibration file has features."""
    import json

    from services.common.models import served_model_id
    from services.common.settings import PredictorSettings
    from services.predictor.calibration_files import calibration_file, features_path, read_features

    settings = PredictorSettings()
    model = served_model_id(settings.model)
    root = Path(args.out_dir) if args.out_dir else None
    regimes = ("t1", "t0") if args.regime == "both" else (args.regime,)
    for reg in regimes:
        path = calibration_file(model, Path(settings.data_dir), args.cap, "train", reg)
        if path is None or not features_path(path).exists():
            log.warning("no %s train-split features for %s at cap %d", reg, model, args.cap)
            continue
        rows = read_features(features_path(path))
        probe = train_probe(
            rows, model=model, cap=args.cap, regime=reg, hidden=args.hidden, seed=args.seed,
            source=path.name,
        )  # fmt: skip
        out = probe_path(model, args.cap, reg, root)
        probe.save(out)
        print(
            json.dumps({"probe": str(out), **{k: v for k, v in probe.meta.items() if k != "names"}})
        )
    return 0

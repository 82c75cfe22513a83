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
    pca: int = 16,
) -> Probe:
    """A Probe fit on `rows`; `columns` restricts the features it reads (the others get zero
    weight: an ablation), None = all. The hidden state enters through its first `pca`
    principal components (fit on the training rows; folded into the first layer's weights,
    so the shipped probe reads the raw features); 0 = the whole hidden state."""
    torch.manual_seed(seed)
    held = holdout_mask(rows.ids)
    x, y, cut = _tensors(rows)
    mean, std = x[~torch.from_numpy(held)].mean(0), x[~torch.from_numpy(held)].std(0)
    std = torch.where(std > 1e-6, std, torch.ones_like(std))
    keep = torch.zeros(x.shape[1])
    keep[columns if columns is not None else slice(None)] = 1.0
    xs = (x - mean) / std * keep
    proj = _projection(xs[~torch.from_numpy(held)], rows.names, pca)  # [F, P]
    xp = xs @ proj
    layers = [torch.nn.Linear(xp.shape[1], hidden), torch.nn.GELU()] if hidden else []
    net = torch.nn.Sequential(*layers, torch.nn.Linear(hidden or xp.shape[1], 4))
    with torch.no_grad():
        net[-1].bias.copy_(torch.tensor([float(y.median()), 0.5, 0.5, 0.0]))
    best = _fit(net, xp, y, cut, torch.from_numpy(held), epochs, seed)
    linears = [m for m in net if isinstance(m, torch.nn.Linear)]
    arrays = {"mean": mean.numpy(), "std": std.numpy()}
    for i, lin in enumerate(linears):
        w = lin.weight.detach().T  # [in, out]
        if i == 0:  # the projection folded in; unread columns get zero weight
            w = (proj @ w) * keep[:, None]
        arrays[f"w{i}"] = w.contiguous().numpy()
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


def _projection(xs: torch.Tensor, names: list[str], pca: int) -> torch.Tensor:
    """[F, P]: the scalar features kept as they are, the hidden-state columns (names h0...)
    replaced by their first `pca` principal components (identity when pca is 0)."""
    hid = [i for i, n in enumerate(names) if n.startswith("h") and n[1:].isdigit()]
    width = xs.shape[1]
    if not pca or not hid or pca >= len(hid):
        return torch.eye(width)
    other = [i for i in range(width) if i not in set(hid)]
    block = xs[:, hid]
    _, _, v = torch.linalg.svd(block - block.mean(0), full_matrices=False)
    proj = torch.zeros(width, len(other) + pca)
    proj[other, torch.arange(len(other))] = 1.0
    proj[torch.tensor(hid)[:, None], torch.arange(len(other), len(other) + pca)] = v[:pca].T
    return proj


def _fit(net, xs, y, cut, held, epochs: int, seed: int) -> float:
    opt = torch.optim.AdamW(net.parameters(), lr=2e-3, weight_decay=1e-2)
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


CONFIGS: dict[str, dict] = {
    "pca4": {"pca": 4},
    "pca16": {"pca": 16},
    "scalars": {"columns": "scalars"},
}


def _config(name: str, width: int) -> dict:
    from services.executor.probe import SCALAR_NAMES

    kw = dict(CONFIGS[name])
    if kw.get("columns") == "scalars":
        kw["columns"] = list(range(len(SCALAR_NAMES)))
    return kw


def cv_loss(rows: FeatureRows, name: str, folds: int = 5, seed: int = 0, **common) -> float:
    """Mean held-out loss of configuration `name` over `folds` folds by prompt id."""
    ids = np.asarray(sorted(set(rows.ids.tolist())))
    losses = []
    for f in range(folds):
        test = np.isin(rows.ids, ids[f::folds])
        probe = train_probe(rows.select(~test), seed=seed, **common, **_config(name, 0))
        held = rows.select(test)
        x, y, cut = _tensors(held)
        raw = probe.raw(x)  # q10, q50, q90, logit: back to the training outputs
        out = torch.stack(
            [raw[:, 1], _inv_softplus(raw[:, 1] - raw[:, 0]), _inv_softplus(raw[:, 2] - raw[:, 1]),
             raw[:, 3]], dim=1,
        )  # fmt: skip
        losses.append(float(_loss(out, y, cut)) * len(held))
    return sum(losses) / len(rows)


def _inv_softplus(v: torch.Tensor) -> torch.Tensor:
    return torch.log(torch.expm1(v.clamp_min(1e-6)))


def select_and_train(rows: FeatureRows, seed: int = 0, **common) -> tuple[Probe, dict]:
    """The configuration with the lowest 5-fold loss (folds by prompt) on `rows`, refit on
    all of them; with the losses of each configuration."""
    losses = {name: round(cv_loss(rows, name, seed=seed, **common), 5) for name in CONFIGS}
    best = min(losses, key=losses.__getitem__)
    probe = train_probe(rows, seed=seed, **common, **_config(best, 0))
    probe.meta.update(config=best, cv_losses=losses)
    return probe, losses


def probe_path(model: str, cap: int, regime: str, root: Path | None = None) -> Path:
    from services.executor.probe import PROBES_DIR

    return (root or PROBES_DIR) / model / f"cap{cap}-{regime}.npz"


def main(args) -> int:
    """`alise predictor train-probe`: fit and write the probe of each regime whose train-split
    calibration file has features."""
    import json

    from services.common.models import served_model_id
    from services.common.settings import PredictorSettings
    from services.predictor.calibration_files import draws_file, features_path, read_features

    settings = PredictorSettings()
    model = served_model_id(settings.model)
    root = Path(args.out_dir) if args.out_dir else None
    regimes = ("t1", "t0") if args.regime == "both" else (args.regime,)
    for reg in regimes:
        path = draws_file(model, Path(settings.data_dir), args.cap, "train", reg)
        if path is None or not features_path(path).exists():
            log.warning("no %s train-split features for %s at cap %d", reg, model, args.cap)
            continue
        rows = read_features(features_path(path))
        probe, _ = select_and_train(
            rows, seed=args.seed, model=model, cap=args.cap, regime=reg, hidden=args.hidden,
            source=path.name,
        )  # fmt: skip
        out = probe_path(model, args.cap, reg, root)
        probe.save(out)
        print(
            json.dumps({"probe": str(out), **{k: v for k, v in probe.meta.items() if k != "names"}})
        )
    return 0

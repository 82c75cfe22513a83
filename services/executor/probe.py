"""The remaining-length probe: the served model predicts its own remaining output length.

At the end of a request's prefill (its first sampled token, `generated` = 0) and every
`predict_every` output tokens after that (`generated` = 16, 32, ... by default), the engine
builds a feature vector from the step it ran anyway:

- the final-norm hidden state of the newest token (the row the LM head reads),
- statistics of the next-token distributions over the recent window (the tokens sampled since
  the previous checkpoint, this step's included): entropy (last, mean, max; mean since the
  start) and P(EOS) (log of the last, log of the window's max, the window's mean),
- the share of the window's tokens that repeat a 4-gram seen earlier in the output (a looping
  answer runs to the cap),
- log1p of the output tokens so far, of the tokens left to `max_tokens`, of the prompt length.

A tiny MLP (`Probe`; weights per (model, cap, temperature regime) in
services/executor/probes/<model>/cap<N>-<t0|t1>.npz, trained by `alise predictor
train-probe` on calibration draws) maps the features of every request at a checkpoint in one
batched call to the quantiles q10/q50/q90 of log1p(remaining tokens) (pinball loss) and the
logit of P(the request runs to max_tokens) (cross-entropy). The remaining tokens count from
`generated`, the token this step samples included, and stop at max_tokens.
"""

from __future__ import annotations

import json
import logging
import math
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from services.common.step import RemainingForecast

if TYPE_CHECKING:
    from services.executor.messages import StepOutput

log = logging.getLogger(__name__)

PROBES_DIR = Path(__file__).parent / "probes"
SCALAR_NAMES = (
    "log1p_generated",
    "log1p_left",
    "log1p_prompt",
    "entropy_last",
    "entropy_mean_window",
    "entropy_max_window",
    "entropy_mean_all",
    "log_peos_last",
    "log_peos_max_window",
    "peos_mean_window",
    "repeat4_window",
)
NGRAM = 4


def feature_names(hidden_size: int) -> list[str]:
    return list(SCALAR_NAMES) + [f"h{i}" for i in range(hidden_size)]


@dataclass
class ProbeState:
    """A request's rolling statistics between checkpoints (one float pair per sampled token
    of the current window, a running entropy sum)."""

    window: int
    entropies: deque = field(default_factory=deque)
    peos: deque = field(default_factory=deque)
    entropy_sum: float = 0.0
    count: int = 0

    def push(self, entropy: float, p_eos: float) -> None:
        if len(self.entropies) == self.window:
            self.entropies.popleft()
            self.peos.popleft()
        self.entropies.append(entropy)
        self.peos.append(p_eos)
        self.entropy_sum += entropy
        self.count += 1


def repeat_share(output: list[int], window: int, n: int = NGRAM) -> float:
    """Share of the last `window` output tokens that end an n-gram seen earlier in the output."""
    seen: set[tuple[int, ...]] = set()
    hits = total = 0
    first = len(output) - window
    for end in range(n, len(output) + 1):
        gram = tuple(output[end - n : end])
        if end - 1 >= first:
            total += 1
            hits += gram in seen
        seen.add(gram)
    return hits / total if total else 0.0


def scalar_features(
    state: ProbeState, generated: int, left: int, prompt_len: int, output: list[int]
) -> list[float]:
    ent, peos = list(state.entropies), list(state.peos)
    return [
        math.log1p(generated),
        math.log1p(max(0, left)),
        math.log1p(prompt_len),
        ent[-1],
        sum(ent) / len(ent),
        max(ent),
        state.entropy_sum / state.count,
        math.log(max(peos[-1], 1e-12)),
        math.log(max(max(peos), 1e-12)),
        sum(peos) / len(peos),
        repeat_share(output, state.window),
    ]


def token_stats(
    logits: torch.Tensor,
    eos_ids: list[int],
    logp: torch.Tensor | None = None,
    work: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(entropy [S], P(EOS) [S], the probabilities [S, V]) of the raw next-token
    distributions of logits [S, V] (logp: their log_softmax, when the caller has it; work: a
    reusable buffer of at least S x V floats, so a step allocates no fresh [S, V] tensor,
    whose page faults cost more than the arithmetic on CPU). The probabilities are the exp
    pass the entropy needs anyway; the sampler draws from them for rows it samples from the
    raw distribution (`sampler.sample`'s `probs`)."""
    if logp is None:
        logp = torch.log_softmax(logits.float(), dim=-1)
    if work is None or work.numel() < logp.numel() or work.dtype != logp.dtype:
        p = logp.exp()
    else:
        p = torch.exp(logp, out=work.view(-1)[: logp.numel()].view(logp.shape))
    entropy = -torch.linalg.vecdot(p, logp)
    p_eos = logp[:, eos_ids].exp().sum(-1) if eos_ids else torch.zeros_like(entropy)
    return entropy, p_eos, p


class Probe:
    """A 2-layer MLP (or a linear map when it has no hidden layer) over standardised
    features -> [q10, q50, q90 of log1p(remaining), logit P(cap)]."""

    def __init__(self, arrays: dict[str, np.ndarray], meta: dict) -> None:
        self.meta, self.arrays = meta, arrays
        self.cap, self.regime = int(meta["cap"]), str(meta["regime"])
        self.names: list[str] = list(meta["names"])
        self._tensors: dict[torch.device, dict[str, torch.Tensor]] = {}

    @classmethod
    def load(cls, path: Path) -> Probe:
        with np.load(path, allow_pickle=False) as z:
            arrays = {k: z[k].astype(np.float32) for k in z.files if k != "meta"}
            meta = json.loads(str(z["meta"]))
        return cls(arrays, meta)

    def save(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        np.savez_compressed(path, meta=np.asarray(json.dumps(self.meta)), **self.arrays)

    def _on(self, device: torch.device) -> dict[str, torch.Tensor]:
        if device not in self._tensors:
            self._tensors[device] = {
                k: torch.from_numpy(v).to(device) for k, v in self.arrays.items()
            }
        return self._tensors[device]

    def raw(self, x: torch.Tensor) -> torch.Tensor:
        """features [N, F] -> [N, 4]: q10, q50, q90 (log1p tokens, ordered), logit P(cap)."""
        w = self._on(x.device)
        h = (x.float() - w["mean"]) / w["std"]
        layer = 0
        while f"w{layer + 1}" in w:  # hidden layers
            h = torch.nn.functional.gelu(h @ w[f"w{layer}"] + w[f"b{layer}"])
            layer += 1
        y = h @ w[f"w{layer}"] + w[f"b{layer}"]  # [N, 4]: q50, log gap low, log gap high, logit
        sp = torch.nn.functional.softplus
        q50 = y[:, 0]
        return torch.stack([q50 - sp(y[:, 1]), q50, q50 + sp(y[:, 2]), y[:, 3]], dim=1)

    def forecasts(
        self, x: torch.Tensor, generated: list[int], left: list[int]
    ) -> list[RemainingForecast]:
        """Forecasts for features [N, F]; quantiles in tokens, clipped to the tokens left."""
        out = self.raw(x).cpu().numpy().astype(np.float64)
        result = []
        for row, g, n_left in zip(out, generated, left):
            q = np.clip(np.expm1(row[:3]), 1.0, max(1.0, n_left))
            p = 1.0 / (1.0 + math.exp(-float(np.clip(row[3], -30, 30))))
            result.append(RemainingForecast(g, float(q[0]), float(q[1]), float(q[2]), p))
        return result


class ProbeBank:
    """The probes of one model, by (cap, regime); a request uses its regime's probe of the
    nearest cap (at or above its max_tokens when there is one)."""

    def __init__(self, probes: list[Probe]) -> None:
        self.probes = probes

    @classmethod
    def for_model(cls, model: str, root: Path = PROBES_DIR) -> ProbeBank | None:
        paths = sorted((root / model).glob("cap*-t*.npz"))
        if not paths:
            log.info("no remaining-length probe for %s under %s: no forecasts", model, root)
            return None
        bank = cls([Probe.load(p) for p in paths])
        log.info("remaining-length probes for %s: %s", model, [p.name for p in paths])
        return bank

    def pick(self, max_tokens: int, temperature: float) -> Probe | None:
        want = "t0" if temperature <= 0 else "t1"
        mine = [p for p in self.probes if p.regime == want]
        if not mine:
            return None
        return min(mine, key=lambda p: (p.cap < max_tokens, abs(p.cap - max_tokens)))


class ProbeHook:
    """The engine's per-step part: rolling statistics of every sampled request, features at
    the checkpoints, one batched probe call per probe. `record` keeps the feature vectors in
    `StepOutput.probe_features` (calibration); `bank` None = features only."""

    def __init__(
        self, every: int, bank: ProbeBank | None, record: bool, eos_ids: list[int]
    ) -> None:
        self.every, self.bank, self.record, self.eos_ids = every, bank, record, list(eos_ids)
        self.default_cap = bank.probes[0].cap if bank else 0
        self.states: dict[str, ProbeState] = {}
        self._work: torch.Tensor | None = None  # token_stats' buffer, grown to the batch

    def due(self, states: list) -> bool:
        """Whether any of these sampled requests (RequestState) is at a checkpoint."""
        return any(st.num_output_tokens % self.every == 0 for st in states)

    def observe(
        self,
        states: list,
        hidden: torch.Tensor | None,
        logits: torch.Tensor,
        out: StepOutput,
        logp: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """After the forward pass, before sampling: states[i] (RequestState) owns row i of
        hidden [S, H] (final norm) and logits [S, V]; fills out.forecasts / probe_features.
        hidden None: statistics only (a step with no checkpoint). Returns the rows'
        probabilities (valid until the next step: they live in a reused buffer)."""
        if logp is not None and (self._work is None or self._work.numel() < logp.numel()):
            self._work = torch.empty(logp.numel(), dtype=logp.dtype, device=logp.device)
        entropy, p_eos, probs = token_stats(logits, self.eos_ids, logp, self._work)
        ent, pe = entropy.tolist(), p_eos.tolist()
        rows, scalars, meta = [], [], []
        for i, st in enumerate(states):
            ps = self.states.get(st.request_id)
            if ps is None:
                ps = self.states[st.request_id] = ProbeState(max(1, self.every))
            ps.push(ent[i], pe[i])
            g = st.num_output_tokens
            if g % self.every:
                continue
            cap = st.max_tokens or self.default_cap or (g + 1)
            output = st.token_ids[len(st.token_ids) - g :] if g else []
            prompt_len = len(st.token_ids) - g
            rows.append(i)
            scalars.append(scalar_features(ps, g, cap - g, prompt_len, output))
            meta.append((st, g, cap - g))
        if rows and hidden is not None:
            x = torch.cat(
                [
                    torch.tensor(scalars, dtype=torch.float32, device=hidden.device),
                    hidden[rows].float(),
                ],
                dim=1,
            )
            self._emit(x, meta, out)
        return probs

    def _emit(self, x: torch.Tensor, meta: list, out: StepOutput) -> None:
        if self.record:
            host = x.cpu().numpy()
            for j, (st, g, _) in enumerate(meta):
                out.probe_features[st.request_id] = (g, host[j])
        if self.bank is None:
            return
        groups: dict[int, tuple[Probe, list[int]]] = {}
        for j, (st, _g, _left) in enumerate(meta):
            probe = self.bank.pick(st.max_tokens or self.default_cap, st.sampling.temperature)
            if probe is not None:
                groups.setdefault(id(probe), (probe, []))[1].append(j)
        for probe, idx in groups.values():
            made = probe.forecasts(x[idx], [meta[j][1] for j in idx], [meta[j][2] for j in idx])
            for j, fc in zip(idx, made):
                out.forecasts[meta[j][0].request_id] = fc

    def forget(self, request_ids: list[str]) -> None:
        """Freed requests (a recompute starts a fresh window)."""
        for rid in request_ids:
            self.states.pop(rid, None)

    def prune(self, live: dict) -> None:
        """Drop the states of requests the engine no longer holds."""
        if len(self.states) > 2 * len(live) + 64:
            self.states = {r: s for r, s in self.states.items() if r in live}


def make_hook(
    every: int, model: str, record: bool, eos_ids: list[int], root: Path = PROBES_DIR
) -> ProbeHook | None:
    """The engine's hook: None when forecasts are off (every 0) or there is nothing to do
    (no probe for the model and no feature recording)."""
    if every <= 0:
        return None
    bank = ProbeBank.for_model(model, root)
    if bank is None and not record:
        return None
    return ProbeHook(every, bank, record, eos_ids)

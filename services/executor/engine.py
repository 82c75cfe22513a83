"""The in-process executor: applies one Step delta, runs one forward pass, samples.

    engine = Engine(weights_dir("smollm2-135m-instruct", data_dir), num_device_blocks=256)
    out = engine.step(SchedulerOutput(new_requests=[NewRequestData("a", ids)],
                                block_tables={"a": ([0, 1], False)},
                                num_scheduled_tokens={"a": len(ids)}))
    out.sampled["a"]  # (token id, logprob)

Order inside a step (proto/executor.proto): swap_out, swap_in, free, new requests and block
tables, one forward pass over the packed batch, sampling. A malformed step raises ValueError
before anything changes.
"""

from __future__ import annotations

import functools
import json
import os
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from services.common.arith import ceil_div
from services.common.step import SchedulerOutput
from services.executor.attention_backends import make_attention
from services.executor.config import resolve_device, resolve_dtype
from services.executor.cuda_graphs import Capture
from services.executor.cuda_runtime import DeviceRuntime, RuntimeOptions, uses_graphs, uses_packed
from services.executor.kv_pool import bytes_per_block, make_pool
from services.executor.memory import (
    MemoryPlan,
    profile_activation_peak,
    profile_runs,
    release_unused_memory,
    size_kv_pool,
    staging_reserve,
)
from services.executor.messages import RequestState, StepOutput, StepTimings
from services.executor.probe import make_hook
from services.executor.prompt_logprobs import compute_prompt_logprobs, prompt_rows
from services.executor.ragged_batch import StepBatch, TokenRun, build_batch
from services.executor.runner import load_runner, resolve_quantization
from services.executor.sampler import sample, sample_batch, top_alternatives, unpack_samples
from services.executor.step_plan import StepBook, StepPlan
from services.executor.swap import SwapManager

if TYPE_CHECKING:
    from services.common.guided import GuideCompiler
    from services.common.settings import ExecutorSettings
    from services.executor.kv_pool import KVCache

GIB = 1 << 30


def default_num_threads() -> int:
    """Intra-op threads when ALISE_NUM_THREADS is 0: every core but one, which the gateway,
    scheduler and predictor need. On a contended core torch's thread barriers stall small
    ops badly (measured here: a decode step 3.5x slower with 2 threads than 1 on 2 busy cores)."""
    return max(1, min(torch.get_num_threads(), (os.cpu_count() or 1) - 1))


class Engine:
    def __init__(
        self,
        model_dir: str | Path,
        *,
        model_name: str | None = None,
        device: str = "auto",
        dtype: str = "auto",
        kv_dtype: str = "auto",
        block_size: int = 16,
        num_device_blocks: int | None = None,
        num_host_blocks: int | None = None,
        kv_memory_gb: float = 1.0,
        swap_memory_gb: float = 1.0,
        swap_compress: bool = False,
        attention_backend: str = "auto",
        max_model_len: int = 0,
        profile_path: str | Path | None = None,
        runtime: RuntimeOptions | None = None,
        load_format: str = "auto",
        quantization: str = "none",
        deterministic: bool = False,
        predict_every: int = 16,
        record_features: bool = False,
    ) -> None:
        self.device = resolve_device(device)
        self.dtype = resolve_dtype(dtype, self.device)
        self.model_dir, self.model_name = Path(model_dir), model_name or Path(model_dir).name
        self.options = runtime or RuntimeOptions()
        self.quantization = resolve_quantization(
            quantization, self.model_dir, self.device, deterministic
        )
        self.spec, self.runner = load_runner(
            self.model_dir, self.device, self.dtype, load_format, self.quantization
        )
        self.kv_dtype, self.block_size = kv_dtype, block_size
        self.max_model_len = self._max_len(max_model_len)
        self.attn = make_attention(self.spec, attention_backend, self.device, self.dtype)
        self.deterministic = deterministic
        if deterministic:
            self._make_deterministic(swap_compress)
        # padded query-key pairs one more attention group must save (batch.split_by_context),
        # set by the backend; None: one group per kind (decodes, prefill chunks)
        self.attention_group_cost: int | None = self.attn.group_cost
        packed = uses_packed(self.options, self.device, self.attn.name, kv_dtype)
        graphs = uses_graphs(self.options, packed)
        per_block = bytes_per_block(self.spec, kv_dtype, block_size, self.dtype)
        self.memory: MemoryPlan | None = None  # CUDA pools sized by gpu_memory_utilization
        if num_device_blocks is None:
            num_device_blocks = self._size_pool(per_block, kv_memory_gb, graphs)
        if num_device_blocks < 1:
            raise ValueError(f"kv memory budget holds no block ({per_block} bytes each)")
        self.pool_blocks = num_device_blocks  # the scheduler's; a graph padding block follows
        self.cache = self._make_pool(num_device_blocks + graphs)
        self.swap = self._make_swap(num_host_blocks, swap_memory_gb, swap_compress)
        self.runtime = self._make_runtime(packed, graphs)  # None: the CPU path
        self.profile_path = Path(profile_path) if profile_path else None
        self.instance_id = uuid.uuid4().hex
        self._init_state(predict_every, record_features)

    def _make_swap(self, blocks: int | None, memory_gb: float, compress: bool) -> SwapManager:
        """The host swap pool: `blocks`, else as many as `memory_gb` holds."""
        if blocks is None:
            blocks = int(memory_gb * GIB // SwapManager.host_block_bytes(self.cache, compress))
        return SwapManager(self.cache, blocks, compress)

    def _init_state(self, predict_every: int, record_features: bool) -> None:
        """The request book and its views, the step lock, caches and the remaining-length
        probe."""
        self.book = StepBook(
            self.pool_blocks,
            self.swap.num_host_blocks,
            self.block_size,
            self.max_model_len,
            self.spec.vocab_size,
        )
        self.requests: dict[str, RequestState] = self.book.requests
        self.owners = self.book.owners
        self._lock = threading.RLock()
        self._tables: dict[str, tuple[list[int], np.ndarray]] = {}  # _block_array's cache
        self.probe = make_hook(
            predict_every, self.model_name, record_features, list(self.spec.eos_token_ids)
        )

    def _make_deterministic(self, swap_compress: bool) -> None:
        """Batch-invariant products and attention (batch_invariant.py), or ValueError."""
        from services.executor import batch_invariant

        batch_invariant.check_supported(
            self.device, self.attn.name, self.kv_dtype, swap_compress, self.runner
        )
        batch_invariant.make_deterministic(self.runner, self.attn, self.device.type == "cuda")

    def _make_runtime(self, packed: bool, graphs: bool) -> DeviceRuntime | None:
        """The CUDA step path (also the packed path off CUDA, under Triton's interpreter);
        the padding block of graph batches is the one after the scheduler's blocks."""
        if self.device.type != "cuda" and not packed:
            return None
        if packed and self.options.graph_split_kv and self.attn.name == "triton":
            # graphs on or off, a decode batch splits by its bucket: the same numerics
            self.attn.bucket_split_len = self.max_model_len  # type: ignore[union-attr]
        return DeviceRuntime(
            self.runner,
            self.cache,
            self.attn,
            self.block_size,
            self.max_model_len,
            self.options.graph_max_batch,
            packed,
            self.pool_blocks if graphs else None,
        )

    def _size_pool(self, per_block: int, kv_memory_gb: float, graphs: bool) -> int:
        """Device blocks: on CUDA with gpu_memory_utilization, what a profiled forward pass
        at the largest step leaves under it (memory.py); otherwise kv_memory_gb's worth."""
        util = self.options.gpu_memory_utilization
        if self.device.type != "cuda" or not util:
            return int(kv_memory_gb * GIB // per_block)
        opts, bs = self.options, self.block_size
        lengths = profile_runs(opts.max_num_batched_tokens, opts.max_num_seqs, self.max_model_len)
        reserve = staging_reserve(self.kv_dtype, self.spec, bs, self.dtype, opts.max_num_seqs)
        reserve += per_block if graphs else 0  # the padding block

        def peak() -> int:
            release_unused_memory()  # the unfused projections, before anything is measured
            blocks = sum(ceil_div(n, bs) for n in lengths)
            scratch = make_pool(
                self.spec, self.kv_dtype, blocks, bs, self.dtype, self.device, len(lengths)
            )
            return profile_activation_peak(
                self.runner, scratch, self.attn, lengths, bs, self.spec.vocab_size
            )

        self.memory = size_kv_pool(
            peak, lambda: torch.cuda.mem_get_info(self.device), reserve, util, per_block, graphs
        )
        return self.memory.num_blocks

    def _make_pool(self, num_blocks: int) -> KVCache:
        if self.device.type != "cuda":
            return make_pool(
                self.spec, self.kv_dtype, num_blocks, self.block_size, self.dtype, self.device
            )
        return make_pool(  # INT8 staging for max_num_seqs requests allocated up front
            self.spec,
            self.kv_dtype,
            num_blocks,
            self.block_size,
            self.dtype,
            self.device,
            self.options.max_num_seqs,
        )

    @classmethod
    def from_settings(cls, settings: ExecutorSettings) -> Engine:
        """From an ExecutorSettings: loads `settings.model` (GGUF is dequantized once)."""
        from services.common.models import served_model_id, weights_dir

        torch.set_num_threads(settings.num_threads or default_num_threads())
        return cls(
            weights_dir(settings.model, settings.data_dir),
            model_name=served_model_id(settings.model),
            device=settings.device,
            dtype=settings.dtype,
            kv_dtype=settings.kv_dtype,
            block_size=settings.block_size,
            kv_memory_gb=settings.kv_memory_gb,
            swap_memory_gb=settings.swap_memory_gb,
            swap_compress=settings.swap_compress,
            attention_backend=settings.attention_backend,
            max_model_len=settings.max_model_len,
            profile_path=settings.profile_path,
            runtime=runtime_options(settings),
            load_format=settings.load_format,
            quantization=settings.quantization,
            deterministic=settings.deterministic,
            predict_every=settings.predict_every,
        )

    def _max_len(self, requested: int) -> int:
        if requested and requested > self.spec.max_model_len:
            raise ValueError(
                f"max_model_len {requested} exceeds the model's {self.spec.max_model_len}"
            )
        return requested or self.spec.max_model_len

    # -- description ----------------------------------------------------------------------
    @property
    def num_device_blocks(self) -> int:
        return self.pool_blocks

    @property
    def num_host_blocks(self) -> int:
        return self.swap.num_host_blocks

    def profile_json(self) -> str:
        """The cost-model profile Describe reports: `profile_path` when it exists, else a
        bundled profile of the same device type, model, dtype and weight format, else none
        ("")."""
        if self.profile_path and self.profile_path.exists():
            return self.profile_path.read_text()
        dtype = str(self.dtype).removeprefix("torch.")
        return bundled_profile(self.device.type, self.model_name, dtype, self.weight_format)

    @property
    def weight_format(self) -> str:
        """How the weights are served: fp8 (an FP8 checkpoint, or rounded through FP8 by
        ALISE_QUANTIZATION=fp8), int4 / int8 (packed: wquant.py), else the model dtype."""
        if self.quantization == "fp8" or self.spec.quant_method:
            return "fp8"
        if self.quantization in ("int4", "int8"):
            return self.quantization
        return str(self.dtype).removeprefix("torch.")

    def describe(self) -> dict:
        return {
            "model": self.model_name,
            "architecture": self.spec.arch,
            "dtype": str(self.dtype).removeprefix("torch."),
            "weights": self.weight_format,
            "kv_dtype": self.kv_dtype,
            "max_model_len": self.max_model_len,
            "block_size": self.block_size,
            "bytes_per_block": self.cache.bytes_per_block,
            "num_device_blocks": self.num_device_blocks,
            "num_host_blocks": self.num_host_blocks,
            "device": str(self.device),
            "vocab_size": self.spec.vocab_size,
            "eos_token_ids": self.spec.eos_token_ids,
            "profile_json": self.profile_json(),
            "instance_id": self.instance_id,
            "attention_backend": self.attn.name,
            "deterministic": self.deterministic,
            "gpu_memory": self.memory.as_dict() if self.memory else None,
            "cuda_graph_buckets": sorted(self.runtime.graphs.replays) if self.runtime else [],
        }

    @functools.cached_property
    def guides(self) -> GuideCompiler:
        """Structured outputs' compiler for this model's vocabulary (built on first use)."""
        from services.common.guided import GuideCompiler

        return GuideCompiler.from_dir(self.model_dir, vocab_size=self.spec.vocab_size)

    # -- one step -------------------------------------------------------------------------
    def step(self, step: SchedulerOutput, all_logits: bool = False) -> StepOutput:
        """Apply the delta, run the forward pass, sample. all_logits: also return the fp32
        logits of every computed position per request (tests, perplexity)."""
        start = time.perf_counter()
        with self._lock:
            plan = self.book.plan(step)
            self._apply(step, plan)
            out = self._run(step.step_id, plan, all_logits)
        out.timings.total_s = time.perf_counter() - start
        return out

    def _apply(self, step: SchedulerOutput, plan: StepPlan) -> None:
        self.swap.swap(list(step.swap_out), list(step.swap_in))

        def open_request(state: RequestState) -> None:
            state.staging_slot = self.cache.open_request(state.request_id)
            if state.sampling.guide_kind:  # a recompute replays the output into the matcher
                output = state.token_ids[len(state.token_ids) - state.num_output_tokens :]
                sp = state.sampling
                state.matcher = self.guides.matcher(sp.guide_kind, sp.guide_spec, output)

        self.book.apply(plan, self.cache.close_request, open_request)
        if self.probe is not None and step.free_request_ids:
            self.probe.forget(list(step.free_request_ids))

    def _block_array(self, st: RequestState) -> np.ndarray | None:
        """st.block_table as an int64 array, converted once per table: tables are replaced
        (apply_plan), never edited in place, so the cached copy is current while it holds the
        same list object (None: swapped out). Entries of finished requests are dropped once
        they outnumber the live ones."""
        table = st.block_table
        if table is None:
            return None
        cached = self._tables.get(st.request_id)
        if cached is None or cached[0] is not table:
            if len(self._tables) > 2 * len(self.requests) + 64:
                self._tables = {r: v for r, v in self._tables.items() if r in self.requests}
            cached = self._tables[st.request_id] = (table, np.asarray(table, dtype=np.int64))
        return cached[1]

    def _runs(self, plan: StepPlan) -> list[TokenRun]:
        runs = []
        for rid, n in plan.scheduled:
            st = self.requests[rid]
            end = st.num_computed + n
            runs.append(
                TokenRun(
                    rid,
                    st.token_ids[st.num_computed : end],
                    st.num_computed,
                    st.block_table,
                    st.staging_slot,
                    end == len(st.token_ids),
                    self._block_array(st),
                )
            )
        return runs

    def _run(self, step_id: int, plan: StepPlan, all_logits: bool) -> StepOutput:
        timings, runs = StepTimings(), self._runs(plan)
        if not runs:
            return StepOutput(step_id, {}, timings, logits={} if all_logits else None)
        if self.swap.pending:
            timings.swap_wait_s = self.swap.wait_for({b for r in runs for b in r.block_table})
        if self.runtime is not None and not self._needs_hidden(runs):
            return self._run_device(step_id, runs, all_logits, timings, self.runtime)
        t0 = time.perf_counter()
        batch = build_batch(
            runs, self.block_size, self.device, self.attention_group_cost, self.attn.split_decodes
        )
        if all_logits:
            batch.logits_rows = torch.arange(batch.num_tokens, device=self.device)
        self.cache.prepare(batch)
        self.attn.prepare(batch)
        wanted = prompt_rows(batch, self.requests)
        with torch.inference_mode():
            hidden = self.runner.forward(batch, self.cache, self.attn)  # [T, hidden]
            logits = self.runner.logits(hidden[batch.logits_rows])  # [S, V]
            prompt = compute_prompt_logprobs(hidden, self.runner.logits, wanted) if wanted else {}
        t1 = time.perf_counter()
        timings.forward_s = t1 - t0
        out = StepOutput(step_id, {}, timings, prompt=prompt)
        self._count(out, batch)
        if all_logits:
            out.logits = self._split_logits(batch, logits)
            logits = self._sampled_rows(batch, logits)
            hidden = self._sampled_rows(batch, hidden)
        else:
            hidden = hidden[batch.logits_rows]
        self._sample(batch, logits, out, *self._observe(batch, hidden, logits, out))
        timings.sample_s = time.perf_counter() - t1
        self._advance(batch)
        return out

    def _run_device(
        self,
        step_id: int,
        runs: list[TokenRun],
        all_logits: bool,
        timings: StepTimings,
        rt: DeviceRuntime,
    ) -> StepOutput:
        """The CUDA path (cuda_runtime.py): everything enqueued, then one copy back and one
        wait for the step's last event."""
        rt.clock.mark(0)
        batch, logits = rt.forward(runs, all_logits, self.attention_group_cost)
        rt.clock.mark(1)
        out = StepOutput(step_id, {}, timings)
        self._count(out, batch)
        if all_logits:
            out.logits = self._split_logits(batch, logits)
            logits = self._sampled_rows(batch, logits)
        states = [self.requests[rid] for rid in batch.sample_ids]
        params = [s.sampling for s in states]
        packed = None
        if states:
            with torch.inference_mode():  # the logits may be a graph's (inference) output
                if self.probe is not None:  # statistics only: no checkpoint in this step
                    self.probe.observe(states, None, logits, out)
                self._mask_guided(states, logits)
                packed = sample_batch(
                    logits,
                    params,
                    [s.num_output_tokens for s in states],
                    [s.token_ids for s in states],
                    rt.generator,
                )
        rows = rt.fetch(packed)
        timings.forward_s, timings.sample_s = rt.clock.times()
        if states:
            self._accept(states, *unpack_samples(rows, params), out)
        self._advance(batch)
        return out

    def _needs_hidden(self, runs: list[TokenRun]) -> bool:
        """A step whose hidden rows are read (prompt logprobs, a probe checkpoint) takes the
        classic path, which keeps them (the CUDA graphs return logits only)."""
        if self.probe is not None and self.probe.due(
            [self.requests[r.request_id] for r in runs if r.sample]
        ):
            return True
        return self._reads_prompt_logits(runs)

    def _reads_prompt_logits(self, runs: list[TokenRun]) -> bool:
        """A run of a request asking prompt_logprobs: such a step takes the classic path,
        which keeps every row's hidden state."""
        return any(self.requests[r.request_id].sampling.prompt_logprobs is not None for r in runs)

    def _advance(self, batch: StepBatch) -> None:
        for r in batch.runs:
            self.requests[r.request_id].num_computed += r.q_len

    @staticmethod
    def _sampled_rows(batch: StepBatch, logits: torch.Tensor) -> torch.Tensor:
        """The rows of all-position logits that are sampled (each sampled run's last)."""
        sample_rows = [i for i, r in enumerate(batch.runs) if r.sample]
        ends = torch.tensor([r.q_len for r in batch.runs]).cumsum(0) - 1
        return logits[ends[sample_rows]] if sample_rows else logits[:0]

    @staticmethod
    def _split_logits(batch: StepBatch, logits: torch.Tensor) -> dict[str, torch.Tensor]:
        parts = logits.split([r.q_len for r in batch.runs])
        return {r.request_id: p for r, p in zip(batch.runs, parts)}

    def _count(self, out: StepOutput, batch: StepBatch) -> None:
        for r in batch.runs:
            if r.q_len == 1 and r.sample:
                out.num_decode_tokens += 1
            else:
                out.num_prefill_tokens += r.q_len

    def _observe(
        self, batch: StepBatch, hidden: torch.Tensor, logits: torch.Tensor, out: StepOutput
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The probe's part of a step (probe.py); returns the rows' log_softmax and
        probabilities it computed, which the sampler reuses (None, None: no probe)."""
        if self.probe is None or not batch.sample_ids:
            return None, None
        with torch.inference_mode():
            logp = torch.log_softmax(logits, dim=-1)
            states = [self.requests[r] for r in batch.sample_ids]
            probs = self.probe.observe(states, hidden, logits, out, logp)
        self.probe.prune(self.requests)
        return logp, probs

    def _sample(
        self,
        batch: StepBatch,
        logits: torch.Tensor,
        out: StepOutput,
        logp: torch.Tensor | None = None,
        probs: torch.Tensor | None = None,
    ) -> None:
        if not batch.sample_ids:
            return
        states = [self.requests[rid] for rid in batch.sample_ids]
        if self._mask_guided(states, logits):
            logp = probs = None  # the logprobs are the masked distribution's
        tokens, logprobs = sample(
            logits,
            [s.sampling for s in states],
            [s.num_output_tokens for s in states],
            [s.token_ids for s in states],
            logp,
            probs,
        )
        tops = top_alternatives(logits, [s.sampling for s in states])
        self._accept(states, tokens, logprobs, tops, out)

    def _mask_guided(self, states: list[RequestState], logits: torch.Tensor) -> bool:
        """Mask the guided rows' logits in place; whether any row was."""
        guided = [i for i, s in enumerate(states) if s.matcher and not s.matcher.is_terminated()]
        if guided:
            self.guides.mask(logits, guided, [states[i].matcher for i in guided])
        return bool(guided)

    @staticmethod
    def _accept(
        states: list[RequestState],
        tokens: list[int],
        logprobs: list[float],
        tops: list[list[tuple[int, float]]],
        out: StepOutput,
    ) -> None:
        for st, tok in zip(states, tokens):
            if st.matcher and not st.matcher.is_terminated():
                st.matcher.accept_token(tok)
        for st, tok, lp, top in zip(states, tokens, logprobs, tops):
            st.token_ids.append(tok)
            st.num_output_tokens += 1
            out.sampled[st.request_id] = (tok, lp)
            if top:
                out.top[st.request_id] = top

    def warm_up(self, capture: Capture | None = None) -> dict:
        """Compile every kernel variant and capture the CUDA graphs before serving
        (warmup.py); `capture` replaces the real CUDA-graph capture (tests off CUDA)."""
        from services.executor.warmup import warm_up_engine

        return warm_up_engine(self, capture)

    @contextmanager
    def exclusive(self) -> Iterator[Engine]:
        """Hold off other threads' steps (the profiler's many steps run as one unit)."""
        with self._lock:
            yield self

    def close(self) -> None:
        self.swap.close()

    def profile(self, quick: bool = True) -> dict:
        from services.executor.profiler import profile_engine

        return profile_engine(self, quick=quick)

    def save_profile(self, profile: dict) -> None:
        if self.profile_path:
            from services.executor.profiler import write_profile

            write_profile(profile, self.profile_path)


def runtime_options(settings: ExecutorSettings) -> RuntimeOptions:
    """The CUDA knobs of ExecutorSettings. An explicitly set ALISE_KV_MEMORY_GB sizes the pool
    instead of ALISE_GPU_MEMORY_UTILIZATION."""
    explicit_pool = "kv_memory_gb" in settings.model_fields_set
    return RuntimeOptions(
        gpu_memory_utilization=None if explicit_pool else settings.gpu_memory_utilization,
        cuda_graphs=settings.cuda_graphs,
        graph_max_batch=settings.cuda_graph_max_batch,
        max_num_batched_tokens=settings.max_num_batched_tokens,
        max_num_seqs=settings.max_num_seqs,
    )


BUNDLED_PROFILES = Path(__file__).parent / "profiles"


def bundled_profile_path(
    device: str, model: str, dtype: str, weights: str | None = None
) -> Path | None:
    """The profile shipped in services/executor/profiles/ measured on `device` (cpu | cuda)
    for `model` in `dtype` with its weights served as `weights` (int4, int8, fp8; default: in
    the dtype), or None when none matches."""
    want = (device, model, dtype, weights or dtype)
    for path in sorted(BUNDLED_PROFILES.glob("*.json")):
        meta = json.loads(path.read_text())
        got = (meta.get("device"), meta.get("model"), meta.get("dtype"))
        if (*got, meta.get("weights", meta.get("dtype"))) == want:
            return path
    return None


@functools.lru_cache(maxsize=8)
def bundled_profile(device: str, model: str, dtype: str, weights: str | None = None) -> str:
    """JSON text of `bundled_profile_path`'s profile, or "" when none matches."""
    path = bundled_profile_path(device, model, dtype, weights)
    return path.read_text() if path is not None else ""

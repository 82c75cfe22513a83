"""Configuration for every service, read from `ALISE_*` environment variables.

One settings class per service. Every field name is unique across classes except those
shared on purpose (same name = same variable = same meaning, e.g. `redis_url`), so the whole
configuration is one flat namespace of `ALISE_<FIELD>` variables. Lists accept either JSON or
a comma-separated string (`ALISE_API_KEYS=key1,key2`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

from pydantic import BeforeValidator, Field, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict


def _split_list(value: object) -> object:
    if isinstance(value, str):
        text = value.strip()
        if text.startswith("["):
            import json

            return json.loads(text)
        return [part.strip() for part in text.split(",") if part.strip()]
    return value


StrList = Annotated[list[str], NoDecode, BeforeValidator(_split_list)]

DEFAULT_DATA_DIR = Path.home() / ".cache" / "alise"


class CommonSettings(BaseSettings):
    """Settings every service reads."""

    model_config = SettingsConfigDict(env_prefix="ALISE_", extra="ignore", validate_default=True)

    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = Field(
        "INFO", description="Log level of every service."
    )
    log_format: Literal["json", "text"] = Field(
        "text", description="`json`: one JSON object per line; `text`: human-readable."
    )
    data_dir: Path = Field(
        DEFAULT_DATA_DIR, description="Where caches, the embedded stores and run logs live."
    )
    model: str = Field(
        "smollm2-135m-instruct",
        description="Served model: `smollm2-135m-instruct` (bundled GGUF), a local Hugging "
        "Face directory, or a .gguf file.",
    )
    metrics_port: int = Field(
        0, ge=0, le=65535, description="Prometheus HTTP port of a gRPC service (0 = none)."
    )
    internal_token: str = Field(
        "",
        description="Shared secret every internal gRPC call carries and every gRPC server "
        "but health checks (services/common/internal_auth.py); empty = no check. `alise serve` "
        "generates one; compose and Kubernetes take it from .env / a Secret.",
    )
    redis_password: str = Field(
        "",
        description="Password for every Redis URL that carries none (compose and Kubernetes "
        "keep it in .env / a Secret, beside redis-server's requirepass); empty = none.",
    )


class RedisSettings(CommonSettings):
    redis_url: str | None = Field(
        None, description="Redis server URL; unset = start the embedded redis-server."
    )


class ExecutorSettings(CommonSettings):
    executor_host: str = Field("127.0.0.1", description="Executor gRPC bind address.")
    executor_port: int = Field(50061, ge=0, le=65535, description="Executor gRPC port.")
    registry_url: str | None = Field(
        None,
        description="Redis URL to register this executor in, so schedulers find it without "
        "a restart (unset = not registered; schedulers then need it in ALISE_EXECUTORS).",
    )
    advertise_address: str = Field(
        "",
        description="host:port schedulers reach this executor at (default: bind host, or the "
        "host name when bound to every interface, and the bound port).",
    )
    redis_namespace: str = Field(
        "alise", min_length=1, description="Prefix of the registry key in Redis."
    )
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="auto = cuda if present.")
    dtype: Literal["auto", "fp32", "bf16", "fp16"] = Field(
        "auto",
        description="Weight/activation dtype (auto = bf16 on GPU and on CPUs with native bf16, "
        "avx512_bf16 or amx_bf16; fp32 on other CPUs).",
    )
    kv_dtype: Literal["auto", "int8"] = Field("auto", description="KV cache dtype.")
    load_format: Literal["auto", "dummy"] = Field(
        "auto",
        description="auto = the model's safetensors weights; dummy = random weights of its "
        "config.json's shapes (a config-only directory or a shape preset such as llama-3-8b).",
    )
    quantization: Literal["auto", "none", "fp8", "int4", "int8"] = Field(
        "auto",
        description="Weight format. auto: on CPU a GGUF model keeps its file's bit width (4-bit "
        "layers as INT4 with an INT8 LM head, 8-bit as INT8), everything else as stored; "
        "int4 / int8: weight-only quantization at load (CPU); fp8: round the linear weights "
        "of a full-precision checkpoint through FP8 (e4m3, per-channel scales); none: as "
        "stored. FP8 checkpoints are read whatever this says (docs/models.md).",
    )
    block_size: int = Field(16, ge=1, le=1024, description="Tokens per KV block.")
    kv_memory_gb: float = Field(1.0, gt=0, description="Device memory for the KV pool (GiB).")
    swap_memory_gb: float = Field(1.0, ge=0, description="Host memory for the swap pool (GiB).")
    swap_compress: bool = Field(
        False, description="Store swapped-out full-precision KV blocks as INT8."
    )
    attention_backend: Literal["auto", "torch", "cpu", "triton"] = Field(
        "auto",
        description="auto = triton on CUDA; on CPU the compiled decode kernel (cpu) where it "
        "builds and the head dim is 64 or 128, else torch.",
    )
    deterministic: bool = Field(
        False,
        description="Batch-invariant numerics: greedy output independent of batch composition, "
        "chunking and preemption (CPU attention kernels, full-precision KV; see "
        "docs/executor.md for its cost).",
    )
    max_model_len: int = Field(0, ge=0, description="0 = the model's own maximum.")
    num_threads: int = Field(
        0, ge=0, description="torch intra-op threads (0 = all cores but one, at least 1)."
    )
    profile_path: Path | None = Field(
        None, description="Cost-model profile JSON reported by Describe."
    )
    predict_every: int = Field(
        16,
        ge=0,
        description="Remaining-length probe: forecast at the end of each prefill and every N "
        "output tokens (services/executor/probe.py; 0 = off; no probe for the model = off).",
    )
    gpu_memory_utilization: float = Field(
        0.9,
        gt=0,
        le=1,
        description="CUDA: fraction of the GPU's memory this executor may use; the KV pool "
        "takes what weights, activations and reserves leave of it (vLLM's meaning). "
        "An explicitly set ALISE_KV_MEMORY_GB wins.",
    )
    cuda_graphs: bool = Field(
        True, description="CUDA: capture decode-only steps as CUDA graphs at start-up."
    )
    cuda_graph_max_batch: int = Field(
        512,
        ge=0,
        le=4096,
        description="CUDA: largest decode batch captured (buckets 1, 2, 4, ... up to it).",
    )
    max_num_batched_tokens: int = Field(
        2048,
        ge=1,
        description="CUDA: the step size (tokens) whose activations the memory profile reserves.",
    )
    max_num_seqs: int = Field(
        512,
        ge=1,
        description="CUDA: the most requests in one step the memory profile reserves for "
        "(logits rows, INT8 staging buffers).",
    )


class PredictorSettings(CommonSettings):
    predictor_host: str = Field("127.0.0.1", description="Predictor gRPC bind address.")
    predictor_port: int = Field(50052, ge=0, le=65535, description="Predictor gRPC port.")
    qdrant_url: str | None = Field(
        None, description="Qdrant server URL; unset = embedded store under data_dir."
    )
    qdrant_api_key: str | None = Field(None, description="Qdrant API key (server mode).")
    embedder: str = Field(
        "all-minilm-l6-v2",
        description="Sentence-transformers model: `all-minilm-l6-v2` (bundled) or a directory; "
        "`none` = prior-only predictor (no embedder, store, MLP or seed: every prediction is the "
        "prior, observations are ignored) for hosts without the embedder package.",
    )
    predictor_top_k: int = Field(
        2, ge=1, le=256, description="Neighbours searched (k; chosen on a train-split holdout)."
    )
    predictor_threshold: float = Field(
        0.9,
        ge=-1.0,
        le=1.0,
        description="Similarity threshold s0 for retrieval (chosen on a train-split holdout).",
    )
    predictor_mlp_path: Path | None = Field(
        None, description="MLP regressor checkpoint (default under data_dir)."
    )
    predictor_capacity: int = Field(
        200_000, ge=1, description="Maximum points per model collection."
    )
    predictor_merge_similarity: float = Field(
        0.98, ge=0.0, le=1.0, description="Observations this similar merge into a running mean."
    )
    predictor_seed: bool = Field(True, description="Seed an empty store from ShareGPT on start.")
    predictor_store: Literal["edge", "local"] = Field(
        "edge",
        description="Embedded store (no qdrant_url): `edge` = Qdrant Edge (HNSW), "
        "`local` = qdrant-client local mode (brute force).",
    )
    predictor_max_prompt_chars: int = Field(
        100_000, ge=1, description="Prompts longer than this are rejected (INVALID_ARGUMENT)."
    )
    predictor_max_batch: int = Field(
        256, ge=1, description="Most prompts or observations in one Predict/Observe call."
    )
    predictor_embed_tokens: int = Field(
        80,
        ge=16,
        le=512,
        description="Word pieces of each prompt the embedder reads (its "
        "head: 80 keeps a prediction under 20 ms on one core).",
    )
    predictor_quantize: bool = Field(
        True, description="INT8 dynamic quantization of the embedder's Linear layers (CPU)."
    )
    predictor_threads: int = Field(
        1,
        ge=0,
        description="torch threads of the predictor (0 = torch default); 1 keeps "
        "latency steady on a host shared with executors.",
    )
    predictor_models: StrList = Field(
        default_factory=list,
        description="Model ids Predict/Observe accept (empty = the id of the model setting).",
    )
    predictor_trim_s: float = Field(
        60.0,
        ge=0.0,
        description="Seconds between returns of the allocator's free pages to the system "
        "(glibc malloc_trim; 0 = never): without it the predictor's resident memory holds "
        "its peak and creeps up as the allocator's arenas fragment.",
    )


class SchedulerSettings(RedisSettings):
    scheduler_host: str = Field("127.0.0.1", description="Scheduler gRPC bind address.")
    scheduler_port: int = Field(50051, ge=0, le=65535, description="Scheduler gRPC port.")
    executors: StrList = Field(
        default_factory=lambda: ["127.0.0.1:50061"], description="Executor addresses."
    )
    policy: str = Field("hybrid", description="Scheduling policy name.")
    policy_config: str = Field(
        "{}", description="JSON object of policy knobs (see the README's policy table)."
    )
    max_waiting_requests: int = Field(
        4096, ge=1, description="Waiting requests beyond which Generate is refused."
    )
    max_waiting_tokens: int = Field(
        4_000_000, ge=1, description="Waiting prompt tokens beyond which Generate is refused."
    )
    retention_s: float = Field(
        300.0, ge=0, description="How long finished requests stay in Redis after streaming."
    )
    step_timeout_s: float = Field(60.0, gt=0, description="A Step slower than this fails.")
    step_timeout_factor: float = Field(
        10.0,
        gt=1,
        description="A Step slower than this many times its predicted time (cost model, "
        "corrected by how far off it runs) marks the executor down as hung.",
    )
    step_timeout_floor_s: float = Field(
        5.0,
        gt=0,
        description="The hang deadline is never shorter than this (first Steps, busy hosts).",
    )
    step_spin_ms: float = Field(
        0.0,
        ge=0,
        description="Hybrid polling: the executor loop stays awake for the last this "
        "many ms of a Step's expected time (0 = off; pipelined Steps make it unneeded).",
    )
    pipeline_depth: int = Field(
        2,
        ge=1,
        le=2,
        description="Steps in flight per executor: 2 plans and sends the next Step while "
        "one runs (the executor never waits on the scheduler); 1 plans each Step after the "
        "last one's result.",
    )
    executor_grace_s: float = Field(
        30.0, ge=0, description="With no executor up, requests fail after this long."
    )
    step_trace: Path | None = Field(
        None,
        description="Append one JSON line per executed Step (batch shape, cost-model "
        "estimate, executor and round-trip time) to this file; unset = off.",
    )
    health_poll_s: float = Field(
        0.5, gt=0, description="How often a down executor is polled (Describe) to bring it back."
    )
    redis_namespace: str = Field(
        "alise", min_length=1, description="Prefix of every scheduler key in Redis."
    )
    discovery_interval_s: float = Field(
        1.0,
        gt=0,
        description="How often the executor registry in Redis is read: executors that "
        "registered get a loop, those whose registration lapsed are dropped.",
    )
    lease_ttl_s: float = Field(
        3.0,
        gt=0,
        description="Leader lease lifetime: a standby scheduler takes over at most this long "
        "(plus half the renewal interval) after the leader's last renewal.",
    )
    lease_renew_s: float = Field(
        1.0, gt=0, description="How often the leader renews its lease (must be < lease_ttl_s)."
    )
    request_max_failures: int = Field(
        3,
        ge=1,
        description="Executor failures one request survives (recomputed each time) "
        "before it fails with finish_reason `error`.",
    )
    prefix_caching: bool = Field(
        True,
        description="Automatic prefix caching: full KV blocks are shared between requests "
        "whose tokens start alike and kept (LRU) after they end; false = every prompt is "
        "computed from its first token.",
    )
    cache_aware_placement: bool = Field(
        True,
        description="With several executors, place a request where its cached prefix saves "
        "the most predicted work, balanced against load (false: load only).",
    )
    num_shards: int = Field(
        1,
        ge=1,
        description="Scheduler shards: each shard (a leader and its standbys) owns a disjoint "
        "set of the registered executors, assigned through Redis.",
    )
    shard: int = Field(0, ge=0, description="This scheduler's shard, 0 .. num_shards - 1.")

    @model_validator(mode="after")
    def _shard_in_range(self) -> SchedulerSettings:
        if self.shard >= self.num_shards:
            raise ValueError(f"shard {self.shard} is not below num_shards {self.num_shards}")
        return self

    @property
    def state_namespace(self) -> str:
        """Prefix of this shard's own keys (requests, queues, lease); the executor registry
        and the shard assignment stay under `redis_namespace`."""
        if self.num_shards == 1:
            return self.redis_namespace
        return f"{self.redis_namespace}:shard{self.shard}"


class GatewaySettings(CommonSettings):
    gateway_host: str = Field("127.0.0.1", description="Gateway HTTP bind address.")
    gateway_port: int = Field(8000, ge=0, le=65535, description="Gateway HTTP port.")
    scheduler_address: StrList = Field(
        default_factory=lambda: ["127.0.0.1:50051"],
        description="Scheduler gRPC address, or several (comma-separated: a leader and its "
        "standbys, tried in order).",
    )
    scheduler_shards: StrList = Field(
        default_factory=list,
        description="Scheduler shards, comma-separated; each shard is its leader and standbys "
        "joined by `|` (e.g. `s0a:50051|s0b:50051,s1a:50051`). Requests go to the shard with "
        "the least predicted outstanding work per executor. Set, it replaces "
        "scheduler_address.",
    )
    resume_timeout_s: float = Field(
        30.0,
        ge=0,
        description="When a scheduler's stream breaks, keep re-attaching (with backoff) for "
        "this long before the client gets an error.",
    )
    batch_events: bool = Field(
        True,
        description="Receive token events on one Subscribe stream per scheduler, batched (one "
        "message per scheduler commit for all this gateway's requests); false: one Generate "
        "stream message per token.",
    )
    admission_hold_s: float = Field(
        20.0,
        ge=0,
        description="A new request that finds no scheduler able to admit it (the leader "
        "restarting or taking over, Redis unreachable) is held and retried with backoff for "
        "up to this long before the client gets a 503 with Retry-After (0 = refuse at once).",
    )
    admission_hold_max: int = Field(
        256,
        ge=0,
        description="Requests held at once (admission_hold_s); one more gets a 503 with "
        "Retry-After at once.",
    )
    drain_s: float = Field(
        5.0,
        ge=0,
        description="On SIGTERM, let open streams run this long before ending them with an "
        "error event (Kubernetes: at least resume_timeout_s, under the grace period).",
    )
    predictor_addresses: StrList = Field(
        default_factory=lambda: ["127.0.0.1:50052"],
        description="Predictor replicas: host:port list, or one DNS name resolving to many.",
    )
    predictor_timeout_ms: float = Field(
        300.0,
        gt=0,
        description="Give up on a prediction after this long (a CPU predictor "
        "embeds a prompt in ~30-100 ms on a shared 2-core host).",
    )
    api_keys: StrList = Field(
        default_factory=list, description="Accepted API keys; empty = no auth."
    )
    key_max_concurrent: int = Field(
        0, ge=0, description="Concurrent /v1 requests (streams included) per API key; 0 = any."
    )
    key_rate_per_s: float = Field(
        0.0, ge=0, description="Sustained /v1 requests per second per API key; 0 = any."
    )
    key_burst: int = Field(
        0, ge=0, description="Requests a key may send at once above its rate (0 = the rate)."
    )
    cors_origins: StrList = Field(default_factory=list, description="Allowed CORS origins.")
    max_body_bytes: int = Field(1_048_576, ge=1024, description="Request body size limit.")
    request_timeout_s: float = Field(600.0, gt=0, description="Upper bound on one request.")
    tool_parser: Literal["auto", "hermes", "llama3_json"] = Field(
        "auto",
        description="Tool-call parser: auto (by the chat template: llama3_json for Llama 3, "
        "else hermes), hermes (<tool_call> blocks) or llama3_json.",
    )
    served_model_name: str = Field(
        "", description="Model id clients pass (default: the model setting)."
    )
    max_connections: int = Field(
        0,
        ge=0,
        description="HTTP connections the gateway holds before answering 503 (0 = unlimited).",
    )
    keep_alive_s: int = Field(
        75,
        ge=1,
        description="How long an idle keep-alive connection stays open. Longer than clients' "
        "and proxies' own idle expiry (httpx 5 s, aiohttp 15 s, nginx 60 s), so the client "
        "always closes first: a server that closes first races the client's next request on "
        "that connection, which then fails (uvicorn's own default is 5 s).",
    )
    admission_wait_ms: float = Field(
        250.0,
        ge=0,
        description="How long a streaming request waits for the scheduler to "
        "accept or refuse it before the SSE response starts (a "
        "refusal after that arrives as an error event).",
    )
    redis_url: str | None = Field(
        None,
        description="Redis server URL. The gateway keeps stored Responses there (`store`, "
        "`previous_response_id`: every gateway replica sees them); unset = this gateway's "
        "memory. The other services: unset = start the embedded redis-server.",
    )
    response_ttl_s: float = Field(
        86_400.0, gt=0, description="How long a stored Response (`/v1/responses`) is kept."
    )


class LauncherSettings(RedisSettings):
    num_executors: int = Field(1, ge=1, le=64, description="Executors `alise serve` starts.")
    num_schedulers: int = Field(
        1,
        ge=1,
        le=8,
        description="Schedulers `alise serve` starts: one leads, the others stand by.",
    )
    run_dir: Path | None = Field(
        None, description="Per-run logs directory (default data_dir/runs/<timestamp>)."
    )
    health_timeout_s: float = Field(
        300.0, gt=0, description="How long `alise serve` waits for every health check."
    )
    internal_port_base: int = Field(
        50051,
        ge=1024,
        le=65000,
        description="`alise serve`'s loopback gRPC ports: scheduler at this port, predictor +1, "
        "standby schedulers +4, executors +10 (change it to run a second stack on one machine).",
    )
    control_nice: int = Field(
        10,
        ge=0,
        le=19,
        description="`alise serve`: the nice value of the gateway, scheduler, predictor and "
        "Redis, so the executors' threads get the cores they leave (0 = normal priority; "
        "services/launcher/cpu_plan.py).",
    )


ALL_SETTINGS: tuple[type[CommonSettings], ...] = (
    CommonSettings,
    RedisSettings,
    ExecutorSettings,
    PredictorSettings,
    SchedulerSettings,
    GatewaySettings,
    LauncherSettings,
)


def env_var_names() -> set[str]:
    """Every `ALISE_*` variable some settings class reads."""
    return {f"ALISE_{name.upper()}" for cls in ALL_SETTINGS for name in cls.model_fields}


def settings_table() -> list[tuple[str, str, str]]:
    """(variable, default, description) rows for the README's configuration table."""
    rows: dict[str, tuple[str, str, str]] = {}
    for cls in ALL_SETTINGS:
        for name, field in cls.model_fields.items():
            default = field.get_default(call_default_factory=True)
            shown = (
                str(default).replace(str(Path.home()), "~")
                if isinstance(default, Path)
                else repr(default)
            )
            rows[name] = (f"ALISE_{name.upper()}", shown, field.description or "")
    return sorted(rows.values())

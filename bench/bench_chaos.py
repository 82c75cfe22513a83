"""`alise bench chaos`: kill and stop services under load; every answer must come out intact.

The stack runs as separate processes (2 executors, 2 schedulers: a leader and a standby, the
predictor, one gateway, Redis). The requests (temperature 0, `ignore_eos`, one fixed
`max_tokens`) are first sent undisturbed: that run is the reference. Then the same requests
are sent again while `--faults` faults strike at random times (seeded): SIGKILL or SIGSTOP (then
SIGCONT) of the leading scheduler, of an executor, of the predictor, and of Redis (killed and
restarted on its data, or paused). Killed services are restarted as `alise serve` does.

Per request two checks. First, the token-exact invariant, which needs no identical numerics:
the token ids the client received (`return_token_ids`) must equal the scheduler's committed
output for that request, read from Redis afterwards (none repeated, none missing, none after
the end; a request that ended in an error received a prefix of it). Second, the stronger one,
binding only with `--dtype fp32` or `--deterministic` (otherwise bf16 greedy depends on the
batch's composition; `--deterministic` also runs the reference twice and compares the two): the
text is compared with the reference run's: intact, a clean error (an HTTP error or an SSE error
event; the design allows one only where a request's state is lost), or corrupted (a
different text without an error). `--topology serve` runs the exact `alise serve` stack,
where only the launcher restarts what dies (Redis included). After the run
drains, nothing may be left behind: every executor's KV blocks free, no request waiting or
running, no Redis queue member or held entry. The table gives faults per kind, the outcome
counts, what leaked, and the p99 added latency of requests in flight during each kind of fault.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import signal
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from lab.workload.report import emit_json

KINDS = (
    "scheduler_kill",
    "scheduler_stop",
    "executor_kill",
    "executor_stop",
    "predictor_kill",
    "redis_kill",
    "redis_pause",
)
EXECUTOR_GRACE_S = 300.0  # the benchmark's ALISE_EXECUTOR_GRACE_S (make_stack says why)
STOP_S = 5.0  # how long a SIGSTOPped service stays stopped (> the lease TTL and hang floor)


@dataclass
class Fault:
    at_s: float  # seconds after the disturbed run starts
    kind: str
    target: str = ""  # filled in when it strikes
    start_s: float = 0.0
    end_s: float = 0.0


@dataclass
class Outcome:
    text: str = ""
    error: str | None = None
    start_s: float = 0.0
    end_s: float = 0.0
    request_id: str = ""  # the scheduler's key (the first chunk's `alise.request_id`)
    token_ids: list[int] = field(default_factory=list)  # as received, in order


@dataclass
class Tally:
    intact: int = 0
    clean_errors: int = 0
    corrupted: int = 0
    corrupted_ids: list[int] = field(default_factory=list)


def fault_schedule(
    n: int, duration_s: float, seed: int, kinds: tuple[str, ...] = KINDS
) -> list[Fault]:
    """`n` faults at random times in the middle 80% of a run expected to last `duration_s`,
    kinds drawn in turn from a shuffled cycle (every kind appears before one repeats)."""
    rng = random.Random(seed)
    times = sorted(rng.uniform(0.1, 0.9) * duration_s for _ in range(n))
    order: list[str] = []
    while len(order) < n:
        cycle = list(kinds)
        rng.shuffle(cycle)
        order += cycle
    return [Fault(t, k) for t, k in zip(times, order)]


def compare(outcomes: list[Outcome], reference: list[Outcome]) -> Tally:
    """Intact = the reference's text and no error; an error whose text so far is a prefix of
    the reference's is clean; anything else is corrupted."""
    tally = Tally()
    for i, (got, ref) in enumerate(zip(outcomes, reference)):
        if got.error is None and got.text == ref.text:
            tally.intact += 1
        elif got.error is not None and ref.text.startswith(got.text):
            tally.clean_errors += 1
        else:
            tally.corrupted += 1
            tally.corrupted_ids.append(i)
    return tally


@dataclass
class TokenTally:
    exact: int = 0  # every committed token received once, in order, nothing after the end
    clean_errors: int = 0  # ended with an error after a prefix of the committed output
    violations: int = 0  # a token repeated, missing, different or after the end
    unverifiable: int = 0  # no committed output to compare with (refused before admission)
    violation_ids: list[int] = field(default_factory=list)


def check_tokens(
    outcomes: list[Outcome], committed: dict[str, list[int]], max_tokens: int
) -> TokenTally:
    """The invariant that needs no identical numerics: what each client received equals the
    scheduler's committed output for its request (a complete answer: all of it, `max_tokens`
    long with `ignore_eos`; one that ended in an error: a prefix of it)."""
    tally = TokenTally()
    for i, got in enumerate(outcomes):
        ref = committed.get(got.request_id)
        if ref is None:
            if got.token_ids:
                tally.violations += 1  # tokens nobody committed
                tally.violation_ids.append(i)
            else:
                tally.unverifiable += 1
        elif got.error is None and got.token_ids == ref and len(ref) == max_tokens:
            tally.exact += 1
        elif got.error is not None and got.token_ids == ref[: len(got.token_ids)]:
            tally.clean_errors += 1
        else:
            tally.violations += 1
            tally.violation_ids.append(i)
    return tally


def committed_outputs(redis_url: str, request_ids: list[str]) -> dict[str, list[int]]:
    """Each request's output token ids as the scheduler committed them to Redis."""
    from services.common.settings import SchedulerSettings
    from services.scheduler.store.redis_store import Store

    async def load() -> dict[str, list[int]]:
        store = Store(redis_url, SchedulerSettings().state_namespace, 3600)
        try:
            out = {}
            for rid in request_ids:
                loaded = await store.load(rid)
                if loaded is not None:
                    out[rid] = [t[0] for t in loaded[1]]
            return out
        finally:
            await store.close()

    return asyncio.run(load())


def added_latency_p99(
    outcomes: list[Outcome], reference: list[Outcome], faults: list[Fault]
) -> dict[str, float]:
    """Per fault kind: p99 over the requests in flight during a fault of that kind of their
    latency minus their reference latency (seconds)."""
    out: dict[str, float] = {}
    for kind in sorted({f.kind for f in faults}):
        extra = []
        for got, ref in zip(outcomes, reference):
            hit = any(
                f.kind == kind and got.start_s <= f.end_s and f.start_s <= got.end_s for f in faults
            )
            if hit and got.error is None:
                extra.append((got.end_s - got.start_s) - (ref.end_s - ref.start_s))
        if extra:
            extra.sort()
            out[kind] = round(extra[min(len(extra) - 1, int(0.99 * len(extra)))], 3)
    return out


def request_body(model: str, i: int, max_tokens: int) -> dict:
    return {
        "model": model,
        "messages": [{"role": "user", "content": f"Question {i}: say something about {i * 13}."}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "return_token_ids": True,
    }


async def stream_one(client: httpx.AsyncClient, url: str, body: dict, t0: float) -> Outcome:
    """One streamed chat completion over SSE: its text, or the error it ended with."""
    out = Outcome(start_s=time.monotonic() - t0)
    parts: list[str] = []
    try:
        async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as reply:
            if reply.status_code != 200:
                out.error = f"HTTP {reply.status_code}: {(await reply.aread())[:200]!r}"
            else:
                async for line in reply.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        out.error = str(chunk["error"].get("message"))
                    out.request_id = out.request_id or (chunk.get("alise") or {}).get(
                        "request_id", ""
                    )
                    for choice in chunk.get("choices") or []:
                        parts.append((choice.get("delta") or {}).get("content") or "")
                        out.token_ids += choice.get("token_ids") or []
    except httpx.HTTPError as exc:
        out.error = f"{type(exc).__name__}: {exc}"
    out.text = "".join(parts)
    out.end_s = time.monotonic() - t0
    return out


async def run_requests(
    url: str, model: str, n: int, max_tokens: int, concurrency: int
) -> list[Outcome]:
    limit = asyncio.Semaphore(concurrency)
    t0 = time.monotonic()
    async with httpx.AsyncClient(timeout=600) as client:

        async def one(i: int) -> Outcome:
            async with limit:
                return await stream_one(client, url, request_body(model, i, max_tokens), t0)

        return await asyncio.gather(*[one(i) for i in range(n)])


class Injector:
    """Strikes the scheduled faults against a running ProcessStack, in a thread."""

    def __init__(self, stack, faults: list[Fault], t0: float, seed: int) -> None:
        self.stack = stack
        self.faults = faults
        self.t0 = t0
        self.rng = random.Random(seed + 1)
        self.thread = threading.Thread(target=self._run, name="chaos", daemon=True)
        self.errors: list[str] = []

    def _run(self) -> None:
        for fault in self.faults:
            time.sleep(max(0.0, self.t0 + fault.at_s - time.monotonic()))
            fault.start_s = time.monotonic() - self.t0
            try:
                self._strike(fault)
            except Exception as exc:  # a fault that could not strike is reported, not fatal
                self.errors.append(f"{fault.kind}: {type(exc).__name__}: {exc}")
            fault.end_s = time.monotonic() - self.t0

    def _strike(self, fault: Fault) -> None:
        stack, kind = self.stack, fault.kind
        if kind.startswith("redis") and getattr(stack, "supervises_redis", False):
            fault.target = "redis"  # a child of `alise serve`: its launcher restarts it
            if kind == "redis_kill":
                stack.signal("redis", signal.SIGKILL)
                time.sleep(1.0)
            else:
                stack.signal("redis", signal.SIGSTOP)
                time.sleep(3.0)
                stack.signal("redis", signal.SIGCONT)
            return
        if kind.startswith("redis"):
            fault.target = "redis"
            if kind == "redis_kill":
                stack.redis.kill()
                time.sleep(0.5)
                stack.redis.start()
            else:
                stack.redis.pause()
                time.sleep(3.0)
                stack.redis.resume()
            return
        if kind.startswith("scheduler"):
            fault.target = stack.leader()
        elif kind.startswith("executor"):
            fault.target = f"executor-{self.rng.randrange(stack.num_executors)}"
        else:
            fault.target = "predictor"
        if kind.endswith("_kill"):
            stack.signal(fault.target, signal.SIGKILL)  # watch() restarts it
            time.sleep(1.0)
        else:
            stack.signal(fault.target, signal.SIGSTOP)
            time.sleep(STOP_S)
            stack.signal(fault.target, signal.SIGCONT)


def leftovers(stack, timeout_s: float = 120.0) -> dict[str, int]:
    """Once the run drained: KV blocks not free, requests still queued, Redis entries left.
    Waits up to `timeout_s` for the scheduler to settle (a restarted executor, say)."""
    import redis

    from services.common.grpc_client import sync_channel
    from services.common.pb import scheduler_pb2, scheduler_pb2_grpc

    deadline = time.monotonic() + timeout_s
    while True:
        leader = stack.scheduler_address_of(stack.leader())
        with sync_channel(leader) as channel:
            stats = scheduler_pb2_grpc.SchedulerStub(channel).Stats(
                scheduler_pb2.StatsRequest(), timeout=5
            )
        blocks = sum(e.num_device_blocks - e.free_device_blocks for e in stats.executors if e.up)
        queued = stats.waiting + stats.running + stats.swapped
        client = redis.Redis.from_url(stack.redis_url())
        try:
            keys = {k.decode() for k in client.keys("alise:*")}
            queue = sum(client.zcard(k) for k in keys if k.startswith("alise:q:"))
            held = sum(client.scard(k) for k in keys if k.startswith("alise:held:"))
        finally:
            client.close()
        left = {"kv_blocks": blocks, "requests": queued, "redis_queue": queue, "redis_held": held}
        all_up = all(e.up for e in stats.executors)
        if (all_up and not any(left.values())) or time.monotonic() > deadline:
            return left
        time.sleep(0.5)


def make_stack(args: argparse.Namespace, run_dir: Path):
    """`--topology serve`: the exact `alise serve` stack, whose launcher alone restarts what
    dies (Redis included); `processes`: the same services started one by one here, with
    Redis restarted by the benchmark itself."""
    # finished requests stay in Redis long enough for the committed-output check
    env = {
        "ALISE_RESUME_TIMEOUT_S": "60",
        # both executors can be down at once (two kills a few seconds apart) while each
        # reloads its model, which takes minutes on a loaded 2-core host: requests wait for
        # one instead of failing after the default 30 s
        "ALISE_EXECUTOR_GRACE_S": str(getattr(args, "executor_grace_s", EXECUTOR_GRACE_S)),
        "ALISE_HEALTH_POLL_S": "0.2",
        "ALISE_RETENTION_S": "7200",
    }
    if args.dtype:
        env["ALISE_DTYPE"] = args.dtype
    if getattr(args, "deterministic", False):
        env["ALISE_DETERMINISTIC"] = "true"
    executors, device = getattr(args, "executors", 2), getattr(args, "device", "cpu")
    if device != "cpu":
        # the pool is sized under a share of the whole device counting what other processes
        # hold (memory.plan_kv_memory), so one executor per GPU
        if executors != 1:
            raise SystemExit("--device cuda: one executor (--executors 1) per GPU")
        env |= {"ALISE_DEVICE": device, "ALISE_GPU_MEMORY_UTILIZATION": "0.5"}
    if args.topology == "serve":
        from lab.launcher.serve_stack import ServeStack

        return ServeStack(run_dir, args.model, num_executors=executors, num_schedulers=2, env=env)
    from lab.gateway.testing import ProcessStack

    return ProcessStack(
        run_dir,
        args.model,
        num_executors=executors,
        num_schedulers=2,
        with_predictor=not args.no_predictor,
        env=env,
    )


def chaos(args: argparse.Namespace, run_dir: Path) -> dict:
    with make_stack(args, run_dir) as stack:
        if hasattr(stack, "watch"):
            stack.watch()  # ProcessStack: restart crashed children as `alise serve` does
        run = lambda: asyncio.run(  # noqa: E731
            run_requests(
                stack.url, stack.model_id, args.requests, args.max_tokens, args.concurrency
            )
        )
        started = time.monotonic()
        reference = run()
        duration = time.monotonic() - started
        repeat = (
            run() if getattr(args, "deterministic", False) else None
        )  # a second undisturbed run
        kinds = tuple(args.kinds.split(",")) if args.kinds else KINDS
        kinds = tuple(k for k in kinds if not (args.no_predictor and k.startswith("predictor")))
        faults = fault_schedule(args.faults, duration, args.seed, kinds)
        injector = Injector(stack, faults, time.monotonic(), args.seed)
        injector.thread.start()
        outcomes = run()
        injector.thread.join()
        left = leftovers(stack)
        committed = committed_outputs(
            stack.redis_url(), [o.request_id for o in reference + outcomes if o.request_id]
        )
    tally = compare(outcomes, reference)
    tokens = check_tokens(outcomes, committed, args.max_tokens)
    ref_tokens = check_tokens(reference, committed, args.max_tokens)
    out = summary(args, reference, outcomes, faults, tally, left, injector.errors, duration)
    out["token_exact"] = {
        "exact": tokens.exact,
        "clean_errors": tokens.clean_errors,
        "violations": tokens.violations,
        "violation_ids": tokens.violation_ids[:20],
        "unverifiable": tokens.unverifiable,
        "reference_violations": ref_tokens.violations,
    }
    if repeat is not None:
        again = compare(repeat, reference)
        out["repeat"] = {
            "intact": again.intact,
            "errors": again.clean_errors,
            "different": again.corrupted,
            "different_ids": again.corrupted_ids[:20],
        }
    return out


def summary(args, reference, outcomes, faults, tally, left, errors, duration) -> dict:
    per_kind: dict[str, int] = {}
    for f in faults:
        per_kind[f.kind] = per_kind.get(f.kind, 0) + 1
    return {
        "model": args.model,
        "requests": args.requests,
        "max_tokens": args.max_tokens,
        "concurrency": args.concurrency,
        "seed": args.seed,
        "topology": args.topology,
        "dtype": args.dtype or "auto",
        "deterministic": getattr(args, "deterministic", False),
        "reference_errors": sum(1 for r in reference if r.error),
        "reference_run_s": round(duration, 1),
        "faults": per_kind,
        "fault_log": [[round(f.start_s, 2), f.kind, f.target] for f in faults],
        "fault_errors": errors,
        # what users see: answers that came out whole, and those that did not (refused
        # before any token, or broken after some)
        "completed": sum(1 for o in outcomes if o.error is None),
        "lost": sum(1 for o in outcomes if o.error is not None),
        "refused": sum(1 for o in outcomes if o.error and o.error.startswith("HTTP ")),
        "intact": tally.intact,
        "clean_errors": tally.clean_errors,
        "corrupted": tally.corrupted,
        "corrupted_ids": tally.corrupted_ids[:20],
        "error_samples": sorted({o.error for o in outcomes if o.error})[:5],
        "leaked": left,
        "p99_added_latency_s": added_latency_p99(outcomes, reference, faults),
        "added_latency_s": added_latency_all(outcomes, reference),
    }


def added_latency_all(outcomes: list[Outcome], reference: list[Outcome]) -> dict[str, float]:
    """p50 and p99 over every request that completed of latency minus reference latency."""
    extra = sorted(
        (g.end_s - g.start_s) - (r.end_s - r.start_s)
        for g, r in zip(outcomes, reference)
        if g.error is None
    )
    if not extra:
        return {}
    pick = lambda q: round(extra[min(len(extra) - 1, int(q * len(extra)))], 3)  # noqa: E731
    return {"p50": pick(0.5), "p99": pick(0.99)}


def print_table(out: dict) -> None:
    print(f"faults injected: {out['faults']}")
    print(
        f"completed: {out['completed']}  lost: {out['lost']} "
        f"(refused before any token: {out['refused']})"
    )
    print(
        f"requests: {out['requests']}  intact: {out['intact']}  clean errors: "
        f"{out['clean_errors']}  corrupted (duplicate/missing tokens): {out['corrupted']}"
    )
    print(f"token-exact vs the scheduler's committed output: {out['token_exact']}")
    if "repeat" in out:
        print(f"second undisturbed run vs the first: {out['repeat']}")
    print(f"leaked: {out['leaked']}")
    print(f"p99 added latency per fault kind (s): {out['p99_added_latency_s']}")
    print(f"added latency, all requests (s): {out['added_latency_s']}")


def _run(args: argparse.Namespace) -> int:
    with tempfile.TemporaryDirectory(prefix="alise-bench-chaos-") as tmp:
        out = chaos(args, Path(tmp))
    print_table(out)
    emit_json(out, args.json)
    tokens = out["token_exact"]
    ok = (
        tokens["violations"] == 0
        and tokens["reference_violations"] == 0
        and out["reference_errors"] == 0
        and not any(out["leaked"].values())
        # the text comparison binds where recomputation is bit-exact: fp32 on CPU, or
        # deterministic mode (whose second undisturbed run must match the first too)
        and (out["corrupted"] == 0 or not (out["dtype"] == "fp32" or out["deterministic"]))
        and out.get("repeat", {}).get("intact", args.requests) == args.requests
    )
    return 0 if ok else 1


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "chaos", help="kill/stop services under load; check every answer and every leak"
    )
    p.add_argument("--json", type=Path, default=None, help="also write the figures here")
    p.add_argument("--model", default="smollm2-135m-instruct", help="served model ('tiny' = fast)")
    p.add_argument("--requests", type=int, default=300, help="streaming requests")
    p.add_argument("--faults", type=int, default=20, help="faults to inject")
    p.add_argument("--max-tokens", type=int, default=32, help="tokens per answer (fixed)")
    p.add_argument("--concurrency", type=int, default=16, help="requests in flight at once")
    p.add_argument("--seed", type=int, default=0, help="fault times, kinds and targets")
    p.add_argument("--no-predictor", action="store_true", help="run without the predictor")
    p.add_argument(
        "--topology",
        choices=("processes", "serve"),
        default="processes",
        help="serve: the exact `alise serve` stack, only its launcher restarts what dies",
    )
    p.add_argument(
        "--dtype",
        default="fp32",
        help="ALISE_DTYPE of the executors (the text comparison needs fp32 on CPU; '' = auto)",
    )
    p.add_argument(
        "--deterministic",
        action="store_true",
        help="ALISE_DETERMINISTIC executors: the reference runs twice, and both texts checks "
        "bind in any dtype",
    )
    p.add_argument("--executors", type=int, default=2, help="executor processes (2)")
    p.add_argument(
        "--device",
        default="cpu",
        help="the executors' device (cpu; cuda: one executor, half the GPU's memory)",
    )
    p.add_argument(
        "--executor-grace-s",
        type=float,
        default=EXECUTOR_GRACE_S,
        help="ALISE_EXECUTOR_GRACE_S: how long a request waits while no executor is up",
    )
    p.add_argument(
        "--kinds", default="", help=f"comma-separated fault kinds (default all: {','.join(KINDS)})"
    )
    p.set_defaults(func=_run)

"""gRPC Predictor servicer: validate, run Algorithm 1 off the event loop, count metrics.

Predict runs the (CPU-bound) prediction in a worker thread. Observe only validates and
queues: `ObserveQueue` drains in the background, so learning never delays a prediction, and
drops request ids it has already queued (the store itself also recognises them).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Sized
from typing import TypeVar

import grpc
from google.protobuf.message import DecodeError, Message

from services.common.grpc_server import invalid
from services.common.metrics import Metrics
from services.common.pb import common_pb2, predictor_pb2
from services.common.tasks import cancel_and_wait
from services.predictor.by_regime import RegimePredictors
from services.predictor.core import Observation

log = logging.getLogger(__name__)
SERVICE_NAME = "alise.v1.Predictor"
_M = TypeVar("_M", bound=Message)


class PredictorMetrics(Metrics):
    def __init__(self) -> None:
        super().__init__()
        self.latency = self.histogram(
            "predictor_request_latency_seconds", "Predict latency (whole batch)."
        )
        self.predictions = self.counter(
            "predictor_predictions_total", "Predictions by source.", ("source",)
        )
        self.observations = self.counter(
            "predictor_observations_total", "Observations by outcome.", ("outcome",)
        )
        self.store_size = self.gauge("predictor_store_points", "Points per model.", ("model",))
        self.queue_depth = self.gauge(
            "predictor_observe_queue_depth", "Observations waiting to be learned."
        )
        self.store_compactions = self.gauge(
            "predictor_store_compactions",
            "Compactions of the embedded store's shards since the start (copies that give "
            "evicted and rewritten points' space back).",
        )
        self.heap_trim = self.histogram(
            "predictor_heap_trim_seconds",
            "Duration of each return of the allocator's free pages (malloc_trim).",
        )
        self.in_flight = self.gauge(
            "predictor_predict_in_flight",
            "Predict calls being answered or waiting for a thread (the autoscaling signal).",
        )


class Malformed:
    """Stands in for a request whose bytes did not parse."""

    def __init__(self, error: Exception) -> None:
        self.error = error


def tolerant(message_cls: type[_M]) -> Callable[[bytes], _M | Malformed]:
    """A request deserializer that hands over undecodable bytes as `Malformed`."""

    def parse(data: bytes) -> _M | Malformed:
        try:
            return message_cls.FromString(data)
        except DecodeError as exc:
            return Malformed(exc)

    return parse


def add_to_server(servicer: PredictorServicer, server: grpc.aio.Server) -> None:
    """Like the generated add_PredictorServicer_to_server, but malformed bytes reach the
    servicer (as `Malformed`) so they get INVALID_ARGUMENT instead of INTERNAL."""
    handlers = {
        "Predict": grpc.unary_unary_rpc_method_handler(
            servicer.Predict,
            request_deserializer=tolerant(predictor_pb2.PredictRequest),
            response_serializer=predictor_pb2.PredictResponse.SerializeToString,
        ),
        "Observe": grpc.unary_unary_rpc_method_handler(
            servicer.Observe,
            request_deserializer=tolerant(predictor_pb2.ObserveRequest),
            response_serializer=predictor_pb2.ObserveResponse.SerializeToString,
        ),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))


class ObserveQueue:
    """Background learner: batches of (model, temperature, observations), processed one at a
    time by the temperature's regime."""

    def __init__(
        self,
        predictors: RegimePredictors,
        metrics: PredictorMetrics,
        remember: int = 100_000,
        chunk: int = 8,
    ) -> None:
        self.predictors, self.metrics, self.chunk = predictors, metrics, chunk
        self.queue: asyncio.Queue[tuple[str, float | None, list[Observation]]] = asyncio.Queue()
        self.seen: OrderedDict[tuple[str, str], None] = OrderedDict()
        self.remember = remember
        self.task = asyncio.create_task(self._run())

    def submit(
        self, model: str, observations: list[Observation], temperature: float | None = None
    ) -> int:
        """Queue the observations of request ids not seen recently; returns how many (0
        without a store: the prior-only service counts them as ignored)."""
        if self.predictors.store is None:
            self.metrics.observations.labels("ignored").inc(len(observations))
            return 0
        fresh = []
        for obs in observations:
            key = (model, obs.request_id)
            if key in self.seen:
                self.metrics.observations.labels("duplicate").inc()
                continue
            self.seen[key] = None
            fresh.append(obs)
        while len(self.seen) > self.remember:
            self.seen.popitem(last=False)
        for start in range(0, len(fresh), self.chunk):
            self.queue.put_nowait((model, temperature, fresh[start : start + self.chunk]))
        self.metrics.queue_depth.inc(len(fresh))
        return len(fresh)

    async def _run(self) -> None:
        while True:
            model, temperature, batch = await self.queue.get()
            try:
                changed = await asyncio.to_thread(
                    self.predictors.observe, model, batch, temperature
                )
                self.metrics.observations.labels("learned").inc(changed)
                self.metrics.observations.labels("already_stored").inc(len(batch) - changed)
                sizes = await asyncio.to_thread(self.predictors.count, model)
                self.metrics.store_size.labels(model).set(sum(sizes.values()))
                self.metrics.store_compactions.set(self.predictors.compactions())
            except Exception:
                log.exception("observe batch failed")
                self.metrics.observations.labels("failed").inc(len(batch))
            finally:
                self.metrics.queue_depth.dec(len(batch))
                self.queue.task_done()

    async def drain(self) -> None:
        await self.queue.join()

    async def stop(self) -> None:
        await cancel_and_wait(self.task)


_Request = predictor_pb2.PredictRequest | predictor_pb2.ObserveRequest | Malformed


def temperature_of(
    request: predictor_pb2.PredictRequest | predictor_pb2.ObserveRequest,
) -> float | None:
    """The request's temperature, None when not sent (the API default, regime t1)."""
    return request.temperature if request.HasField("temperature") else None


class PredictorServicer:
    def __init__(
        self,
        predictors: RegimePredictors,
        models: list[str],
        metrics: PredictorMetrics,
        observer: ObserveQueue,
        max_prompt_chars: int,
        max_batch: int,
    ) -> None:
        self.predictors, self.models, self.metrics = predictors, set(models), metrics
        self.observer = observer
        self.max_prompt_chars, self.max_batch = max_prompt_chars, max_batch

    def _check_common(self, request: _Request, items: Sized, what: str) -> None:
        if isinstance(request, Malformed):
            raise invalid(f"malformed request: {request.error}")
        if request.model not in self.models:
            raise invalid(f"unknown model id {request.model!r}; served: {sorted(self.models)}")
        if not items:
            raise invalid(f"no {what} given")
        temperature = temperature_of(request)
        if temperature is not None and not temperature >= 0:
            raise invalid(f"temperature {temperature} is not >= 0")
        if len(items) > self.max_batch:
            raise invalid(f"{len(items)} {what} exceed the limit of {self.max_batch}")

    def _check_prompt(self, prompt: str, where: str) -> None:
        if not prompt.strip():
            raise invalid(f"{where}: empty prompt")
        if len(prompt) > self.max_prompt_chars:
            raise invalid(
                f"{where}: prompt of {len(prompt)} characters exceeds {self.max_prompt_chars}"
            )

    async def Predict(
        self, request: predictor_pb2.PredictRequest | Malformed, context: grpc.aio.ServicerContext
    ) -> predictor_pb2.PredictResponse:
        prompts = [] if isinstance(request, Malformed) else list(request.prompts)
        self._check_common(request, prompts, "prompts")
        for i, prompt in enumerate(prompts):
            self._check_prompt(prompt, f"prompts[{i}]")
        t0 = time.perf_counter()
        self.metrics.in_flight.inc()
        try:
            preds = await asyncio.to_thread(
                self.predictors.predict, request.model, prompts, temperature_of(request)
            )
        finally:
            self.metrics.in_flight.dec()
        self.metrics.latency.observe(time.perf_counter() - t0)
        for p in preds:
            self.metrics.predictions.labels(p.source).inc()
        return predictor_pb2.PredictResponse(
            predictions=[
                common_pb2.Prediction(
                    length=p.length,
                    source=p.source,
                    similarity=p.similarity,
                    neighbors=p.neighbors,
                    p_capped=p.p_capped,
                    spread=p.spread,
                    regime=p.regime,
                )
                for p in preds
            ]
        )

    async def Observe(
        self, request: predictor_pb2.ObserveRequest | Malformed, context: grpc.aio.ServicerContext
    ) -> predictor_pb2.ObserveResponse:
        items = [] if isinstance(request, Malformed) else list(request.observations)
        self._check_common(request, items, "observations")
        for i, o in enumerate(items):
            if not o.request_id:
                raise invalid(f"observations[{i}]: empty request_id")
            if o.true_length < 0:
                raise invalid(f"observations[{i}]: negative true_length {o.true_length}")
            self._check_prompt(o.prompt, f"observations[{i}]")
        accepted = self.observer.submit(
            request.model,
            [Observation(o.request_id, o.prompt, o.true_length, o.censored) for o in items],
            temperature_of(request),
        )
        return predictor_pb2.ObserveResponse(accepted=accepted)

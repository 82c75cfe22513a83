"""Start the predictor service: gRPC (Predict, Observe, health, reflection) + Prometheus.

`start_predictor(settings)` loads the embedder, opens the store (server when qdrant_url is
set, else embedded under data_dir), serves at once, and - when `predictor_seed` is true and
the store is empty - seeds it from the ShareGPT train split in a background thread (Predict
answers meanwhile from what is there, the MLP, or the prior). `await handle.wait_seeded()`
waits for that. Every `predictor_trim_s` seconds, and once the seed is in, the allocator's
free pages go back to the system (`services.common.heap`: glibc keeps what the embedder and
the store freed, hundreds of MiB after the seed). With `ALISE_EMBEDDER=none` it serves
prior-only (`services.predictor.build.prior_predictors`): nothing to load or seed, so
`wait_seeded()` returns None at once; health is SERVING as soon as it listens, as always.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from dataclasses import dataclass, field

from services.common.grpc_server import GrpcServer, start_server
from services.common.heap import Trimmer
from services.common.settings import PredictorSettings
from services.predictor.build import (
    SeedCancelled,
    build_predictors,
    prior_only,
    seed_if_empty,
    served_models,
)
from services.predictor.by_regime import RegimePredictors
from services.predictor.core import LengthPredictor
from services.predictor.embedder import Embedder
from services.predictor.servicer import (
    SERVICE_NAME,
    ObserveQueue,
    PredictorMetrics,
    PredictorServicer,
    add_to_server,
)
from services.predictor.store_base import StoreUnavailable

log = logging.getLogger(__name__)


@dataclass
class PredictorHandle:
    server: GrpcServer
    predictors: RegimePredictors
    observer: ObserveQueue
    metrics: PredictorMetrics
    models: list[str]
    trimmer: Trimmer
    seeding: asyncio.Task | None = None
    seed_report: dict | None = None
    stop_seeding: threading.Event = field(default_factory=threading.Event)

    @property
    def port(self) -> int:
        return self.server.port

    @property
    def predictor(self) -> LengthPredictor:
        """The fallback regime's predictor (temperature 1)."""
        return self.predictors.primary

    async def wait_seeded(self) -> dict | None:
        if self.seeding is not None:
            self.seed_report = await self.seeding
        return self.seed_report

    async def stop(self, grace: float | None = 2.0) -> None:
        await self.server.stop(grace)
        await self.observer.stop()
        await self.trimmer.stop()
        if self.seeding is not None and not self.seeding.done():
            self.stop_seeding.set()  # checked between embedding chunks
            await asyncio.wait([self.seeding])
        if self.predictors.store is not None:  # prior-only: none
            await asyncio.to_thread(self.predictors.store.close)


async def _seed(
    settings: PredictorSettings,
    predictors: RegimePredictors,
    metrics: PredictorMetrics,
    model: str,
    stop: threading.Event,
    trimmer: Trimmer,
    empty: set[str],
) -> dict | None:
    try:
        report = await asyncio.to_thread(seed_if_empty, settings, predictors, stop, empty)
        sizes = await asyncio.to_thread(predictors.count, model)
        metrics.store_size.labels(model).set(sum(sizes.values()))
        await trimmer.now()  # the seed's embedding and training freed hundreds of MiB
        log.info("seeding finished", extra={"points": sizes})
        return report
    except StoreUnavailable as exc:
        log.warning("could not seed the store: %s", exc)
    except SeedCancelled:
        log.info("seeding stopped; embeddings so far stay cached")
    return None


async def start_predictor(
    settings: PredictorSettings, embedder: Embedder | None = None
) -> PredictorHandle:
    """Serve on settings.predictor_host:predictor_port (port 0 = a free one).

    `embedder`: an already loaded one to reuse (tests); default = load settings.embedder.
    """
    predictors = await asyncio.to_thread(build_predictors, settings, embedder)
    models = served_models(settings)
    seeding = settings.predictor_seed and not prior_only(settings)
    # which regimes to seed is decided before any Observe can land (the seed runs while
    # the service answers, and a regime seeded later may have learned a request by then)
    empty = await asyncio.to_thread(predictors.empty, models[0]) if seeding else set()
    metrics = PredictorMetrics()
    observer = ObserveQueue(predictors, metrics)
    servicer = PredictorServicer(
        predictors,
        models,
        metrics,
        observer,
        settings.predictor_max_prompt_chars,
        settings.predictor_max_batch,
    )
    server = await start_server(
        [(add_to_server, servicer, SERVICE_NAME)],
        f"{settings.predictor_host}:{settings.predictor_port}",
    )
    if settings.metrics_port:
        metrics.serve(settings.metrics_port)
    handle = PredictorHandle(
        server,
        predictors,
        observer,
        metrics,
        models,
        Trimmer(settings.predictor_trim_s, metrics.heap_trim.observe),
    )
    if seeding:
        handle.seeding = asyncio.create_task(
            _seed(
                settings, predictors, metrics, models[0], handle.stop_seeding, handle.trimmer, empty
            )
        )
    log.info(
        "predictor serving",
        extra={
            "port": server.port,
            "models": models,
            "store": predictors.store.backend if predictors.store else "none (prior-only)",
            "regimes": sorted(predictors.by_regime),
        },
    )
    return handle

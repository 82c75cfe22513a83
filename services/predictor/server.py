"""Start the predictor service: gRPC (Predict, Observe, health, reflection) + Prometheus.

`start_predictor(settings)` loads the embedder, opens the store (server when qdrant_url is
set, else embedded under data_dir), serves at once, and - when `predictor_seed` is true and
the store is empty - seeds it from the ShareGPT train split in a background thread (Predict
answers meanwhile from what is there, the MLP, or the prior). `await handle.wait_seeded()`
waits for that.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from dataclasses import dataclass, field

from services.common.grpc_server import GrpcServer, start_server
from services.common.settings import PredictorSettings
from services.predictor.build import SeedCancelled, build_predictor, seed_if_empty, served_models
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
    predictor: LengthPredictor
    observer: ObserveQueue
    metrics: PredictorMetrics
    models: list[str]
    seeding: asyncio.Task | None = None
    seed_report: dict | None = None
    stop_seeding: threading.Event = field(default_factory=threading.Event)

    @property
    def port(self) -> int:
        return self.server.port

    async def wait_seeded(self) -> dict | None:
        if self.seeding is not None:
            self.seed_report = await self.seeding
        return self.seed_report

    async def stop(self, grace: float | None = 2.0) -> None:
        await self.server.stop(grace)
        await self.observer.stop()
        if self.seeding is not None and not self.seeding.done():
            self.stop_seeding.set()  # checked between embedding chunks
            await asyncio.wait([self.seeding])
        await asyncio.to_thread(self.predictor.store.close)


async def _seed(
    settings: PredictorSettings,
    predictor: LengthPredictor,
    metrics: PredictorMetrics,
    model: str,
    stop: threading.Event,
) -> dict | None:
    try:
        report = await asyncio.to_thread(seed_if_empty, settings, predictor, stop)
        metrics.store_size.labels(model).set(await asyncio.to_thread(predictor.store.count, model))
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
    predictor = await asyncio.to_thread(build_predictor, settings, embedder)
    models = served_models(settings)
    metrics = PredictorMetrics()
    observer = ObserveQueue(predictor, metrics)
    servicer = PredictorServicer(
        predictor,
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
    handle = PredictorHandle(server, predictor, observer, metrics, models)
    if settings.predictor_seed:
        handle.seeding = asyncio.create_task(
            _seed(settings, predictor, metrics, models[0], handle.stop_seeding)
        )
    log.info(
        "predictor serving",
        extra={"port": server.port, "models": models, "store": predictor.store.backend},
    )
    return handle

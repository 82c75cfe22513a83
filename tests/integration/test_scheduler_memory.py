"""A long-running scheduler service keeps nothing per request or per Step once its requests
have finished (a soak then sees its memory flat): real gRPC, real Redis, a stub executor
(the real Step contract), the default policy, events over a subscription as the gateway reads
them."""

from __future__ import annotations

import asyncio

from lab.executor.stub import serve_stubs
from lab.scheduler.testing import gen_request, retained, running_scheduler
from services.common.settings import GatewaySettings
from services.gateway.upstream import Upstream
from services.scheduler.servicer import executor_stats

MAX_TOKENS = 24


async def test_nothing_is_kept_of_finished_requests_or_their_steps(redis_server):
    fleet = await serve_stubs(1, 0.001)
    try:
        async with running_scheduler(
            redis_server.url, fleet.addresses(), log_level="WARNING"
        ) as handle:
            upstream = Upstream(GatewaySettings(scheduler_address=[handle.address]))
            try:
                group = upstream.shards[0]
                for wave in range(3):  # one at a time, then several together
                    calls = [
                        upstream.generate(
                            group, gen_request(f"w{wave}-{i}", [3 + i] * (4 + i), MAX_TOKENS)
                        )[0]
                        for i in range(1 + 5 * wave)
                    ]
                    for events in await asyncio.gather(*(_read(c) for c in calls)):
                        assert len(events) == MAX_TOKENS + 1 and events[-1].finished
            finally:
                await upstream.close()
            service = handle.service
            (loop,) = service.loops.values()
            assert loop.steps >= 3 * MAX_TOKENS
            await service.writer.flush()
            for _ in range(100):  # the last free goes out with the loop's next Step
                if not loop.sched.requests:
                    break
                await asyncio.sleep(0.01)
            left = retained(service, "service") | retained(handle.servicer, "servicer")
            assert left == {}, left
            # what the scheduler does keep of them: the prefix cache's blocks (bounded by the
            # pool), which Stats reports so a soak can tell that growth from a leak
            stats = executor_stats(fleet.addresses()[0], loop)
            assert 0 < stats.cached_device_blocks == loop.sched.block_manager.num_cached_free_blocks
    finally:
        await fleet.stop()


async def _read(call) -> list:
    return [event async for event in call]

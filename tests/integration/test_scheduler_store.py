"""The scheduler's Redis store against a real embedded redis-server."""

import asyncio

from services.scheduler.store.iteration_write import IterationWrite
from services.scheduler.store.redis_store import Store, StoreWriter


async def test_create_write_tokens_and_finish(redis_server):
    store = Store(redis_server.url, namespace="t", retention_s=0.5)
    writer = StoreWriter(store)
    await writer.start()
    await store.create("a", {"params": "{}", "status": "WAITING", "arrival": 1.0}, 1.0)
    await store.create("b", {"params": "{}", "status": "WAITING", "arrival": 2.0}, 2.0)
    assert await store.active_ids() == ["a", "b"]

    published = []
    w = IterationWrite()
    w.move("a", "running", 1.0)
    w.set("a", status="RUNNING", executor="e1")
    w.add_token("a", 0, 7, -0.5, 10.0)
    w.add_token("a", 1, 8, -0.25, 10.5)
    w.held_add["e1"].add("a")
    w.executors["e1"] = {"num_device_blocks": 10, "free_device_blocks": 9}
    w.callbacks.append(lambda: published.append("first"))
    writer.submit(w)
    w2 = IterationWrite()
    w2.add_token("a", 2, 9, -1.0, 11.0)
    w2.set("a", status="FINISHED_STOPPED", finish_reason="stop")
    w2.finish("a")
    w2.held_remove["e1"].add("a")
    w2.counters["finished"] += 1
    w2.callbacks.append(lambda: published.append("second"))
    writer.submit(w2)
    await writer.flush()
    assert published == ["first", "second"]

    record, tokens = await store.load("a")
    assert record["status"] == "FINISHED_STOPPED" and record["executor"] == "e1"
    assert [t[0] for t in tokens] == [7, 8, 9]
    assert tokens[1][1] == -0.25 and tokens[2][2] == 11.0
    assert await store.active_ids() == ["b"]
    assert await store.queue_members("running") == []
    assert await store.held("e1") == set()
    assert (await store.executor("e1"))["free_device_blocks"] == "9"
    assert (await store.stats())["finished"] == 1
    # A retried commit of the same batch does not duplicate tokens (SETRANGE at index*16).
    await store.commit([w, w2])
    assert [t[0] for t in (await store.load("a"))[1]] == [7, 8, 9]
    # Finished requests expire after the retention window.
    await asyncio.sleep(0.8)
    assert await store.load("a") is None
    assert await store.load("b") is not None
    await writer.close()
    await store.close()


def test_tokens_must_be_contiguous():
    w = IterationWrite()
    w.add_token("a", 3, 1, 0.0, 0.0)
    try:
        w.add_token("a", 5, 1, 0.0, 0.0)
    except ValueError as exc:
        assert "not contiguous" in str(exc)
    else:
        raise AssertionError("gap accepted")

"""What removed nodes' records cost a router with ``--state``, and what pruning them gives.

A fleet followed through DNS removes a node for every pod a rollout replaces (a new IP),
and every router reads the fleet's records at each reload (every 5 s, and at each change).
Starts a redis-server on 127.0.0.1 (``tests/redis_server.py``), writes ``--records``
removed decode nodes' records as a router's removals leave them, starts one router's
shared fleet on it (records kept 0 s), and prints: a reload's time (wall and this
process's CPU) with them, each ``PRUNE`` call's wall time until none is left (Redis runs
nothing else meanwhile), and a reload's time after. It asserts nothing.

    python benchmarks/removed_nodes.py [--records 20000]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import anyio
import orjson

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from pd_router.fleet.nodes import HealthPolicy, make_nodes  # noqa: E402
from pd_router.fleet.registry import Fleet  # noqa: E402
from pd_router.shared.fleet import PRUNE_BATCH, SharedFleet  # noqa: E402
from pd_router.shared.pool import SharedPool  # noqa: E402
from pd_router.shared.redis import Redis, parse_url  # noqa: E402
from tests.redis_server import RedisServer  # noqa: E402

FIRST_ID = 100


async def write_removed(redis: Redis, count: int) -> None:
    for start in range(FIRST_ID, FIRST_ID + count, 1000):
        nodes: list[str | bytes] = []
        admin: list[str | bytes] = []
        ids: list[str | bytes] = []
        for i in range(start, min(start + 1000, FIRST_ID + count)):
            url = f"http://10.{i >> 16 & 255}.{i >> 8 & 255}.{i & 255}:8000"
            document = {"role": "decode", "url": url, "slots": 4, "labels": {}}
            nodes += [str(i), orjson.dumps({**document, "source": "dns:decode.example"})]
            admin += [str(i), "removed"]
            ids += ["decode " + url, str(i)]
        await redis.call("HSET", "{pdr}:nodes", *nodes)
        await redis.call("HSET", "{pdr}:node-ids", *ids)
        await redis.call("HSET", "{pdr}:admin", *admin)
    await redis.call("SET", "{pdr}:next-id", str(FIRST_ID + count))


async def timed(what: str, call: object) -> object:
    wall, cpu = time.perf_counter(), time.process_time()
    result = await call  # type: ignore[misc]
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    print(f"{what:<44} {1000 * wall:8.1f} ms wall {1000 * cpu:8.1f} ms CPU")
    return result


async def main(records: int) -> None:
    with RedisServer() as server:
        redis = Redis(parse_url(server.url), timeout=5.0)
        await write_removed(redis, records)
        prefill = make_nodes(["http://p0:1"], 1, role="prefill")
        fleet = Fleet(
            prefill,
            make_nodes(["http://d0:1"], 4, first_id=1),
            HealthPolicy(),
            pool=lambda nodes: SharedPool(nodes, redis),
        )
        assert isinstance(fleet.pool, SharedPool)  # nosec B101: built just above
        shared = SharedFleet(fleet, fleet.pool, kept=0.0)
        await shared.register()
        for _ in range(3):
            await timed(f"reload, {records} removed records", shared._reload())
        calls, dropped, started = 0, 0, time.perf_counter()
        slowest = 0.0
        while True:
            wall = time.perf_counter()
            now = await shared.prune()
            slowest = max(slowest, time.perf_counter() - wall)
            calls, dropped = calls + 1, dropped + now
            if dropped >= records or calls > 4 * records // PRUNE_BATCH + 4:
                break
        took = time.perf_counter() - started
        print(
            f"prune ({PRUNE_BATCH} at most a call): {dropped} dropped in {calls} calls, "
            f"{took:.2f} s; the slowest call {1000 * slowest:.1f} ms"
        )
        for _ in range(3):
            await timed("reload after the prune", shared._reload())
        await redis.aclose()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--records", type=int, default=20000)
    anyio.run(main, parser.parse_args().records)

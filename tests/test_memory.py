"""No request path leaves a reference cycle behind.

The router freezes its start-up heap and raises the young-generation threshold
(``cli._settle_heap``): cheap while requests free themselves by reference counting, and a
leak of whole request bodies as soon as one path does not (an exception kept with its
traceback holds the frames, the frames the body). So each path below runs with the cyclic
collector off, and what a collection then finds unreachable must be nothing at all.

The router runs in this process (uvicorn in a thread, the app as the CLI builds it) so
that its garbage is visible here; the engines are simulated engine processes, the clients
raw sockets (no client-side objects to confuse the count).
"""

from __future__ import annotations

import gc
import json
import socket
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import uvicorn

from pd_router.app import AppOptions, create_app
from pd_router.relay import Router
from pd_router.serve import build_router, parse_router_args, router_parser
from pd_router.sim.fleet import SimFleet, free_port

BODY = {"model": "sim-model", "prompt": "hello pd router " * 8, "max_tokens": 4}
STREAM = {**BODY, "stream": True, "max_tokens": 40}


class InProcessRouter:
    def __init__(self, fleet: SimFleet) -> None:
        parser, actions = router_parser()
        urls = ["--prefill", fleet.prefill[0].url, "--decode", *[e.url for e in fleet.decode]]
        args = parse_router_args(parser, actions, [*urls, "--decode-slots", "1"], {})
        self.router: Router = build_router(args)
        self.port = free_port()
        options = AppOptions(health_interval=0.1, health_timeout=0.5, stall_timeout=0)
        config = uvicorn.Config(
            create_app(self.router, options), host="127.0.0.1", port=self.port, log_level="error"
        )
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> InProcessRouter:
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            assert time.monotonic() < deadline, "the in-process router did not start"
            time.sleep(0.02)
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.server.should_exit = True
        self.thread.join(10)

    def post(
        self, body: Any, *, raw: bytes | None = None, leave_after: float | None = None
    ) -> bytes:
        """POST to /v1/completions; the whole answer, or b"" when leaving after a while."""
        data = raw if raw is not None else json.dumps(body).encode()
        with socket.create_connection(("127.0.0.1", self.port), timeout=10) as sock:
            sock.sendall(
                b"POST /v1/completions HTTP/1.1\r\nhost: router\r\nconnection: close\r\n"
                b"content-type: application/json\r\ncontent-length: %d\r\n\r\n" % len(data) + data
            )
            if leave_after is not None:
                time.sleep(leave_after)
                return b""
            answer = b""
            while chunk := sock.recv(65536):
                answer += chunk
            return answer

    def idle(self) -> bool:
        pool = self.router.fleet.pool
        return pool.in_use == 0 and pool.queue_depth == 0 and not self.router.fleet.bindings


@pytest.fixture(scope="module")
def fleet() -> Iterator[SimFleet]:
    with SimFleet(prefill=1, decode=2) as engines:
        yield engines


@pytest.fixture(scope="module")
def router(fleet: SimFleet) -> Iterator[InProcessRouter]:
    with InProcessRouter(fleet) as server:
        yield server


@pytest.fixture(autouse=True)
def _engines_normal(fleet: SimFleet, router: InProcessRouter) -> Iterator[None]:
    yield
    for engine in fleet.engines:
        engine.configure(
            fail_status=None, fail_after_tokens=None, stall=False, itl=0.0, prefill_delay=0.0
        )
    router.router.upstream.read_timeout = 600.0
    router.router.settings.queue_timeout = 0.0


def garbage_of(action: Callable[[], None], router: InProcessRouter) -> Counter[str]:
    """What the cyclic collector finds unreachable after ``action`` and the requests it
    started have ended, by type (frames by their function)."""
    gc.collect()
    gc.set_debug(gc.DEBUG_SAVEALL)
    gc.disable()
    try:
        action()
        deadline = time.monotonic() + 10
        while not router.idle():
            assert time.monotonic() < deadline, "requests did not end"
            time.sleep(0.02)
        time.sleep(0.3)  # the server's connection teardown, the engines' aborts
        gc.collect()
        found = Counter(
            f"frame {o.f_code.co_qualname}" if type(o).__name__ == "frame" else type(o).__name__
            for o in gc.garbage
        )
    finally:
        gc.garbage.clear()
        gc.set_debug(0)
        gc.enable()
    return found


def several(action: Callable[[], Any], times: int = 4) -> Callable[[], None]:
    return lambda: [action() for _ in range(times)] and None


def concurrently(*actions: Callable[[], Any], stagger: float = 0.15) -> Callable[[], None]:
    def run() -> None:
        threads = [threading.Thread(target=action) for action in actions]
        for thread in threads:
            thread.start()
            time.sleep(stagger)
        for thread in threads:
            thread.join(30)

    return run


def test_answers_streams_and_bad_requests_leave_no_cycles(router: InProcessRouter) -> None:
    def action() -> None:
        assert b"200 OK" in router.post(BODY)
        assert b"data: [DONE]" in router.post(STREAM)
        assert b"400 Bad Request" in router.post(None, raw=b"notjson")
        assert b"400 Bad Request" in router.post({"prompt": 123})

    assert garbage_of(several(action, 3), router) == Counter()


def test_engine_errors_leave_no_cycles_and_keep_no_body(
    fleet: SimFleet, router: InProcessRouter
) -> None:
    large = {**BODY, "prompt": "x" * (4 << 20)}

    def action() -> None:
        fleet.prefill[0].configure(fail_status=400)
        assert b"400 Bad Request" in router.post(large)
        fleet.prefill[0].configure(fail_status=None)
        for engine in fleet.decode:
            engine.configure(fail_status=500)
        assert b"500 Internal Server Error" in router.post(large)
        for engine in fleet.decode:
            engine.configure(fail_status=None, fail_after_tokens=2)
        assert b"stream broken" in router.post(STREAM)

    assert garbage_of(several(action, 3), router) == Counter()


def test_busy_queued_and_timed_out_requests_leave_no_cycles(
    fleet: SimFleet, router: InProcessRouter
) -> None:
    for engine in fleet.decode:
        engine.configure(itl=0.02)
    slow = {**STREAM, "max_tokens": 30}
    busy = concurrently(
        lambda: router.post(slow), lambda: router.post(slow), lambda: router.post(BODY)
    )
    assert garbage_of(several(busy, 2), router) == Counter()

    def queued() -> None:
        router.router.settings.queue_timeout = 0.1
        concurrently(
            lambda: router.post(slow),
            lambda: router.post(slow),
            lambda: router.post(BODY),  # waits, times out: 429
            lambda: router.post(BODY, leave_after=0.05),  # leaves the queue
        )()

    assert garbage_of(queued, router) == Counter()


def test_hang_ups_and_engine_failures_mid_request_leave_no_cycles(
    fleet: SimFleet, router: InProcessRouter
) -> None:
    def action() -> None:
        fleet.prefill[0].configure(prefill_delay=0.2)
        router.post(BODY, leave_after=0.1)  # during prefill
        fleet.prefill[0].configure(prefill_delay=0.0)
        for engine in fleet.decode:
            engine.configure(itl=0.02)
        router.post(STREAM, leave_after=0.2)  # mid-stream
        for engine in fleet.decode:
            engine.configure(itl=0.0, stall=True)
        router.router.upstream.read_timeout = 0.3
        assert b"timeout" in router.post(STREAM)  # the engine's silence: 504
        for engine in fleet.decode:
            engine.configure(stall=False)
        router.router.upstream.read_timeout = 600.0

    assert garbage_of(several(action, 2), router) == Counter()

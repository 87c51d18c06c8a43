from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest

from pd_router.shared.redis import Redis, parse_url
from tests.redis_server import RedisServer


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """How pytest-xdist (``-n 4``, setup.cfg) shares the tests out: a test module at a time,
    so that a module's servers (module-scoped routers, engines, redis-servers) start once,
    on one worker; and the real-vLLM folder as one unit, so that one worker runs it and
    one pair of engines serves the session. (xdist's ``loadgroup`` would do the latter
    with marks, but does not work on pytest 9: it renames items through an attribute
    pytest no longer reads.) Units go out in the session's order, which puts the
    real-vLLM tests last (tests/real_vllm/conftest.py)."""
    from xdist.scheduler import LoadScopeScheduling

    class ByModule(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return REAL_VLLM if path.startswith(REAL_VLLM + "/") else path

    config.option.loadscopereorder = False
    return ByModule(config, log)


REAL_VLLM = "tests/real_vllm"


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(scope="module")
def redis_server() -> Iterator[RedisServer]:
    """A real redis-server for the module's tests; fails (never skips) without one."""
    try:
        server = RedisServer()
    except RuntimeError as exc:
        pytest.fail(str(exc), pytrace=False)
    with server:
        yield server


@pytest.fixture
async def redis(redis_server: RedisServer) -> AsyncIterator[Redis]:
    """A client of the module's server, which it empties first."""
    client = Redis(parse_url(redis_server.url), timeout=1.0)
    await client.call("FLUSHALL")
    try:
        yield client
    finally:
        await client.aclose()

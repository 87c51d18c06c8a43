from collections.abc import AsyncIterator, Iterator

import pytest

from pd_router.shared.redis import Redis, parse_url
from tests.redis_server import RedisServer


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

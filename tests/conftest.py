from collections.abc import Iterator

import pytest

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

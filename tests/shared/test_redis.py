"""The Redis client against a real redis-server, under asyncio and trio."""

from __future__ import annotations

import os
import signal
import ssl
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator

import anyio
import pytest
import trustme

from pd_router.shared.redis import (
    Redis,
    RedisError,
    RedisUnavailable,
    Script,
    Settings,
    parse_url,
)
from tests.redis_server import DroppingProxy, RedisServer, free_port

pytestmark = pytest.mark.anyio

TIMEOUT = 5.0
PASSWORD = "s3cret-Pa55"


@pytest.fixture
def key(request: pytest.FixtureRequest) -> str:
    """A key of the test's own, so that tests sharing the module's server do not meet."""
    return f"test:{request.node.name}"


@pytest.fixture
async def redis(redis_server: RedisServer) -> AsyncIterator[Redis]:
    async with Redis(parse_url(redis_server.url), timeout=TIMEOUT) as client:
        yield client


@pytest.fixture
def own_server() -> Iterator[RedisServer]:
    """A server of the test's own, for tests that stop, kill or freeze it."""
    with RedisServer() as server:
        yield server


async def wait_until(check: Callable[[], Awaitable[bool]], what: str) -> None:
    with anyio.move_on_after(30):
        while not await check():
            await anyio.sleep(0.01)
        return
    raise AssertionError(f"timed out waiting for {what}")


# ---------------------------------------------------------------------- URLs, no server


def test_parse_url() -> None:
    assert parse_url("redis://localhost") == Settings("localhost", 6379, 0)
    settings = parse_url("rediss://us%40er:p%3Ass@10.0.0.1:6380/3")
    assert settings == Settings("10.0.0.1", 6380, 3, "us@er", "p:ss", tls=True)
    assert parse_url("redis://:pw@[::1]:7000/") == Settings("::1", 7000, 0, None, "pw")
    assert settings.safe_url == "rediss://us%40er:***@10.0.0.1:6380/3"
    assert parse_url("redis://:pw@[::1]:7000").safe_url == "redis://:***@[::1]:7000/0"
    assert "p:ss" not in repr(settings)


@pytest.mark.parametrize(
    "url, message",
    [
        ("http://:pw@host", r"starts with redis:// or rediss:// \(http:// given\)"),
        ("host:6379", r"starts with redis:// or rediss://"),
        ("unix:///run/redis.sock", r"\(unix:// given\)"),
        ("redis://:pw@host/0?password=pw", r"no \?query or #fragment"),
        ("redis://:pw@/0", "needs a host"),
        ("redis://:pw@host:99999", r"from 1 to 65535 \('host:99999'\)"),
        ("redis://:pw@host:port", r"from 1 to 65535 \('host:port'\)"),
        ("redis://:pw@host:0", r"from 1 to 65535 \('host:0'\)"),
        ("redis://:pw@host/zero", "a database number"),
        # More digits than int() reads: its own ValueError, which named no setting.
        ("redis://:pw@host/" + "0" * 5000, "a database number"),
        ("redis://user@host", "needs a password"),
        # A / in the password cuts the URL there: neither piece is shown (they were).
        ("redis://user:p/w@host:6379/0", "must be written %2F"),
        ("redis://:p/w@host", "must be written %2F"),
        ("redis://user:pw/@host", "must be written %2F"),
    ],
)
def test_bad_urls_say_what_is_wrong_and_not_the_password(url: str, message: str) -> None:
    with pytest.raises(ValueError, match=message) as caught:
        parse_url(url)
    assert "pw" not in str(caught.value)
    assert "p/w" not in str(caught.value) and "'p'" not in str(caught.value)


# ---------------------------------------------------------------------- commands


async def test_each_reply_type(redis: Redis, key: str) -> None:
    assert await redis.call("PING") == "PONG"
    assert await redis.call("SET", key, "é") == "OK"
    assert await redis.call("GET", key) == "é".encode()
    assert await redis.call("GET", key + ":missing") is None
    assert await redis.call("INCRBY", key + ":n", -5) == -5
    assert await redis.call("RPUSH", key + ":list", b"\x00\r\n", 2, 0.5) == 3
    assert await redis.call("LRANGE", key + ":list", 0, -1) == [b"\x00\r\n", b"2", b"0.5"]
    assert await redis.call("LRANGE", key + ":missing", 0, -1) == []
    nested = "return {1, {'a', {}}, false, redis.status_reply('FINE')}"
    assert await redis.call("EVAL", nested, 0) == [1, [b"a", []], None, "FINE"]


async def test_an_error_reply_is_a_redis_error_with_the_servers_message(
    redis: Redis, key: str
) -> None:
    await redis.call("SET", key, "text")
    with pytest.raises(RedisError) as caught:
        await redis.call("LPUSH", key, "x")
    assert caught.value.code == "WRONGTYPE"
    assert str(caught.value).startswith("WRONGTYPE Operation against a key")
    with pytest.raises(RedisError, match="my script says no"):
        await redis.call("EVAL", "return redis.error_reply('my script says no')", 0)
    assert await redis.call("GET", key) == b"text"  # the connection is still in step


async def test_a_script_runs_by_sha_and_is_sent_again_after_script_flush(
    redis: Redis, key: str
) -> None:
    script = Script("return redis.call('INCRBY', KEYS[1], ARGV[1])")
    assert await script.run(redis, [key], [2]) == 2
    assert await redis.call("SCRIPT", "EXISTS", script.sha) == [1]
    await redis.call("SCRIPT", "FLUSH")
    assert await script.run(redis, [key], [3]) == 5  # NOSCRIPT, then EVAL: ran once
    assert await script.run(redis, [key], [1]) == 6
    failing = Script("return redis.call('NOSUCHCOMMAND')")
    with pytest.raises(RedisError, match="Unknown Redis command"):
        await failing.run(redis, [], [])


async def test_a_script_that_failed_after_writing_is_not_sent_again(redis: Redis, key: str) -> None:
    """Only NOSCRIPT (nothing ran) sends the script whole: any other error reply may come
    after the script wrote (Redis does not undo a script's writes), so it is not run twice."""
    script = Script("redis.call('INCR', KEYS[1]) return redis.error_reply('ERR refused')")
    assert await redis.call("SCRIPT", "LOAD", script.source) == script.sha.encode()
    with pytest.raises(RedisError, match="refused"):
        await script.run(redis, [key], [])
    assert await redis.call("GET", key) == b"1", "ran once"


async def test_select_db(redis_server: RedisServer, redis: Redis, key: str) -> None:
    db3 = Settings("127.0.0.1", redis_server.port, db=3)
    async with Redis(db3, timeout=TIMEOUT) as other:
        await other.call("SET", key, "in db 3")
        assert await other.call("GET", key) == b"in db 3"
    assert await redis.call("GET", key) is None


async def test_two_hundred_calls_at_once_share_a_bounded_pool(
    redis_server: RedisServer, key: str
) -> None:
    async with Redis(parse_url(redis_server.url), timeout=TIMEOUT, max_connections=8) as redis:
        results: list[bytes] = []

        async def echo(i: int) -> None:
            results.append(await redis.call("ECHO", i))
            await redis.call("INCR", key)

        with anyio.fail_after(10):
            async with anyio.create_task_group() as group:
                for i in range(200):
                    group.start_soon(echo, i)
        assert sorted(int(r) for r in results) == list(range(200))
        assert await redis.call("GET", key) == b"200"
        assert len(redis._idle) <= 8
        clients = await redis.call("CLIENT", "LIST")
        assert clients.count(b"cmd=") <= 8  # every client of the server is this pool


# ---------------------------------------------------------------------- AUTH


async def test_auth_with_password_and_with_a_username() -> None:
    with RedisServer(password=PASSWORD) as server:
        async with Redis(parse_url(server.url), timeout=TIMEOUT) as redis:
            assert await redis.call("PING") == "PONG"
        url = f"redis://default:{PASSWORD}@127.0.0.1:{server.port}/2"
        async with Redis(parse_url(url), timeout=TIMEOUT) as redis:
            assert await redis.call("PING") == "PONG"
        async with Redis(Settings("127.0.0.1", server.port), timeout=TIMEOUT) as redis:
            with pytest.raises(RedisError, match="^NOAUTH"):
                await redis.call("PING")


async def test_a_wrong_password_is_a_clear_error_without_the_password() -> None:
    with RedisServer(password=PASSWORD) as server:
        wrong = "not-" + PASSWORD
        settings = Settings("127.0.0.1", server.port, password=wrong)
        async with Redis(settings, timeout=TIMEOUT) as redis:
            with pytest.raises(RedisError) as caught:
                await redis.call("PING")
    message = str(caught.value)
    assert caught.value.code == "WRONGPASS"
    assert message.endswith(f" (AUTH on connecting to redis 127.0.0.1:{server.port})")
    assert wrong not in message and wrong not in repr(caught.value)
    assert wrong not in repr(settings) and wrong not in settings.safe_url


# ---------------------------------------------------------------------- failures


async def test_nothing_listening_is_unavailable_naming_the_address() -> None:
    port = free_port()
    async with Redis(Settings("127.0.0.1", port, password="pw"), timeout=TIMEOUT) as redis:
        with pytest.raises(RedisUnavailable, match=f"redis 127.0.0.1:{port}: cannot connect: "):
            await redis.call("PING")


async def test_no_reply_within_the_timeout_is_unavailable_and_closes_the_connection(
    redis_server: RedisServer, key: str
) -> None:
    async with Redis(parse_url(redis_server.url), timeout=0.3) as redis:
        started = anyio.current_time()
        with pytest.raises(RedisUnavailable, match=r"no reply within 0\.3 s"):
            await redis.call("BLPOP", key, 5)
        assert anyio.current_time() - started < 1.5
        assert not redis._idle
        await redis.call("LPUSH", key, "x")
        assert await redis.call("LLEN", key) == 1  # the abandoned BLPOP took nothing


async def test_a_timer_run_out_as_its_reply_came_fails_no_later_call(
    redis: Redis, anyio_backend: str
) -> None:
    if anyio_backend != "asyncio":
        pytest.skip("an asyncio loop's connections only: trio's are timed by cancel scopes")
    assert await redis.call("ECHO", "a") == b"a"
    conn = redis._idle[-1]
    # The last call's timer ran out in the loop round its reply came in: it had its reply,
    # and the connection went back to the pool. Before, the next call on it raised "no
    # reply within" at once.
    conn._expire()  # type: ignore[union-attr]
    assert await redis.call("ECHO", "b") == b"b"
    assert redis._idle == [conn]


async def test_a_cancelled_call_leaves_the_pool_usable(redis: Redis, key: str) -> None:
    await redis.call("PING")
    with anyio.move_on_after(0.2) as scope:
        await redis.call("BLPOP", key, 5)
    assert scope.cancelled_caught  # the cancellation itself, not a RedisUnavailable
    assert not redis._idle  # its connection, with a reply to come, was closed

    async def nobody_blocked() -> bool:
        info: bytes = await redis.call("INFO", "clients")
        return b"blocked_clients:0\r\n" in info

    await wait_until(nobody_blocked, "the cancelled BLPOP's connection to go")
    await redis.call("LPUSH", key, "x")
    assert await redis.call("LLEN", key) == 1
    for i in range(20):
        assert await redis.call("ECHO", i) == b"%d" % i


async def test_a_killed_server_is_unavailable_at_once_and_a_restarted_one_serves_again(
    own_server: RedisServer, key: str
) -> None:
    async with Redis(parse_url(own_server.url), timeout=TIMEOUT) as redis:
        await redis.call("SET", key, "before")

        async def kill_soon() -> None:
            await anyio.sleep(0.2)
            own_server.kill()

        started = anyio.current_time()
        async with anyio.create_task_group() as group:
            group.start_soon(kill_soon)
            with pytest.raises(RedisUnavailable, match="connection lost: the server closed"):
                await redis.call("BLPOP", key + ":list", 30)  # blocks until the kill
        assert anyio.current_time() - started < 2
        with pytest.raises(RedisUnavailable, match="cannot connect"):
            await redis.call("PING")
        own_server.start()
        assert await redis.call("GET", key) is None  # a restart without persistence


@pytest.mark.parametrize("how", ["stop", "kill"])
async def test_pooled_connections_to_a_restarted_server_are_replaced(
    own_server: RedisServer, key: str, how: str
) -> None:
    async with Redis(parse_url(own_server.url), timeout=TIMEOUT) as redis:
        async with anyio.create_task_group() as group:
            for _ in range(4):  # at once, so four connections
                group.start_soon(redis.call, "BLPOP", key + ":none", 0.1)
        assert len(redis._idle) == 4
        script = Script("return redis.call('INCR', KEYS[1])")
        assert await script.run(redis, [key], []) == 1
        getattr(own_server, how)()
        own_server.start()
        # Every pooled connection is dead; none is used, and the script is sent again.
        for count in range(1, 5):
            assert await script.run(redis, [key], []) == count


async def test_a_frozen_server_times_out_instead_of_hanging(own_server: RedisServer) -> None:
    async with Redis(parse_url(own_server.url), timeout=0.5) as redis:
        await redis.call("PING")
        os.kill(own_server.pid, signal.SIGSTOP)
        try:
            started = anyio.current_time()
            for _ in range(2):  # a pooled connection, then a new one (accepted by the kernel)
                with pytest.raises(RedisUnavailable, match=r"no reply within 0\.5 s"):
                    await redis.call("PING")
            assert anyio.current_time() - started < 3
        finally:
            os.kill(own_server.pid, signal.SIGCONT)
        assert await redis.call("PING") == "PONG"


async def test_a_closed_client_refuses_calls(redis_server: RedisServer) -> None:
    redis = Redis(parse_url(redis_server.url), timeout=TIMEOUT)
    await redis.call("PING")
    await redis.aclose()
    assert not redis._idle
    with pytest.raises(RedisUnavailable, match="the client is closed"):
        await redis.call("PING")


# ---------------------------------------------------------------------- pub/sub


async def test_pubsub_receives_messages_and_reports_a_lost_connection(
    own_server: RedisServer,
) -> None:
    async with Redis(parse_url(own_server.url), timeout=TIMEOUT) as redis:
        with pytest.raises(ValueError, match="at least one channel"):
            async with redis.subscribe():
                pass
        async with redis.subscribe("slots", b"other") as subscription:
            assert await redis.call("PUBLISH", "slots", b"freed:\x00") == 1
            await redis.call("PUBLISH", "other", "2")
            with anyio.fail_after(5):
                assert await subscription.next_message() == (b"slots", b"freed:\x00")
                assert await subscription.next_message() == (b"other", b"2")
            with anyio.move_on_after(0.1) as scope:
                await subscription.next_message()
            assert scope.cancelled_caught  # and the subscription goes on
            await redis.call("PUBLISH", "other", "3")
            with anyio.fail_after(5):
                assert await subscription.next_message() == (b"other", b"3")
            own_server.kill()
            with anyio.fail_after(5), pytest.raises(RedisUnavailable, match="subscription lost"):
                await subscription.next_message()


# ---------------------------------------------------------------------- TLS


async def test_rediss_speaks_tls_and_sees_a_restart_through_it() -> None:
    ca = trustme.CA()
    with RedisServer(password=PASSWORD, tls=ca.issue_cert("127.0.0.1")) as server:
        settings = parse_url(server.url)
        assert settings.tls
        context = ssl.create_default_context()
        ca.configure_trust(context)
        async with Redis(settings, timeout=TIMEOUT, ssl_context=context) as redis:
            assert await redis.call("ECHO", b"x" * 100_000) == b"x" * 100_000
            assert await redis.call("PING") == "PONG"  # the pooled connection
            for restart in (server.kill, server.stop):
                restart()
                server.start()
                assert await redis.call("PING") == "PONG"  # a new connection
        async with Redis(settings, timeout=TIMEOUT) as redis:  # the system's CAs: refused
            with pytest.raises(RedisUnavailable, match="cannot connect: .*certificate verify"):
                await redis.call("PING")


async def test_bytes_beyond_a_reply_close_the_connection_and_answer_no_later_call(
    redis_server: RedisServer, key: str
) -> None:
    """A reply came with more after it (a proxy or a server out of step): the connection is
    closed, not pooled, lest the bytes that followed be read as the next command's reply."""
    proxy = DroppingProxy(redis_server.port)
    async with anyio.create_task_group() as tg:
        port = await tg.start(proxy.serve)
        async with Redis(Settings("127.0.0.1", port), timeout=TIMEOUT) as redis:
            await redis.call("SET", key, "real")
            proxy.lying = b":1\r\n:2\r\n"  # two replies where one was asked for
            assert await redis.call("PING") == 1
            proxy.lying = None
            assert not redis._idle, "the connection out of step was closed"
            for _ in range(3):
                assert await redis.call("GET", key) == b"real"
        tg.cancel_scope.cancel()

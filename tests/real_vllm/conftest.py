"""Fixtures for tests that drive real vLLM engines (see engines.py in this folder).

``vllm_pair`` (package scope) starts one prefill (kv_producer) + decode (kv_consumer) pair
for all the tests in this folder and stops both after the last of them, so that the rest
of the session does not run next to two engines (~3 GB RSS and a busy CPU each). Starting
it takes 1-2 minutes (plus ~3 min the very first time, to install the vLLM venv), so tests
that use it get a ``pytest.mark.timeout(900)`` unless they carry their own timeout marker:
pytest-timeout counts fixture set-up against the first test that requests the fixture.

The prefill engines publish their KV cache events (``--kv-events-config``, ZMQ on
``engine.kv_events_port``; only routers given ``kv_events=PORT`` subscribe) and run in
vLLM's dev mode (``/reset_prefix_cache``). The engines run with ``--api-key
ENGINE_API_KEY`` and ``--block-size 32`` (the CPU default is 128): prefix caching works on
full blocks only, and 32 makes ``cached_tokens`` observable with prompts of a few hundred
tokens. The KV lease and the HTTP keep-alive are raised (see ``KV_LEASE`` and
``ENGINE_KEEP_ALIVE``) so that the machine's stalls do not fail the tests.

A test marked ``breaks_vllm_pair`` (it stops an engine for good) runs after every other
test that uses the pair.

This machine can stand still for minutes (the kernel logs workqueue lockups on both vCPUs),
and vLLM does not always live through it: its NIXL handshake gives up after 5 s (a constant
in vLLM), and an engine whose model worker has not answered for 300 s ends itself. So a
test that uses the pair runs again (up to ``RERUNS`` times) if it fails, on a pair restarted
if an engine has exited (``VllmPair.revive``); the report of a failure lists each engine's
state and last errors, which tell a router fault from the machine's. A test that fails every
time fails.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Generator, Iterator

import pytest

from tests.real_vllm import engines
from tests.real_vllm.engines import VllmPair

REAL_VLLM_TIMEOUT = 900
BLOCK_SIZE = 32
# The prefill engine's KV lease (vLLM's default is 30 s). Longer, because this machine can
# stall for tens of seconds (measured: 10-40 s several times an hour while two CPU engines
# and other work share its 2 cores, a `sleep 5` loop included), and because the pair's
# first NIXL handshake, ~0.6 s on a quiet machine, took 2 min in a loaded CI run: its KV
# expired 4 s before the decode engine pulled it (the prefill log said so), and a later
# test saw the expiry counter move. A stall must not turn into expired KV. Tests check that
# KV is freed far sooner than any lease.
KV_LEASE = 300
# The engines' HTTP keep-alive (vLLM's default is 5 s). The router drops idle upstream
# connections after 4 s, before the engine does; a long stall of this machine could still
# let the engine close one the router is about to reuse, so the engines wait longer here.
ENGINE_KEEP_ALIVE = 75
# The pair runs with vLLM's --api-key, so every /v1/ request needs it (its /health and
# /metrics do not): the routers of the suite send it with --engine-api-key, and one test
# shows what a wrong one does. It costs no engine start of its own.
ENGINE_API_KEY = "pd-router-suite-engine-key"
BREAKS_PAIR = "breaks_vllm_pair"
# The test that meets the pair's first NIXL handshake: it runs before every other one.
FIRST_ON_PAIR = "first_on_vllm_pair"
# The fixture of a second prefill engine (see ``vllm_pair``).
SECOND_PREFILL = "second_prefill"
WORKER = "PYTEST_XDIST_WORKER"
# Runs after a failure. Two, because a CI run met two faults of the machine in a row: the
# first NIXL handshake timed out, and the rerun's router process stalled before it could
# answer.
RERUNS = 2
# The words of the tests' prompts (``prompt``).
WORDS = (
    "router prefill decode engine block cache key value token stream lease slot queue "
    "pull transfer loopback handshake greedy batch prompt answer usage metric abort"
).split()
# What makes this run's prompts its own: a test run again (``pytest-rerunfailures``) must
# find none of its prompts cached, on either engine, as its first run did. A CI run reran
# the 16-request test after a stall had failed it: the decode engine found the first run's
# prompts in its own cache and pulled 264 of 1,672 tokens, so both reruns failed too.
_run = {"salt": ""}


@pytest.fixture(autouse=True)
def _prompts_of_their_own() -> None:
    _run["salt"] = os.urandom(3).hex()


def prompt(tag: str, words: int = 12) -> str:
    """A prompt of its own for each tag and run of a test: no prefix shared with another
    test's prompts, or with an earlier run's."""
    tag = f"{tag}-{_run['salt']}"
    return " ".join([tag] + [WORDS[(i * 7 + len(tag)) % len(WORDS)] for i in range(words)])


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", f"{BREAKS_PAIR}: stops an engine of the shared vLLM pair; runs last"
    )
    config.addinivalue_line(
        "markers", f"{FIRST_ON_PAIR}: meets the vLLM pair's first NIXL handshake; runs first"
    )


def _uses_pair(item: pytest.Item) -> bool:
    return "vllm_pair" in getattr(item, "fixturenames", ())


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if not _uses_pair(item):
            continue
        if not item.get_closest_marker("timeout"):
            item.add_marker(pytest.mark.timeout(REAL_VLLM_TIMEOUT))
        item.add_marker(pytest.mark.flaky(reruns=RERUNS))
    # The tests that use the pair go last in the session, so that xdist (one worker for
    # this folder, see tests/conftest.py) hands them out once every other test is: the
    # engines (a busy core each, even idle) hardly share the machine with the rest of the
    # suite. Among them, the ones that need a second prefill engine go right after the
    # first (which must meet the pair's first NIXL handshake), so that engine can stop
    # early; the ones that break the pair go last.
    pair_items = [item for item in items if _uses_pair(item)]
    items[:] = [item for item in items if not _uses_pair(item)]
    items += sorted(pair_items, key=_pair_order)


def _pair_order(item: pytest.Item) -> int:
    if item.get_closest_marker(BREAKS_PAIR):
        return 3
    if item.get_closest_marker(FIRST_ON_PAIR):
        return 0
    return 1 if SECOND_PREFILL in getattr(item, "fixturenames", ()) else 2


@pytest.fixture(scope="session", autouse=True)
def _progress_on_the_terminal(pytestconfig: pytest.Config) -> None:
    """The minutes of installing and starting engines say what they do, live."""
    terminal = pytestconfig.pluginmanager.get_plugin("terminalreporter")
    capture = pytestconfig.pluginmanager.get_plugin("capturemanager")
    if terminal is None or capture is None:
        return

    def say(message: str) -> None:
        # Output is captured while fixtures set up, the terminal's included: let it through.
        # An xdist worker's terminal goes nowhere; its stderr is the run's.
        with capture.global_and_fixture_disabled():
            if WORKER in os.environ:
                print(f"[real vLLM] {message}", file=sys.stderr, flush=True)
            else:
                terminal.write_line(f"[real vLLM] {message}")

    engines.progress = say


# The pair of this session, once started: a failed test's report describes it.
_started: list[VllmPair] = []


@pytest.fixture(scope="package")
def vllm_pair(
    tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest
) -> Iterator[VllmPair]:
    """The pair, and a second prefill engine started with it if a test of this session
    asks for one (``second_prefill``): three engines starting at once take less than the
    pair and then the third (130-210 s alone next to the idle pair, which polls both cores),
    and the third stops when its test ends (those tests run right after the first)."""
    spare = any(SECOND_PREFILL in getattr(i, "fixturenames", ()) for i in request.session.items)
    with VllmPair(
        tmp_path_factory.mktemp("vllm-pair"),
        extra_args=["--block-size", str(BLOCK_SIZE), "--api-key", ENGINE_API_KEY],
        kv_extra_config={"kv_lease_duration": KV_LEASE},
        # Dev mode: /reset_prefix_cache, which the KV events test clears the cache with.
        extra_env={
            "VLLM_HTTP_TIMEOUT_KEEP_ALIVE": str(ENGINE_KEEP_ALIVE),
            "VLLM_SERVER_DEV_MODE": "1",
        },
        spare_prefills=int(spare),
        kv_events=True,
    ) as pair:
        _started.append(pair)
        try:
            yield pair
        finally:
            _started.remove(pair)


@pytest.fixture(autouse=True)
def _live_pair(request: pytest.FixtureRequest) -> None:
    """Runs before each test's own function-scoped fixtures: a pair with an engine that has
    exited is restarted, and the module's router (if the test uses it) is given time to
    find both engines serving again."""
    if not _uses_pair(request.node):
        return
    pair: VllmPair = request.getfixturevalue("vllm_pair")
    if pair.revive() and "router" in request.fixturenames:
        request.getfixturevalue("router").wait_healthy(timeout=120)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    report = yield
    if report.failed and _uses_pair(item) and _started:
        report.sections.append(("real vLLM engines", _started[-1].diagnosis()))
    return report

"""Fixtures for tests that drive real vLLM engines (see engines.py in this folder).

``vllm_pair`` (package scope) starts one prefill (kv_producer) + decode (kv_consumer) pair
for all the tests in this folder and stops both after the last of them, so that the rest
of the session does not run next to two engines (~3 GB RSS and a busy CPU each). Starting
it takes 1-2 minutes (plus ~3 min the very first time, to install the vLLM venv), so tests
that use it get a ``pytest.mark.timeout(900)`` unless they carry their own timeout marker:
pytest-timeout counts fixture set-up against the first test that requests the fixture.

The engines run with ``--api-key ENGINE_API_KEY`` and ``--block-size 32`` (the CPU
default is 128): prefix caching works on
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
# Runs after a failure. Two, because a CI run met two faults of the machine in a row: the
# first NIXL handshake timed out, and the rerun's router process stalled before it could
# answer.
RERUNS = 2


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", f"{BREAKS_PAIR}: stops an engine of the shared vLLM pair; runs last"
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
    # Tests that break the pair go after the others that use it, in the same places of the
    # session order (the rest of the session is not reordered).
    slots = [i for i, item in enumerate(items) if _uses_pair(item)]
    pair_items = [items[i] for i in slots]
    ordered = [it for it in pair_items if not it.get_closest_marker(BREAKS_PAIR)]
    ordered += [it for it in pair_items if it.get_closest_marker(BREAKS_PAIR)]
    for i, item in zip(slots, ordered):
        items[i] = item


@pytest.fixture(scope="session", autouse=True)
def _progress_on_the_terminal(pytestconfig: pytest.Config) -> None:
    """The minutes of installing and starting engines say what they do, live."""
    terminal = pytestconfig.pluginmanager.get_plugin("terminalreporter")
    capture = pytestconfig.pluginmanager.get_plugin("capturemanager")
    if terminal is None or capture is None:
        return

    def say(message: str) -> None:
        # Output is captured while fixtures set up, the terminal's included: let it through.
        with capture.global_and_fixture_disabled():
            terminal.write_line(f"[real vLLM] {message}")

    engines.progress = say


# The pair of this session, once started: a failed test's report describes it.
_started: list[VllmPair] = []


@pytest.fixture(scope="package")
def vllm_pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmPair]:
    with VllmPair(
        tmp_path_factory.mktemp("vllm-pair"),
        extra_args=["--block-size", str(BLOCK_SIZE), "--api-key", ENGINE_API_KEY],
        kv_extra_config={"kv_lease_duration": KV_LEASE},
        extra_env={"VLLM_HTTP_TIMEOUT_KEEP_ALIVE": str(ENGINE_KEEP_ALIVE)},
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

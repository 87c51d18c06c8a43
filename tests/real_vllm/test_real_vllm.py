"""pd-router in front of a real vLLM prefill/decode pair (NixlConnector over loopback).

What these tests prove, with the engines' own counters as the witness:

* the first request after the pair starts succeeds with the router's default flags, though
  the first NIXL handshake keeps the decode engine's /health slow (slow is not dead);

* the decode engine used the KV the prefill engine computed: for every request through
  the router it counts one NIXL transfer and computes **no** prompt token itself (every
  prompt token came over NIXL or from its own prefix cache), while the prefill engine
  computed them; and greedy output equals a single engine's (the prefill engine answering
  the same request without ``kv_transfer_params``) token for token;
* usage is right: ``prompt_tokens`` as a single engine counts them, ``cached_tokens`` as the
  prefill engine counts them (not as the decode engine would);
* 16 concurrent requests each get their own prompt's continuation;
* with two prefill engines, the default ``prefix`` policy reports more ``cached_tokens``
  for a conversation workload than ``round_robin``;
* a client that hangs up makes the decode engine abort, leaves no KV pinned on the prefill
  engine, and leaves every router slot free;
* a dead prefill engine gives clear errors at once, and the rest keeps working.

The pair is started once for this folder (``conftest.py``, ``--block-size 32``) and the
router once for this module. Engines are compared by counter *deltas* around each step,
so the tests run one at a time against otherwise idle engines; the router's health probes
do not move any of the counters used.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import os
import signal
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.helpers import RawClient, RouterProcess, wait_for
from tests.real_vllm.conftest import BLOCK_SIZE, ENGINE_API_KEY, KV_LEASE, prompt
from tests.real_vllm.engines import VllmPair, decode_body, http_get, prefill_body

pytestmark = pytest.mark.real_vllm

MODEL = "tiny"
# Greedy, a fixed number of tokens, and the token ids in the answer (vLLM extensions).
EXTRA_BODY = {"ignore_eos": True, "return_token_ids": True}
HANDOFF_GRACE = 5.0  # the router's default --handoff-grace
# The admin API of the routers under test: a failed test prints what was in flight.
ADMIN_TOKEN = "real-vllm-admin"
LONG = 400  # max_tokens that take seconds to generate (max-model-len is 512)
# max_tokens of the stream that outlives the prefill engine: long enough that a stall of a few
# seconds between its first tokens and the kill does not let it end first
DYING = LONG
# A loaded 2-core machine that can stall for tens of seconds: give engines time, but bound
# every wait. In one CI run the whole machine stood still for minutes (the router's loop
# ran 68 s and then 33 s late, the decode engine logged nothing for 4 min) and a stream's
# first byte came after 221 s.
CLIENT_TIMEOUT = 300.0
SETTLE = 60.0
# Tries of a scenario whose timing the machine can defeat (it is not the router's to miss).
ATTEMPTS = 3


# Sample names on the engines' /metrics (vLLM 0.32).
XFERS = "vllm:nixl_xfer_time_seconds_count"
FAILED_XFERS = "vllm:nixl_num_failed_transfers_total"
EXPIRED = "vllm:nixl_num_kv_expired_reqs_total"
PROMPT_BY_SOURCE = "vllm:prompt_tokens_by_source_total"
CACHED_PROMPT = "vllm:prompt_tokens_cached_total"
GENERATED = "vllm:generation_tokens_total"
FINISHED = "vllm:request_success_total"
RUNNING = "vllm:num_requests_running"
WAITING = "vllm:num_requests_waiting"
KV_USAGE = "vllm:kv_cache_usage_perc"


# --------------------------------------------------------------------------------------
# Engine counters
# --------------------------------------------------------------------------------------


class Metrics:
    """One scrape of an engine's /metrics: ``m[name]`` sums the samples of ``name`` (any
    labels), ``m.get(name, source="...")`` only those with these labels."""

    def __init__(self, url: str) -> None:
        with urllib.request.urlopen(f"{url}/metrics", timeout=30) as response:  # nosec B310
            text = response.read().decode()
        self.samples: list[tuple[str, dict[str, str], float]] = [
            (sample.name, sample.labels, sample.value)
            for family in text_string_to_metric_families(text)
            for sample in family.samples
        ]

    def get(self, name: str, **labels: str) -> float:
        return sum(
            value
            for sample, sample_labels, value in self.samples
            if sample == name and all(sample_labels.get(k) == v for k, v in labels.items())
        )

    def __getitem__(self, name: str) -> float:
        return self.get(name)


class Engine:
    """An engine's URL and counter deltas since a mark."""

    def __init__(self, role: str, url: str) -> None:
        self.role = role
        self.url = url
        self.before = Metrics(url)

    def mark(self) -> None:
        self.before = Metrics(self.url)

    def now(self) -> Metrics:
        return Metrics(self.url)

    def delta(self, name: str, **labels: str) -> float:
        return self.now().get(name, **labels) - self.before.get(name, **labels)

    def computed(self) -> float:
        """Prompt tokens this engine computed itself since the mark."""
        return self.delta(PROMPT_BY_SOURCE, source="local_compute")

    def pulled(self) -> float:
        """Prompt tokens this engine got over NIXL since the mark."""
        return self.delta(PROMPT_BY_SOURCE, source="external_kv_transfer")

    def local_hits(self) -> float:
        return self.delta(PROMPT_BY_SOURCE, source="local_cache_hit")

    def idle(self) -> bool:
        now = self.now()
        return now[RUNNING] == 0 and now[WAITING] == 0

    def pinned(self) -> float:
        """Fraction of KV blocks in use: on an idle prefill engine, the blocks it keeps
        for a decode engine to pull."""
        return self.now()[KV_USAGE]


def settle(check: Callable[[], bool], what: str, timeout: float = SETTLE) -> None:
    """Counters are updated from the engine's output loop: give them a moment. Polls
    gently (each check scrapes an engine) and checks once more after the deadline, so that
    a stall of the whole machine does not fail a condition that holds right after it."""
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.2)


@dataclass
class Engines:
    prefill: Engine
    decode: Engine

    def mark(self) -> None:
        self.prefill.mark()
        self.decode.mark()

    def assert_pd(self, requests: int, prompt_tokens: int) -> None:
        """``requests`` P/D requests with ``prompt_tokens`` prompt tokens in all went
        through since the mark, and the decode engine used the prefill engine's KV."""
        decode = self.decode
        settle(
            lambda: decode.delta(XFERS) >= requests
            and decode.pulled() + decode.local_hits() >= prompt_tokens,
            f"{requests} NIXL transfers on the decode engine",
        )
        assert decode.delta(XFERS) == requests, "one KV transfer per request"
        assert decode.delta(FAILED_XFERS) == 0
        assert decode.computed() == 0, "the decode engine computed prompt tokens itself"
        assert decode.pulled() + decode.local_hits() == prompt_tokens
        assert decode.pulled() > 0
        assert self.prefill.delta(EXPIRED) == 0, "KV left to expire on the prefill engine"


# --------------------------------------------------------------------------------------
# Requests
# --------------------------------------------------------------------------------------


@dataclass
class Answer:
    token_ids: list[int]
    usage: Any
    finish_reason: str | None

    @property
    def cached(self) -> int | None:
        details = self.usage.prompt_tokens_details
        return None if details is None else details.cached_tokens


def _request(endpoint: str, text: str, max_tokens: int) -> dict[str, Any]:
    kwargs: dict[str, Any] = {
        "model": MODEL,
        "max_tokens": max_tokens,
        "temperature": 0,
        "extra_body": EXTRA_BODY,
    }
    if endpoint == "chat":
        kwargs["messages"] = [{"role": "user", "content": text}]
    else:
        kwargs["prompt"] = text
    return kwargs


def _create(client: openai.OpenAI | openai.AsyncOpenAI, endpoint: str) -> Any:
    return client.chat.completions.create if endpoint == "chat" else client.completions.create


class _Collector:
    """Token ids, usage and finish reason from a stream's chunks."""

    def __init__(self) -> None:
        self.ids: list[int] = []
        self.usage: Any = None
        self.finish: str | None = None

    def feed(self, chunk: Any) -> None:
        if chunk.usage is not None:
            self.usage = chunk.usage
        for choice in chunk.choices:
            self.ids.extend(getattr(choice, "token_ids", None) or [])
            self.finish = choice.finish_reason or self.finish

    def answer(self) -> Answer:
        return Answer(self.ids, self.usage, self.finish)


def ask(
    client: openai.OpenAI, endpoint: str, text: str, max_tokens: int, stream: bool = False
) -> Answer:
    kwargs = _request(endpoint, text, max_tokens)
    if not stream:
        response = _create(client, endpoint)(**kwargs)
        choice = response.choices[0]
        return Answer(list(choice.token_ids), response.usage, choice.finish_reason)
    collector = _Collector()
    for chunk in _create(client, endpoint)(
        **kwargs, stream=True, stream_options={"include_usage": True}
    ):
        collector.feed(chunk)
    return collector.answer()


async def ask_async(
    client: openai.AsyncOpenAI, endpoint: str, text: str, max_tokens: int, stream: bool
) -> Answer:
    kwargs = _request(endpoint, text, max_tokens)
    if not stream:
        response = await _create(client, endpoint)(**kwargs)
        choice = response.choices[0]
        return Answer(list(choice.token_ids), response.usage, choice.finish_reason)
    collector = _Collector()
    async for chunk in await _create(client, endpoint)(
        **kwargs, stream=True, stream_options={"include_usage": True}
    ):
        collector.feed(chunk)
    return collector.answer()


def client_for(url: str) -> openai.OpenAI:
    """A client of the router or, with the engines' key, straight of an engine (the router
    has no --api-keys-file here: it ignores the key, and never passes it on)."""
    return openai.OpenAI(
        base_url=f"{url}/v1", api_key=ENGINE_API_KEY, max_retries=0, timeout=CLIENT_TIMEOUT
    )


def post_json(url: str, body: dict[str, Any]) -> dict[str, Any]:
    """Straight to an engine, bypassing the router."""
    headers = {"Content-Type": "application/json", "Authorization": f"Bearer {ENGINE_API_KEY}"}
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers=headers)
    with urllib.request.urlopen(request, timeout=CLIENT_TIMEOUT) as response:  # nosec B310
        answer: dict[str, Any] = json.loads(response.read())
    return answer


def outcomes(router: RouterProcess, outcome: str) -> float:
    return sum(
        value
        for key, value in router.metrics().items()
        if key.startswith("pd_router_requests_total{") and f"outcome={outcome}" in key
    )


# --------------------------------------------------------------------------------------
# Fixtures
# --------------------------------------------------------------------------------------


@contextlib.contextmanager
def router_for(
    vllm_pair: VllmPair, prefill: list[str], *args: str, log_name: str = "router.log"
) -> Iterator[RouterProcess]:
    """The router under test in front of ``prefill`` and the pair's decode engine; its log
    is kept in the pair's work dir as ``log_name`` (``NAME-2.log``... for a test's rerun:
    the failed run's stays beside it)."""
    log_path = None
    if vllm_pair.work_dir is not None:
        stem, suffix = os.path.splitext(log_name)
        numbered = (f"{stem}-{run}{suffix}" for run in itertools.count(2))
        names = itertools.chain([log_name], numbered)
        log_path = next(path for n in names if not (path := vllm_pair.work_dir / n).exists())
    # Engine timeouts longer than the machine's stalls (10-40 s measured): a timer that
    # runs out during a stall fires as soon as it ends, whatever the engine did.
    router = RouterProcess(
        prefill,
        [vllm_pair.decode_url],
        "--admin-token", ADMIN_TOKEN,
        "--decode-slots", "16",
        "--queue-timeout", "60",
        "--connect-timeout", "60",
        "--health-timeout", "60",
        "--stall-timeout", "120",
        "--handoff-grace", str(HANDOFF_GRACE),
        "--engine-api-key", ENGINE_API_KEY,
        *args,
        log_path=log_path,
    )  # fmt: skip
    router.start()
    try:
        router.wait_healthy(timeout=120)
        yield router
    except BaseException:
        # Where each request was when the test failed (pytest shows what is printed): a
        # request stuck in one phase says which side it waits on.
        with contextlib.suppress(OSError):
            request = urllib.request.Request(
                f"{router.url}/admin/requests", headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}
            )
            with urllib.request.urlopen(request, timeout=10) as answer:  # nosec B310
                print(f"in flight on the router at the failure: {answer.read().decode()}")
        raise
    finally:
        router.stop()


@pytest.fixture(scope="module")
def router(vllm_pair: VllmPair) -> Iterator[RouterProcess]:
    with router_for(vllm_pair, [vllm_pair.prefill_url]) as router:
        yield router


@pytest.fixture
def engines(vllm_pair: VllmPair, router: RouterProcess) -> Iterator[Engines]:
    """Both engines, idle, with counters marked; the router idle before and after."""
    found = Engines(
        Engine("prefill", vllm_pair.prefill_url), Engine("decode", vllm_pair.decode_url)
    )
    settle(lambda: found.prefill.idle() and found.decode.idle(), "idle engines")
    # A failed NIXL handshake (see conftest) leaves the request's KV on the prefill engine
    # until its lease ends; the tests that check freeing KV do so themselves, in seconds.
    settle(
        lambda: found.prefill.pinned() == 0,
        "no KV pinned on the prefill engine",
        timeout=KV_LEASE + SETTLE,
    )
    router.assert_idle()
    found.mark()
    yield found
    router.assert_idle()


@pytest.fixture(scope="module")
def baseline(vllm_pair: VllmPair) -> openai.OpenAI:
    """The prefill engine answering alone (no kv_transfer_params): a plain engine."""
    return client_for(vllm_pair.baseline_url)


# --------------------------------------------------------------------------------------
# 0: the first requests after the pair starts (first NIXL handshake, ~18 s on this machine,
#    during which the decode engine's /health does not answer within 1 s)
# --------------------------------------------------------------------------------------


@pytest.mark.first_on_vllm_pair
def test_the_first_request_after_the_pair_starts_succeeds_with_default_flags(
    vllm_pair: VllmPair,
) -> None:
    """Runs first: nothing has gone through the pair yet, so this request makes the first
    NIXL handshake (~18 s here), during which the decode engine's /health is slow. A busy
    engine is slow, not dead: its probes may time out and make it unhealthy, but no
    request in flight is failed, and with no other node the unhealthy one still takes new
    requests. (Several requests at once during and just after the handshake twice left a
    request's KV on the prefill engine until its lease ran out, which showed in a later
    test's expiry counter: a vLLM matter, kept out of this suite.)"""
    engine_key = ("--engine-api-key", ENGINE_API_KEY)
    with RouterProcess([vllm_pair.prefill_url], [vllm_pair.decode_url], *engine_key) as router:
        first = ask(client_for(router.url), "completions", prompt("cold-first"), 8)
        assert len(first.token_ids) == 8 and first.finish_reason == "length"
        assert outcomes(router, "ok") == 1
        assert "is dead" not in router.log(), router.log()[-3000:]
        router.assert_idle()


# --------------------------------------------------------------------------------------
# 1 + 2: same tokens as a single engine, right usage, the KV came from the prefill engine
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_answer_equals_a_single_engines_and_decode_used_the_prefill_kv(
    router: RouterProcess,
    engines: Engines,
    baseline: openai.OpenAI,
    endpoint: str,
    stream: bool,
) -> None:
    text = prompt(f"first-{endpoint}-{stream}", words=40)
    answer = ask(client_for(router.url), endpoint, text, max_tokens=12, stream=stream)

    usage = answer.usage
    assert usage is not None, "no usage in the answer"
    # The prefill engine computed the whole (new) prompt, the decode engine none of it:
    # it pulled every prompt token over NIXL.
    settle(lambda: engines.prefill.computed() >= usage.prompt_tokens, "prefill counters")
    assert engines.prefill.computed() == usage.prompt_tokens
    engines.assert_pd(requests=1, prompt_tokens=usage.prompt_tokens)
    assert engines.decode.pulled() == usage.prompt_tokens

    alone = ask(baseline, endpoint, text, max_tokens=12)
    assert answer.token_ids == alone.token_ids
    assert len(answer.token_ids) == 12 and answer.finish_reason == "length"
    assert usage.prompt_tokens == alone.usage.prompt_tokens
    assert usage.completion_tokens == 12
    assert usage.total_tokens == usage.prompt_tokens + 12
    # Nothing of this prompt was cached anywhere before.
    assert answer.cached == 0


def test_cached_tokens_are_what_the_prefill_engine_had_cached(
    router: RouterProcess, engines: Engines, baseline: openai.OpenAI
) -> None:
    """``cached_tokens`` is the prefill engine's count, never the decode engine's: the
    cases where the two engines' caches differ tell them apart."""
    client = client_for(router.url)
    prefill, decode = engines.prefill, engines.decode
    # Long enough for several full blocks: a hit is at most floor((n - 1) / 32) * 32.
    warm_prefill, warm_decode = prompt("cache-p", words=60), prompt("cache-d", words=60)

    # 1. Cached on the prefill engine only (it answered the prompt alone before).
    alone = ask(baseline, "completions", warm_prefill, max_tokens=4)
    expected_hit = (alone.usage.prompt_tokens - 1) // BLOCK_SIZE * BLOCK_SIZE
    assert alone.cached == 0 and expected_hit >= 2 * BLOCK_SIZE
    engines.mark()
    first = ask(client, "completions", warm_prefill, max_tokens=4)
    engines.assert_pd(requests=1, prompt_tokens=first.usage.prompt_tokens)
    assert decode.local_hits() == 0, "the decode engine had none of it"
    assert prefill.delta(CACHED_PROMPT) == expected_hit
    assert first.cached == expected_hit
    assert first.token_ids == alone.token_ids

    # 2. The same prompt again: now both engines have it.
    engines.mark()
    again = ask(client, "completions", warm_prefill, max_tokens=4, stream=True)
    engines.assert_pd(requests=1, prompt_tokens=again.usage.prompt_tokens)
    assert decode.local_hits() > 0
    assert prefill.delta(CACHED_PROMPT) == expected_hit
    assert again.cached == expected_hit
    assert again.token_ids == alone.token_ids

    # 3. Cached on the decode engine only (it answered the prompt alone, as a plain
    # engine): the decode engine finds most of the prompt locally, the prefill engine
    # nothing, and nothing was cached as far as the client is concerned.
    direct = ask(client_for(decode.url), "completions", warm_decode, max_tokens=4)
    engines.mark()
    cold = ask(client, "completions", warm_decode, max_tokens=4)
    engines.assert_pd(requests=1, prompt_tokens=cold.usage.prompt_tokens)
    assert decode.local_hits() == (cold.usage.prompt_tokens - 1) // BLOCK_SIZE * BLOCK_SIZE
    assert prefill.computed() == cold.usage.prompt_tokens
    assert cold.cached == 0
    assert (
        cold.token_ids == direct.token_ids == ask(baseline, "completions", warm_decode, 4).token_ids
    )


# --------------------------------------------------------------------------------------
# 3: concurrency
# --------------------------------------------------------------------------------------


def test_sixteen_concurrent_requests_each_get_their_own_continuation(
    router: RouterProcess, engines: Engines, vllm_pair: VllmPair
) -> None:
    # Distinct prompts of different lengths; half streamed, half not, both endpoints.
    cases = [
        ("chat" if i % 4 == 3 else "completions", prompt(f"many-{i}", words=8 + 3 * i), i % 2 == 1)
        for i in range(16)
    ]

    async def all_at_once(url: str, stream: bool | None = None) -> list[Answer]:
        client = openai.AsyncOpenAI(
            base_url=f"{url}/v1", api_key=ENGINE_API_KEY, max_retries=0, timeout=CLIENT_TIMEOUT
        )
        try:
            return await asyncio.gather(
                *(
                    ask_async(client, endpoint, text, 10, streamed if stream is None else stream)
                    for endpoint, text, streamed in cases
                )
            )
        finally:
            await client.close()

    answers = asyncio.run(all_at_once(router.url))
    total_prompt = sum(answer.usage.prompt_tokens for answer in answers)
    engines.assert_pd(requests=16, prompt_tokens=total_prompt)
    assert engines.decode.pulled() == total_prompt

    alone = asyncio.run(all_at_once(vllm_pair.baseline_url, stream=False))
    assert len({tuple(a.token_ids) for a in alone}) == 16, "the prompts must tell answers apart"
    for i, (answer, single) in enumerate(zip(answers, alone)):
        assert answer.token_ids == single.token_ids, f"request {i} got another continuation"
        assert answer.usage.prompt_tokens == single.usage.prompt_tokens, f"request {i}"
        assert answer.cached == 0, f"request {i}"


# --------------------------------------------------------------------------------------
# 4 + 5: clients that hang up
# --------------------------------------------------------------------------------------


def _stream_body(tag: str, stream: bool = True) -> dict[str, Any]:
    return {
        "model": MODEL,
        "prompt": prompt(tag, words=20),
        "max_tokens": LONG,
        "temperature": 0,
        "ignore_eos": True,
        "stream": stream,
    }


def _assert_decode_stopped(engines: Engines, what: str, drained: bool = False) -> None:
    """The decode engine has no request left and generated far fewer than LONG tokens.

    ``drained``: the request may have ended as the router's one-token drain request.
    """
    decode = engines.decode
    settle(decode.idle, f"the decode engine to drop the request ({what})", timeout=30)
    generated = decode.delta(GENERATED)
    assert generated < LONG / 2, f"{what}: the decode engine generated {generated} tokens"
    if not drained:
        assert decode.delta(FINISHED, finished_reason="length") == 0, f"{what}: ran to the end"
    time.sleep(1.0)
    assert decode.delta(GENERATED) == generated, f"{what}: still generating"


def _assert_prefill_freed(engines: Engines, what: str) -> None:
    """The prefill engine's blocks for the request are free, well before the lease (they are
    freed within seconds once pulled; the lease is KV_LEASE)."""
    settle(lambda: engines.prefill.pinned() == 0, f"prefill KV freed ({what})", KV_LEASE / 2)
    assert engines.prefill.delta(EXPIRED) == 0, f"{what}: the KV was left to expire"


def test_client_leaving_mid_stream_aborts_the_decode_engine(
    router: RouterProcess, engines: Engines
) -> None:
    """Retried like the hang-up after prefill when a stall let the engine generate half the
    answer before the test could hang up: that would prove nothing about the abort."""
    for attempt in range(1, ATTEMPTS + 1):
        aborted = outcomes(router, "client_aborted")
        client = RawClient(router.url, "/v1/completions", _stream_body(f"mid-stream-{attempt}"))
        seen = client.read_until(b"data: ", timeout=CLIENT_TIMEOUT, count=4)
        assert seen.count(b"data: ") >= 4, seen[-500:]
        early = engines.decode.delta(GENERATED) < LONG / 2
        client.hang_up()
        if early:
            break
        settle(engines.decode.idle, "the decode engine to be idle again")
        wait_for(lambda: router.in_use() == 0, timeout=10, what="the slot")
        engines.mark()
    else:
        pytest.fail(f"half the answer was generated before the hang-up {ATTEMPTS} times")

    _assert_decode_stopped(engines, "hang-up mid-stream")
    assert engines.decode.delta(XFERS) == 1
    _assert_prefill_freed(engines, "hang-up mid-stream")
    wait_for(lambda: router.in_use() == 0, timeout=10, what="the slot")
    assert outcomes(router, "client_aborted") == aborted + 1


def test_kv_pinned_on_the_prefill_engine_shows_in_its_metrics(engines: Engines) -> None:
    """The witness for the next tests: blocks the prefill engine keeps for a decode engine
    show in ``kv_cache_usage_perc`` until a decode engine pulls them (no router here)."""
    body = _stream_body("pinned", stream=False) | {"max_tokens": 2}
    answer = post_json(engines.prefill.url + "/v1/completions", prefill_body(body))
    settle(lambda: engines.prefill.pinned() > 0, "the prefill engine to show pinned blocks")
    post_json(engines.decode.url + "/v1/completions", decode_body(body, answer))
    _assert_prefill_freed(engines, "pulled by a direct decode request")


def test_client_leaving_right_after_prefill_leaves_no_kv_pinned(
    router: RouterProcess, engines: Engines
) -> None:
    """Hang up as soon as the prefill engine has answered: the router still hands the KV
    to the decode engine (or drains it), so the prefill engine frees it at once instead of
    at the end of its lease.

    The test sees the prefill answer only through the engine's /metrics, a scrape that a
    loaded machine can stall for longer than the whole answer takes. When the router says
    the answer was complete before the hang-up (outcome ``ok``), the scenario did not
    happen: it is tried again, up to ``ATTEMPTS`` times."""
    for attempt in range(1, ATTEMPTS + 1):
        aborted, answered = outcomes(router, "client_aborted"), outcomes(router, "ok")
        done = engines.prefill.before.get(FINISHED, finished_reason="length")
        client = RawClient(router.url, "/v1/completions", _stream_body(f"after-prefill-{attempt}"))
        wait_for(
            lambda: engines.prefill.now().get(FINISHED, finished_reason="length") > done,
            timeout=CLIENT_TIMEOUT,
            what="the prefill engine to answer",
        )
        client.hang_up()
        wait_for(
            lambda: outcomes(router, "client_aborted") + outcomes(router, "ok")
            > aborted + answered,
            timeout=HANDOFF_GRACE + 10,
            what="the request to end",
        )
        if outcomes(router, "ok") == answered:
            break
        settle(engines.decode.idle, "the decode engine to be idle again")
        engines.mark()
    else:
        pytest.fail(f"the answer was complete before the hang-up {ATTEMPTS} times: too slow")

    assert outcomes(router, "client_aborted") == aborted + 1
    wait_for(lambda: router.in_use() == 0, timeout=10, what="the slot")
    _assert_prefill_freed(engines, "hang-up after prefill")
    _assert_decode_stopped(engines, "hang-up after prefill", drained=True)
    assert engines.decode.delta(FAILED_XFERS) == 0


def test_client_leaving_while_decode_engine_has_not_answered_leaves_no_kv_pinned(
    router: RouterProcess, engines: Engines
) -> None:
    """Not streamed, the decode engine answers only at the end: hanging up once it has the
    request is a hang-up inside the router's shielded hand-off. The KV is pulled, the
    request ends at most ``--handoff-grace`` later, and the slot is free."""
    client = RawClient(router.url, "/v1/completions", _stream_body("in-handoff", stream=False))
    wait_for(lambda: not engines.decode.idle(), timeout=CLIENT_TIMEOUT, what="decode to get it")
    client.hang_up()

    wait_for(lambda: router.in_use() == 0, timeout=HANDOFF_GRACE + 15, what="the slot")
    settle(engines.decode.idle, "the decode engine to finish or drop the request", 30)
    assert engines.decode.delta(XFERS) == 1, "the KV was handed over although the client left"
    assert engines.decode.delta(FAILED_XFERS) == 0
    _assert_prefill_freed(engines, "hang-up during the hand-off")


# --------------------------------------------------------------------------------------
# 6: two prefill engines: the prefix policy finds the cache that round robin misses
# --------------------------------------------------------------------------------------

# Two conversations: the second shows the first's turns were no accident; each more costs
# six requests of ~10 s (three engines share the two cores meanwhile).
CONVERSATIONS = 2
TURNS = 3
# Words of each user message: ~95 tokens with the tiny model's tokenizer (~3.5 a word), so
# a turn adds about three 32-token blocks and the third turn's prompt (~330 tokens) stays
# well inside --max-model-len 512.
TURN_WORDS = 25
REPLY_TOKENS = 2
# Direct P/D requests that warm a (prefill engine -> decode engine) NIXL handshake.
HANDSHAKE_TRIES = 5


@pytest.fixture
def second_prefill(vllm_pair: VllmPair) -> Iterator[str]:
    """A second prefill engine with the pair's settings, for one test: stopped when the
    test ends, whatever happens (a rerun starts a new one)."""
    with vllm_pair.another_prefill() as engine:
        yield engine.url


def warm_handshake(prefill_url: str, decode_url: str) -> None:
    """A P/D request straight to the engines, tried until the decode engine answers 200.

    The decode engine's first request that names a prefill engine makes the NIXL
    handshake, which vLLM gives up after 5 s (a constant) and which this machine misses at
    times: the decode engine answers 500 (the prefill engine keeps that request's KV until
    its lease ends) and the next request tries the handshake again."""
    body = {"model": MODEL, "prompt": prompt(f"handshake-{prefill_url}"), "max_tokens": 2}
    for attempt in range(1, HANDSHAKE_TRIES + 1):
        answer = post_json(prefill_url + "/v1/completions", prefill_body(body))
        try:
            post_json(decode_url + "/v1/completions", decode_body(body, answer))
            return
        except urllib.error.HTTPError as error:
            if error.code != 500 or attempt == HANDSHAKE_TRIES:
                raise


def converse(client: openai.OpenAI, tag: str) -> list[int]:
    """One conversation of TURNS chat turns, each the whole conversation so far (the
    model's replies included) plus a new user message; the ``cached_tokens`` of each."""
    messages: list[dict[str, str]] = []
    cached = []
    for turn in range(TURNS):
        # The tag opens the first message: no block is shared with another conversation.
        text = prompt(f"{tag}-turn{turn}", words=TURN_WORDS)
        messages.append({"role": "user", "content": text})
        response = client.chat.completions.create(
            model=MODEL,
            messages=messages,  # type: ignore[arg-type]
            max_tokens=REPLY_TOKENS,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        details = response.usage.prompt_tokens_details if response.usage else None
        assert details is not None and details.cached_tokens is not None, response.usage
        cached.append(details.cached_tokens)
        messages.append({"role": "assistant", "content": response.choices[0].message.content or ""})
    return cached


# Longer than the folder's 900 s: its own engine took up to 210 s to start and the rest up to
# 7 min on a shared machine, and the pair's start (~1.5 min) counts too if it runs first.
@pytest.mark.timeout(1200)
def test_prefix_policy_reports_more_cached_tokens_than_round_robin(
    vllm_pair: VllmPair, second_prefill: str
) -> None:
    """The same conversation workload through a router with ``--prefill-policy prefix``
    (the default) and through one with ``round_robin``, each in front of two prefill
    engines (prefix caching on, vLLM's default) and the pair's decode engine: the prefix
    policy sends every turn of a conversation to the engine that prefilled its earlier
    turns, so it reports more ``cached_tokens``.

    The difference is designed, not left to chance. Each router gets its conversations one
    at a time and their turns in order, so round robin over two engines sends every turn
    to the other engine than the turn before (turn 2 finds nothing cached, turn 3 finds
    turn 1), while the prefix policy keeps a conversation on one engine, whichever it is
    (all on one engine is fine), and never spills it (one prefill in flight is within the
    load bound). Each run has texts of its own (a tag per run, new on every try), so
    neither finds what the other or an earlier try left in the caches; vLLM's
    /reset_prefix_cache would need VLLM_SERVER_DEV_MODE, which the pair does not run with.
    The prefill engines' own ``prompt_tokens_cached_total`` must add up to what the
    router reported.

    Independent of the other tests and their order: it makes its own NIXL handshakes."""
    prefill_urls = [vllm_pair.prefill_url, second_prefill]
    for url in prefill_urls:
        warm_handshake(url, vllm_pair.decode_url)
    prefills = [Engine(f"prefill {i}", url) for i, url in enumerate(prefill_urls)]
    tag = os.urandom(3).hex()
    requests = CONVERSATIONS * TURNS
    totals = {}
    for policy in ("prefix", "round_robin"):
        settle(lambda: all(e.idle() for e in prefills), "idle prefill engines")
        for engine in prefills:
            engine.mark()
        args = ("--prefill-policy", policy)
        with router_for(vllm_pair, prefill_urls, *args, log_name=f"router-{policy}.log") as rt:
            client = client_for(rt.url)
            cached = [converse(client, f"{policy}-{tag}-{i}") for i in range(CONVERSATIONS)]
            rt.assert_idle()
        totals[policy] = sum(map(sum, cached))
        settle(lambda: sum(e.delta(FINISHED) for e in prefills) >= requests, "prefill counters")
        served = [int(e.delta(FINISHED)) for e in prefills]
        by_turn = [sum(turns[t] for turns in cached) for t in range(TURNS)]
        print(
            f"\n{policy}: cached_tokens {totals[policy]}, by turn {by_turn}, by conversation"
            f" {cached}; prefills per engine {served}"
        )
        assert sum(e.delta(CACHED_PROMPT) for e in prefills) == totals[policy]
        assert sum(served) == requests, served
        if policy == "round_robin":
            assert max(served) - min(served) <= 1, f"round robin skipped an engine: {served}"

    print(f"cached_tokens: prefix {totals['prefix']}, round_robin {totals['round_robin']}")
    assert totals["prefix"] > totals["round_robin"]


def test_a_short_prompt_with_max_local_prefill_is_answered_by_the_decode_engine_alone(
    vllm_pair: VllmPair, baseline: openai.OpenAI
) -> None:
    """With ``--max-local-prefill`` a prompt shorter than it goes to the decode engine (a
    ``kv_consumer``) with no ``kv_transfer_params``: the decode engine computes it itself,
    nothing is pulled, the prefill engine serves nothing, and the tokens are those of one
    engine answering alone."""
    prefill = Engine("prefill", vllm_pair.prefill_url)
    decode = Engine("decode", vllm_pair.decode_url)
    text = prompt(f"local-{os.urandom(3).hex()}", words=12)
    alone = ask(baseline, "completions", text, 8)  # the prefill engine, as a plain engine
    settle(lambda: prefill.idle() and decode.idle(), "idle engines")
    prefill.mark()
    decode.mark()
    args = ("--max-local-prefill", "256")
    with router_for(vllm_pair, [vllm_pair.prefill_url], *args, log_name="router-local.log") as rt:
        answer = ask(client_for(rt.url), "completions", text, 8)
        rt.assert_idle()
        lines = [line for line in rt.log().splitlines() if "request_id=" in line]
    assert answer.token_ids == alone.token_ids
    settle(lambda: decode.delta(FINISHED) >= 1, "the decode engine's counter")
    assert prefill.delta(FINISHED) == 0, "the prefill engine served nothing"
    assert decode.delta(XFERS) == 0 and decode.pulled() == 0, "nothing was pulled"
    assert decode.computed() > 0, "the decode engine computed the prompt"
    assert len(lines) == 1 and "local_prefill=True" in lines[0] and "prefill_node=None" in lines[0]


def test_a_batch_of_prompts_is_answered_by_the_decode_engine_as_by_one_engine(
    vllm_pair: VllmPair, baseline: openai.OpenAI
) -> None:
    """vLLM's prefill answers one ``kv_transfer_params`` for a request, a batch's first
    prompt's: the router has the decode engine compute a batch of prompts itself (and
    ``n`` > 1 alike), without ``--max-local-prefill``. Every prompt's tokens are those of
    one engine answering the batch alone; the prefill engine serves nothing."""
    prefill = Engine("prefill", vllm_pair.prefill_url)
    decode = Engine("decode", vllm_pair.decode_url)
    tag = os.urandom(3).hex()
    batch = {
        "model": MODEL,
        "prompt": [prompt(f"batch-a-{tag}"), prompt(f"batch-b-{tag}")],
        "max_tokens": 6,
        "temperature": 0,
        "extra_body": EXTRA_BODY,
    }
    alone = baseline.completions.create(**batch)
    settle(lambda: prefill.idle() and decode.idle(), "idle engines")
    prefill.mark()
    decode.mark()
    with router_for(vllm_pair, [vllm_pair.prefill_url], log_name="router-batch.log") as router:
        answer = client_for(router.url).completions.create(**batch)
        router.assert_idle()
        lines = [line for line in router.log().splitlines() if "request_id=" in line]
    assert [c.index for c in answer.choices] == [c.index for c in alone.choices] == [0, 1]
    assert [list(c.token_ids or []) for c in answer.choices] == [
        list(c.token_ids or []) for c in alone.choices
    ]
    settle(lambda: decode.delta(FINISHED) >= 2, "the decode engine's counter")
    assert prefill.delta(FINISHED) == 0, "the prefill engine served nothing"
    assert decode.delta(XFERS) == 0 and decode.pulled() == 0, "nothing was pulled"
    assert len(lines) == 1 and "local_prefill=True" in lines[0] and "prefill_node=None" in lines[0]


# --------------------------------------------------------------------------------------
# 7: the prefill engine dies (last: the pair stays broken)
# --------------------------------------------------------------------------------------
# The engines' --api-key: every test above went through with the right key; a wrong one
# is the engine's 401, named as the engine's, and no node is held to blame
# --------------------------------------------------------------------------------------


def test_a_wrong_engine_key_is_the_engines_401_and_kills_no_node(vllm_pair: VllmPair) -> None:
    token = "suite-admin"
    with router_for(
        vllm_pair,
        [vllm_pair.prefill_url],
        "--engine-api-key", "not-the-engines-key",
        "--admin-token", token,
        "--health-interval", "0.5",
        "--unhealthy-after", "2",
        log_name="router-wrong-key.log",
    ) as router:  # fmt: skip
        # The client's own header carries the engines' real key: the router never passes
        # a client's Authorization on, so the engine sees only the router's wrong one.
        client = client_for(router.url)
        for endpoint, stream in [("completions", False), ("chat", True), ("completions", True)]:
            with pytest.raises(openai.AuthenticationError) as refused:
                ask(client, endpoint, prompt("wrong-key"), max_tokens=2, stream=stream)
            error = refused.value
            assert error.status_code == 401
            assert error.type == "upstream_error" and error.code == "engine_unauthorized"
            assert f"prefill engine {vllm_pair.prefill_url}/v1/" in error.message, error.message
            assert "--engine-api-key" in error.message
        # Past --unhealthy-after refusals, and a few probe rounds: no node is unwell.
        time.sleep(2.0)
        request = urllib.request.Request(
            f"{router.url}/admin/nodes", headers={"Authorization": f"Bearer {token}"}
        )
        with urllib.request.urlopen(request, timeout=30) as response:  # nosec B310
            nodes = json.loads(response.read())["nodes"]
        assert {node["state"] for node in nodes} == {"serving"}, nodes
        assert "is dead" not in router.log()
        assert outcomes(router, "prefill_error") == 3
        router.assert_idle()


# --------------------------------------------------------------------------------------


@pytest.mark.breaks_vllm_pair
def test_prefill_engine_dying_gives_clear_errors_and_frees_slots(
    router: RouterProcess, engines: Engines, baseline: openai.OpenAI, vllm_pair: VllmPair
) -> None:
    client = client_for(router.url)
    text = prompt("outlives-prefill", words=20)
    alone = ask(baseline, "completions", text, max_tokens=DYING)
    prefill = vllm_pair.prefill
    assert prefill is not None and prefill.pid is not None

    # A stream already decoding does not need the prefill engine any more.
    stream = client.completions.create(
        **_request("completions", text, DYING), stream=True, stream_options={"include_usage": True}
    )
    chunks = iter(stream)
    collector = _Collector()
    while len(collector.ids) < 3:
        collector.feed(next(chunks))
    os.killpg(prefill.pid, signal.SIGKILL)  # the engine's own process group (harness)
    generated_at_death = engines.decode.delta(GENERATED)
    prefill.stop()  # reap it
    for chunk in chunks:
        collector.feed(chunk)
    assert generated_at_death < DYING, "the stream ended before the prefill engine died"
    assert collector.ids == alone.token_ids
    assert collector.finish == "length"

    # New requests fail at once, with an OpenAI-style error that says what is wrong.
    for endpoint, streamed in [("completions", False), ("completions", True), ("chat", False)]:
        started = time.monotonic()
        with pytest.raises(openai.APIStatusError) as failed:
            ask(client, endpoint, prompt("no-prefill"), max_tokens=4, stream=streamed)
        assert time.monotonic() - started < 30
        error = failed.value
        assert error.status_code in (502, 503), error
        assert error.response.headers["content-type"] == "application/json"
        body = error.body
        assert isinstance(body, dict) and set(body) >= {"message", "type", "code"}, body
        assert "prefill" in body["message"], body
    log = router.log()
    assert f"prefill node 0 ({vllm_pair.prefill_url}) is dead" in log, log[-3000:]

    router.assert_idle()
    # The decode engine is unharmed.
    assert http_get(vllm_pair.decode_url + "/health")[0] == 200
    plain = ask(client_for(vllm_pair.decode_url), "completions", text, max_tokens=4)
    assert plain.token_ids == alone.token_ids[:4]

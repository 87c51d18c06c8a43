"""Metrics and logs after a scripted mix of outcomes: every counter and histogram count
moves by exactly what the mix implies, and every request leaves one log line."""

from __future__ import annotations

import json
import socket
import uuid
from collections.abc import Iterator

import httpx
import pytest

from pd_router.ops.logs import escaped
from pd_router.sim.fleet import SimFleet
from tests.helpers import RawClient, RouterProcess, wait_for

STREAM = {"model": "sim-model", "prompt": "metrics please", "max_tokens": 30, "stream": True}
SHORT = {"model": "sim-model", "prompt": "short one", "max_tokens": 2}


@pytest.fixture(scope="module")
def fleet() -> Iterator[SimFleet]:
    with SimFleet(prefill=1, decode=1, decode_args=["--itl", "0.02"]) as fleet:
        yield fleet


def delta(after: dict[str, float], before: dict[str, float], key: str) -> float:
    return after.get(key, 0) - before.get(key, 0)


def requests(outcome: str) -> str:
    return f"pd_router_requests_total{{endpoint=completions,outcome={outcome}}}"


def count(histogram: str) -> str:
    return f"pd_router_{histogram}_seconds_count"


def test_metrics_and_log_lines_follow_a_scripted_mix(fleet: SimFleet) -> None:
    prefill, decode = fleet.prefill[0], fleet.decode[0]
    with RouterProcess([prefill.url], [decode.url], "--log-format", "json") as router:
        before = router.metrics()
        url = f"{router.url}/v1/completions"
        # 2 ok: one streamed, one not.
        assert httpx.post(url, json=SHORT).status_code == 200
        assert httpx.post(url, json={**SHORT, "stream": True}).status_code == 200
        # 1 rejected_busy while a stream holds the only slot (the holder ends ok: 3 ok).
        holder = RawClient(router.url, "/v1/completions", STREAM)
        holder.read_until(b"data: ")
        assert httpx.post(url, json=SHORT).status_code == 429
        assert holder.read_all().endswith(b"data: [DONE]\n\n\r\n0\r\n\r\n")
        # 1 client_aborted mid-stream.
        leaver = RawClient(router.url, "/v1/completions", STREAM, ["X-Request-Id: leaver"])
        leaver.read_until(b'"text"', count=2)
        leaver.hang_up()
        wait_for(lambda: router.in_use() == 0, what="the leaver's slot")
        # 1 decode_error: the engine answers 500 (an upstream error of kind http_5xx).
        decode.configure(fail_status=500, fail_message="engine exploded")
        try:
            assert httpx.post(url, json=SHORT).status_code == 500
        finally:
            decode.configure(fail_status=None)
        # 1 bad_request.
        assert httpx.post(url, content=b"{nope").status_code == 400
        wait_for(
            lambda: sum(
                delta(router.metrics(), before, requests(o))
                for o in ("ok", "rejected_busy", "client_aborted", "decode_error", "bad_request")
            )
            == 7,
            what="all 7 requests counted",
        )
        after = router.metrics()
        expected = {
            "ok": 3,
            "rejected_busy": 1,
            "client_aborted": 1,
            "decode_error": 1,
            "bad_request": 1,
            "rejected_timeout": 0,
            "prefill_error": 0,
            "node_dead": 0,
        }
        assert {o: delta(after, before, requests(o)) for o in expected} == expected
        # Histograms: duration for every relayed request (all but the bad one); a slot and
        # a prefill for all but the busy one; a first token for the 3 ok ones and the
        # leaver, which had tokens before it left.
        assert delta(after, before, count("request_duration")) == 6
        assert delta(after, before, count("queue_wait")) == 5
        assert delta(after, before, count("prefill_duration")) == 5
        assert delta(after, before, count("time_to_first_token")) == 4
        errors = {k: v for k, v in after.items() if k.startswith("pd_router_upstream_errors")}
        labels = f"kind=http_5xx,node=1,role=decode,url={decode.url}"
        assert errors == {f"pd_router_upstream_errors_total{{{labels}}}": 1}
        router.assert_idle()
        lines = [json.loads(line) for line in router.log().splitlines() if line.startswith("{")]
    finished = [line for line in lines if line["logger"] == "pd_router.access"]
    assert len(finished) == 7, "one line per finished request, refused ones included"
    assert sorted(line["outcome"] for line in finished) == sorted(
        ["ok"] * 3 + ["rejected_busy", "client_aborted", "decode_error", "bad_request"]
    )
    # A request refused before its relay began has a line with the same fields as any
    # other (before: none at all), the phases that never ran null.
    bad = next(line for line in finished if line["outcome"] == "bad_request")
    served = next(line for line in finished if line["outcome"] == "ok")
    assert bad.keys() == served.keys()
    assert (bad["status"], bad["endpoint"], bad["model"], bad["decode_node"]) == (
        400,
        "completions",
        None,
        None,
    )
    assert bad["bytes"] > 0 and bad["request_id"]
    leaver_line = next(line for line in finished if line["request_id"] == "leaver")
    assert leaver_line["prefill_node"] == 0 and leaver_line["decode_node"] == 1
    assert leaver_line["queued_s"] >= 0 and leaver_line["prefill_s"] > 0
    assert leaver_line["ttft_s"] > 0 and leaver_line["bytes"] > 0 and leaver_line["stream"]
    ok = next(line for line in finished if line["outcome"] == "ok" and not line["stream"])
    assert ok["duration_s"] >= ok["ttft_s"] >= ok["prefill_s"] > 0 and ok["status"] == 200


def test_a_queue_timeout_is_counted_as_such(fleet: SimFleet) -> None:
    prefill, decode = fleet.prefill[0], fleet.decode[0]
    with RouterProcess([prefill.url], [decode.url], "--queue-timeout", "0.3") as router:
        before = router.metrics()
        # The holder streams for 40 s: it cannot end inside the 0.3 s a waiter waits, however
        # late this client gets to send the waiter.
        holder = RawClient(router.url, "/v1/completions", {**STREAM, "max_tokens": 2000})
        holder.read_until(b"data: ")
        response = httpx.post(f"{router.url}/v1/completions", json=SHORT)
        assert response.status_code == 429
        holder.hang_up()
        wait_for(lambda: router.in_use() == 0, what="the holder's slot")
        after = router.metrics()
        assert delta(after, before, requests("rejected_timeout")) == 1
        assert delta(after, before, count("queue_wait")) == 1, "only the holder got a slot"
        line = next(x for x in router.log().splitlines() if "outcome=rejected_timeout" in x)
        assert "decode_node=None" in line and "queued_s=None" in line


def test_latency_histograms_count_a_bound_in_its_own_bucket() -> None:
    from pd_router.ops.metrics import Histogram

    histogram = Histogram("pd_router_x_seconds", "x")
    for seconds in (0.001, 0.0011, 0.3, 400.0):
        histogram.observe(seconds)
    samples = {
        (sample.name, sample.labels.get("le")): sample.value
        for sample in histogram.family().samples
    }
    buckets = {le: value for (name, le), value in samples.items() if name.endswith("_bucket")}
    # Prometheus buckets are cumulative and "less than or equal".
    assert buckets["0.001"] == 1 and buckets["0.005"] == 2
    assert buckets["0.25"] == 2 and buckets["0.5"] == 3 and buckets["300.0"] == 3
    assert buckets["+Inf"] == 4
    assert samples[("pd_router_x_seconds_count", None)] == 4
    assert samples[("pd_router_x_seconds_sum", None)] == 0.001 + 0.0011 + 0.3 + 400.0


# U+202E (right-to-left override) and U+2066 (left-to-right isolate) reorder what a
# terminal shows; U+0085 is a C1 control (NEL), U+200B a zero-width space.
SNEAKY = "gpt\u202e4-lim\u2066x\u0085y\u200bz"


@pytest.mark.parametrize("log_format", ["text", "json"])
def test_a_model_name_cannot_reorder_or_break_the_log(fleet: SimFleet, log_format: str) -> None:
    """Bidi controls in a model name reached the log raw (JSON escapes only C0 controls)."""
    prefill, decode = fleet.prefill[0], fleet.decode[0]
    with RouterProcess([prefill.url], [decode.url], "--log-format", log_format) as router:
        body = {"model": SNEAKY, "prompt": "hi", "max_tokens": 2}
        answer = httpx.post(f"{router.url}/v1/completions", json=body, timeout=10)
        assert answer.status_code == 404  # logged all the same
        wait_for(lambda: "model_not_found" in router.log(), what="the request's log line")
        log = router.log()
    assert not any(c in log for c in "\u202e\u2066\u0085\u200b")
    (line,) = (line for line in log.splitlines() if "model_not_found" in line)
    if log_format == "json":
        assert json.loads(line)["model"] == SNEAKY  # escaped, not changed
    else:
        assert ' model="gpt\\u202e4-lim\\u2066x\\u0085y\\u200bz" ' in line


def test_escaped_json_means_what_it_did() -> None:
    # A tag character (U+E0001) lies beyond the BMP: JSON spells it as a surrogate pair.
    value = {"model": "a\u202eb\U000e0001c\x7f d\u00e9\u6a21"}
    text = escaped(json.dumps(value, ensure_ascii=False))
    assert text.isprintable() and json.loads(text) == value
    assert "\\udb40\\udc01" in text and "d\u00e9\u6a21" in text  # printable ones stay


def test_an_engines_error_text_cannot_forge_a_log_line() -> None:
    """A prefill engine's error message is logged when the prefill is retried elsewhere."""
    forged = "overloaded\n2026-01-01 00:00:00,000 INFO pd_router.access: request \u202eevil"
    with SimFleet(prefill=2, decode=1) as fleet:
        for engine in fleet.prefill:
            engine.configure(fail_status=503, fail_message=forged)
        prefill, decode = [e.url for e in fleet.prefill], [fleet.decode[0].url]
        with RouterProcess(prefill, decode) as router:
            answer = httpx.post(f"{router.url}/v1/completions", json=SHORT, timeout=30)
            wait_for(lambda: "retrying on node" in router.log(), what="the retry's log line")
            log = router.log()
    assert answer.status_code == 503
    assert "\u202e" not in log
    (line,) = (line for line in log.splitlines() if "retrying on node" in line)
    assert (
        "overloaded\\u000a2026-01-01 00:00:00,000 INFO pd_router.access: request \\u202eevil"
        in line
    )
    assert not any(x.startswith("2026-01-01") for x in log.splitlines())


def test_each_histogram_times_its_own_phase_as_the_log_line_does(fleet: SimFleet) -> None:
    """One request with a slow prefill and a slow decode: each latency histogram grows by
    the phase it names, the same the request's log line says (a histogram fed another
    phase's time, or a line's field another's, reads plausibly until compared)."""
    prefill, decode = fleet.prefill[0], fleet.decode[0]
    with RouterProcess([prefill.url], [decode.url], "--log-format", "json") as router:
        before = router.metrics()
        prefill.configure(prefill_delay=0.5)
        try:
            # 30 tokens 0.02 s apart: the answer's end is 0.58 s or more after its start.
            body = {**STREAM, "prompt": "phases, timed one by one"}
            holder = RawClient(router.url, "/v1/completions", body, ["X-Request-Id: phases"])
            assert holder.read_all().endswith(b"data: [DONE]\n\n\r\n0\r\n\r\n")
        finally:
            prefill.configure(prefill_delay=0)
        wait_for(lambda: '"phases"' in router.log(), what="the request's log line")
        after = router.metrics()
        line = next(
            json.loads(x) for x in router.log().splitlines() if '"request_id":"phases"' in x
        )

    def observed(histogram: str) -> float:
        key = f"pd_router_{histogram}_seconds"
        assert delta(after, before, f"{key}_count") == 1
        return delta(after, before, f"{key}_sum")

    phases = {
        "queued_s": observed("queue_wait"),
        "prefill_s": observed("prefill_duration"),
        "ttft_s": observed("time_to_first_token"),
        "duration_s": observed("request_duration"),
    }
    # The line rounds to 0.1 ms.
    assert all(abs(line[field] - seconds) < 0.001 for field, seconds in phases.items()), (
        line,
        phases,
    )
    # What the engines took, whatever this machine's stalls added.
    assert line["prefill_s"] >= 0.5
    assert line["duration_s"] - line["ttft_s"] >= 0.5
    assert line["ttft_s"] >= line["queued_s"] + line["prefill_s"]


def test_prefix_hits_and_prefill_failures_are_counted_where_they_happened(
    fleet: SimFleet,
) -> None:
    """A prompt sent twice to the one prefill node: a miss, then a hit, in the counter and
    in the lines. Then that node fails: the failure is the prefill node's, not a decode
    node's."""
    prefill, decode = fleet.prefill[0], fleet.decode[0]
    with RouterProcess([prefill.url], [decode.url], "--log-format", "json") as router:
        before = router.metrics()
        url = f"{router.url}/v1/completions"
        body = {**SHORT, "prompt": f"{uuid.uuid4()} a conversation opening only this test sends"}
        for index in range(2):
            headers = {"X-Request-Id": f"prefix-{index}"}
            assert httpx.post(url, json=body, headers=headers, timeout=60).status_code == 200
        prefill.configure(fail_status=500, fail_message="prefill exploded")
        try:
            assert httpx.post(url, json=SHORT, timeout=60).status_code == 500
        finally:
            prefill.configure(fail_status=None)
        wait_for(
            lambda: delta(router.metrics(), before, requests("prefill_error")) == 1,
            what="the failed request counted",
        )
        after = router.metrics()
        log = router.log()
    picks = "pd_router_prefill_picks_total{{policy=prefix,prefix={}}}"
    assert delta(after, before, picks.format("miss")) == 2  # the first and the failed one
    assert delta(after, before, picks.format("hit")) == 1
    lines = {
        line["request_id"]: line
        for line in map(json.loads, (x for x in log.splitlines() if x.startswith("{")))
        if line["logger"] == "pd_router.access"
    }
    assert (lines["prefix-0"]["prefix_hit"], lines["prefix-1"]["prefix_hit"]) == (False, True)
    errors = {
        k: delta(after, before, k) for k in after if k.startswith("pd_router_upstream_errors")
    }
    labels = f"kind=http_5xx,node=0,role=prefill,url={prefill.url}"
    assert {k: v for k, v in errors.items() if v} == {
        f"pd_router_upstream_errors_total{{{labels}}}": 1
    }


def test_the_gauges_say_who_holds_a_slot_and_who_waits(fleet: SimFleet) -> None:
    """While a stream holds the only slot: one in flight, one reservation not released,
    nobody queued; a second request then waits, and the queue says so."""
    prefill, decode = fleet.prefill[0], fleet.decode[0]
    with RouterProcess([prefill.url], [decode.url], "--queue-timeout", "120") as router:
        holder = RawClient(router.url, "/v1/completions", {**STREAM, "max_tokens": 2000})
        holder.read_until(b"data: ")
        held = router.metrics()
        assert (held["pd_router_in_flight"], held["pd_router_queue_depth"]) == (1, 0)
        acquired, released = (
            held[f"pd_router_slot_{name}_total"] for name in ("acquisitions", "releases")
        )
        assert acquired - released == 1
        waiter = RawClient(router.url, "/v1/completions", SHORT)
        wait_for(lambda: router.metrics()["pd_router_queue_depth"] == 1, what="one waiter queued")
        holder.hang_up()
        assert b"HTTP/1.1 200" in waiter.read_until(b'"choices"')
        router.assert_idle()
        assert router.metrics()["pd_router_in_flight"] == 0


def test_a_node_that_does_not_serve_says_why_in_the_metrics(fleet: SimFleet) -> None:
    """``pd_router_node_reason``: the evidence against a node that does not serve (here,
    nothing listens at its address), and no series for the nodes that serve."""
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        nowhere = f"http://127.0.0.1:{closed.getsockname()[1]}"
    prefill, decode = fleet.prefill[0], fleet.decode[0]
    with RouterProcess([prefill.url], [decode.url, nowhere]) as router:
        reason = f"pd_router_node_reason{{node=2,reason=probe refused,role=decode,url={nowhere}}}"

        def reasons() -> dict[str, float]:
            return {k: v for k, v in router.metrics().items() if "node_reason" in k}

        wait_for(lambda: reason in reasons(), what="the unreachable node's reason")
        assert reasons() == {reason: 1}

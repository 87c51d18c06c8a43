"""Drive a real vLLM prefill/decode pair by hand, the way the router will, and report.

Run with the router's venv (needs httpx):

    /work/main/.venv/bin/python tests/real_vllm/manual_check.py [--work-dir DIR] [--no-single]
        [--lease SECONDS] [--json OUT.json]

Steps: start a VllmPair; for completions and chat, streaming and not, run the P/D flow
(prefill with max_tokens=1 + kv_transfer_params {"do_remote_decode": true, ...}, then
decode with the original body + the prefill response's kv_transfer_params, same
X-Request-Id to both) and compare the token ids with the prefill engine answering the same
body alone (no kv_transfer_params = plain engine); print usage of both sides, NIXL metrics
and log lines; then the experiments: (a) streaming decode closed right after the response
headers, (b) non-streaming decode closed before completion, (c) decode with a bogus
handshake and with the prefill engine dead. Finally (unless --no-single) a plain engine
(no kv-transfer) is started after the pair is stopped, to check that the prefill engine's
answers equal a plain engine's. Exits 1 if a token-id comparison fails.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import re
import sys
import time
import uuid
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from engines import (  # noqa: E402
    SingleEngine,
    VllmPair,
    decode_body,
    free_ports,
    metric_value,
    metrics,
    prefill_body,
)

WORDS = (
    "the router sends the prompt to a prefill engine and the rest to a decode engine "
    "blocks of keys and values travel over the loopback interface from one process to another "
).split()


def prompt_text(tag: str, n_words: int = 40) -> str:
    # Distinct per tag, so one case's prefix cache does not help another.
    words = [tag] + [WORDS[(i * 7 + len(tag)) % len(WORDS)] for i in range(n_words)]
    return " ".join(words)


def client_body(
    kind: str, tag: str, *, stream: bool, max_tokens: int = 16, n_words: int = 40
) -> dict:
    body: dict = {
        "model": "tiny",
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    if kind == "completions":
        body["prompt"] = prompt_text(tag, n_words)
    else:
        body["messages"] = [{"role": "user", "content": prompt_text(tag, n_words)}]
    if stream:
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
    return body


PATHS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}


def out_token_ids(kind: str, resp: dict) -> list[int] | None:
    return resp["choices"][0].get("token_ids")


def post_json(client: httpx.Client, url: str, body: dict, rid: str | None = None) -> dict:
    headers = {"X-Request-Id": rid} if rid else {}
    t0 = time.perf_counter()
    r = client.post(url, json=body, headers=headers)
    dt = time.perf_counter() - t0
    try:
        js = r.json()
    except ValueError:
        js = {"_raw": r.text}
    return {"status": r.status_code, "headers": dict(r.headers), "json": js, "seconds": dt}


def post_stream(client: httpx.Client, url: str, body: dict, rid: str | None = None) -> dict:
    headers = {"X-Request-Id": rid} if rid else {}
    t0 = time.perf_counter()
    chunks, token_ids, prompt_ids, usage, kvp = [], [], None, None, "absent"
    t_headers = t_first = None
    with client.stream("POST", url, json=body, headers=headers) as r:
        t_headers = time.perf_counter() - t0
        status, hdrs = r.status_code, dict(r.headers)
        if status != 200:
            r.read()
            return {
                "status": status,
                "headers": hdrs,
                "body": r.text,
                "seconds": time.perf_counter() - t0,
            }
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            if t_first is None:
                t_first = time.perf_counter() - t0
            data = line[6:]
            if data == "[DONE]":
                chunks.append("[DONE]")
                break
            ch = json.loads(data)
            chunks.append(ch)
            if ch.get("usage"):
                usage = ch["usage"]
            if "kv_transfer_params" in ch:
                kvp = ch["kv_transfer_params"]
            for c in ch.get("choices") or []:
                if c.get("prompt_token_ids") is not None:
                    prompt_ids = c["prompt_token_ids"]
                token_ids.extend(c.get("token_ids") or [])
            if ch.get("prompt_token_ids") is not None:
                prompt_ids = ch["prompt_token_ids"]
    return {
        "status": status,
        "headers": hdrs,
        "chunks": chunks,
        "token_ids": token_ids,
        "prompt_token_ids": prompt_ids,
        "usage": usage,
        "kv_transfer_params": kvp,
        "seconds": time.perf_counter() - t0,
        "t_headers": t_headers,
        "t_first_data": t_first,
    }


def section(title: str) -> None:
    print("\n" + "=" * 100 + f"\n{title}\n" + "=" * 100, flush=True)


def show(label: str, obj) -> None:
    print(f"{label}: {json.dumps(obj, default=str)}", flush=True)


def grep_log(path: Path, patterns: list[str], since_line: int = 0, limit: int = 40) -> list[str]:
    rx = re.compile("|".join(patterns), re.I)
    out = []
    with open(path, encoding="utf-8", errors="replace") as f:
        for i, line in enumerate(f):
            if i >= since_line and rx.search(line):
                out.append(line.rstrip()[:400])
    return out[-limit:]


def n_lines(path: Path) -> int:
    with open(path, "rb") as f:
        return sum(1 for _ in f)


KV_METRICS = [
    "nixl",
    "kv_transfer",
    "kv_cache_usage",
    "prefix_cache",
    "num_requests",
    "kv_connector",
]


def gauge(url: str) -> dict:
    return {
        "kv_cache_usage_perc": metric_value(url, "vllm:kv_cache_usage_perc"),
        "num_requests_running": metric_value(url, "vllm:num_requests_running"),
        "num_requests_waiting": metric_value(url, "vllm:num_requests_waiting"),
        "nixl_num_kv_expired_reqs_total": metric_value(url, "vllm:nixl_num_kv_expired_reqs_total"),
        "nixl_xfer_count": metric_value(url, "vllm:nixl_xfer_time_seconds_count"),
        "nixl_failed_transfers_total": metric_value(url, "vllm:nixl_num_failed_transfers_total"),
        "generation_tokens_total": metric_value(url, "vllm:generation_tokens_total"),
        "request_success_total": metric_value(url, "vllm:request_success_total"),
    }


# --------------------------------------------------------------------------------------


def run_flow(
    client,
    pair,
    kind: str,
    stream: bool,
    tag: str,
    report: dict,
    max_tokens: int = 16,
    n_words: int = 40,
) -> bool:
    body = client_body(kind, tag, stream=stream, max_tokens=max_tokens, n_words=n_words)
    path = PATHS[kind]
    rid = f"manual-{kind}-{'s' if stream else 'ns'}-{uuid.uuid4().hex[:8]}"
    section(f"P/D flow: {kind} stream={stream} X-Request-Id={rid}")

    p = post_json(client, pair.prefill_url + path, prefill_body(body), rid)
    pj = p["json"]
    print(
        f"prefill: HTTP {p['status']} in {p['seconds'] * 1000:.0f} ms; "
        f"x-request-id header: {p['headers'].get('x-request-id')}"
    )
    show("prefill id", pj.get("id"))
    show("prefill usage", pj.get("usage"))
    show("prefill kv_transfer_params", pj.get("kv_transfer_params"))
    show("prefill choice", pj["choices"][0])
    show(
        "prefill prompt_token_ids len",
        len(pj.get("prompt_token_ids") or pj["choices"][0].get("prompt_token_ids") or []),
    )

    dbody = decode_body(body, pj)
    if stream:
        d = post_stream(client, pair.decode_url + path, dbody, rid)
        dec_ids = d.get("token_ids")
        print(
            f"decode: HTTP {d['status']} headers after {d['t_headers'] * 1000:.0f} ms, "
            f"first data {1000 * (d['t_first_data'] or 0):.0f} ms, "
            f"total {d['seconds'] * 1000:.0f} ms; "
            f"x-request-id header: {d['headers'].get('x-request-id')}"
        )
        show("decode usage (final chunk)", d.get("usage"))
        show("decode kv_transfer_params in chunks", d.get("kv_transfer_params"))
        show("decode first chunk", d["chunks"][0] if d.get("chunks") else None)
        show("decode last 2 chunks", d["chunks"][-2:] if d.get("chunks") else None)
        dusage, dkvp = d.get("usage"), d.get("kv_transfer_params")
    else:
        d = post_json(client, pair.decode_url + path, dbody, rid)
        dj = d["json"]
        dec_ids = out_token_ids(kind, dj) if d["status"] == 200 else None
        print(
            f"decode: HTTP {d['status']} in {d['seconds'] * 1000:.0f} ms; "
            f"x-request-id header: {d['headers'].get('x-request-id')}"
        )
        show("decode id", dj.get("id"))
        show("decode usage", dj.get("usage"))
        show("decode kv_transfer_params", dj.get("kv_transfer_params"))
        dusage, dkvp = dj.get("usage"), dj.get("kv_transfer_params")

    # Baseline: the prefill engine alone, no kv_transfer_params (plain request).
    base_body = dict(body, stream=False)
    base_body.pop("stream_options", None)
    b = post_json(client, pair.prefill_url + path, base_body)
    base_ids = out_token_ids(kind, b["json"])
    show("baseline (prefill engine alone) usage", b["json"].get("usage"))
    show("baseline kv_transfer_params", b["json"].get("kv_transfer_params"))
    ok = bool(dec_ids) and dec_ids == base_ids
    print(
        f"P/D token ids   : {dec_ids}\nbaseline ids    : {base_ids}\n"
        "first P/D token == prefill's 1 token: "
        f"{(out_token_ids(kind, pj) or [None])[0] == (dec_ids or [None])[0]}\nMATCH: {ok}"
    )
    report.setdefault("flows", []).append(
        {
            "kind": kind,
            "stream": stream,
            "request_id": rid,
            "prefill_status": p["status"],
            "prefill_usage": pj.get("usage"),
            "prefill_kv_transfer_params": pj.get("kv_transfer_params"),
            "prefill_id": pj.get("id"),
            "prefill_x_request_id": p["headers"].get("x-request-id"),
            "decode_status": d["status"],
            "decode_usage": dusage,
            "decode_kv_transfer_params": dkvp,
            "decode_x_request_id": d["headers"].get("x-request-id"),
            "pd_token_ids": dec_ids,
            "baseline_token_ids": base_ids,
            "match": ok,
            "baseline_body": base_body,
            "kind_path": path,
        }
    )
    return ok


def watch_prefill_blocks(pair, seconds: float, label: str, poke: bool = False) -> list[dict]:
    """Poll the prefill engine's gauges until kv_cache_usage_perc is 0 (or timeout)."""
    t0 = time.monotonic()
    samples = []
    while True:
        g = gauge(pair.prefill_url)
        g["t"] = round(time.monotonic() - t0, 1)
        samples.append(g)
        if (g["kv_cache_usage_perc"] or 0) == 0 or time.monotonic() - t0 > seconds:
            break
        time.sleep(0.5)
    first, last = samples[0], samples[-1]
    print(
        f"[{label}] prefill kv_cache_usage_perc: first {first['kv_cache_usage_perc']} at t=0 -> "
        f"{last['kv_cache_usage_perc']} at t={last['t']} s; expired_reqs "
        f"{first['nixl_num_kv_expired_reqs_total']} -> {last['nixl_num_kv_expired_reqs_total']}"
    )
    return samples


class Blocker:
    """Keeps the decode engine's only sequence slot busy (decode runs with --max-num-seqs 1)
    with a plain long request, so that a P/D request sent meanwhile stays queued (WAITING,
    KV not pulled yet)."""

    def __init__(self, url: str) -> None:
        import threading

        self.url = url
        self.result: dict | None = None
        body = {
            "model": "tiny",
            "prompt": "blocker",
            "max_tokens": 480,
            "temperature": 0,
            "ignore_eos": True,
        }
        self.thread = threading.Thread(target=self._run, args=(body,), daemon=True)

    def _run(self, body) -> None:
        with httpx.Client(timeout=300) as c:
            t = time.perf_counter()
            r = c.post(self.url + "/v1/completions", json=body)
            self.result = {"status": r.status_code, "seconds": time.perf_counter() - t}

    def __enter__(self) -> Blocker:
        self.thread.start()
        t0 = time.monotonic()
        while (metric_value(self.url, "vllm:num_requests_running") or 0) < 1:
            if time.monotonic() - t0 > 30:
                raise RuntimeError("blocker did not start")
            time.sleep(0.05)
        return self

    def __exit__(self, *exc) -> None:
        self.thread.join(300)


def delta(before: dict, after: dict) -> dict:
    return {
        k: (after[k] or 0) - (before[k] or 0)
        for k in before
        if isinstance(before.get(k), (int, float)) and k != "t"
    }


def experiment_close_early(
    client,
    pair,
    report,
    lease: float,
    *,
    key: str,
    stream: bool,
    busy: bool,
    close_after: float = 0.0,
) -> None:
    """Close the decode connection early and watch whether the prefill engine frees the
    request's KV blocks promptly or only when the lease expires."""
    what = (
        "streaming decode closed right after the response headers"
        if stream
        else f"non-streaming decode closed {close_after * 1000:.0f} ms after sending"
    )
    where = "decode BUSY (request queued, KV not pulled yet)" if busy else "decode idle"
    section(f"({key}) {what}; {where}")
    tag = f"exp{key}"
    body = client_body("completions", tag, stream=stream, max_tokens=200, n_words=150)
    pl0, dl0 = n_lines(pair.log_path("prefill")), n_lines(pair.log_path("decode"))
    d_before = gauge(pair.decode_url)
    # The blocker starts first: the prefill's lease (30 s) runs from the prefill response,
    # and the decode engine only renews it (heartbeats) once it has the request.
    blocker = Blocker(pair.decode_url) if busy else contextlib.nullcontext()
    info: dict = {}
    with blocker:
        if busy:
            show("decode gauges with blocker running", gauge(pair.decode_url))
        p = post_json(client, pair.prefill_url + "/v1/completions", prefill_body(body), tag)
        t_prefill_done = time.perf_counter()
        p_after = gauge(pair.prefill_url)
        show("prefill usage", p["json"].get("usage"))
        show(
            "prefill kv_transfer_params.remote_block_ids",
            p["json"]["kv_transfer_params"]["remote_block_ids"],
        )
        show("prefill gauges after prefill (blocks held for decode)", p_after)
        t0 = time.perf_counter()
        info["decode_sent_after_prefill_s"] = round(t0 - t_prefill_done, 2)
        if stream:
            with client.stream(
                "POST",
                pair.decode_url + "/v1/completions",
                json=decode_body(body, p["json"]),
                headers={"X-Request-Id": tag},
            ) as r:
                info["t_headers_ms"] = (time.perf_counter() - t0) * 1000
                info["status"] = r.status_code
                print(
                    f"decode stream: HTTP {r.status_code} headers after "
                    f"{info['t_headers_ms']:.1f} ms; closing without reading the body"
                )
        else:
            try:
                with httpx.Client(timeout=httpx.Timeout(close_after, connect=5)) as c2:
                    r = c2.post(
                        pair.decode_url + "/v1/completions",
                        json=decode_body(body, p["json"]),
                        headers={"X-Request-Id": tag},
                    )
                    info["outcome"] = f"completed before the close: HTTP {r.status_code}"
            except httpx.TimeoutException as e:
                info["outcome"] = (
                    f"closed by client after {1000 * (time.perf_counter() - t0):.0f} ms "
                    f"({type(e).__name__})"
                )
            print("decode:", info["outcome"])
        t_close = time.perf_counter()
        samples = watch_prefill_blocks(pair, lease + 20, key)
        info["prefill_blocks_freed_after_close_s"] = (
            round(time.perf_counter() - t_close, 1)
            if (samples[-1]["kv_cache_usage_perc"] or 0) == 0
            else None
        )
    if busy:
        show("blocker result", blocker.result)
    time.sleep(1)
    d_after = gauge(pair.decode_url)
    show("decode counters delta (after - before)", delta(d_before, d_after))
    show("prefill counters delta since prefill", delta(p_after, gauge(pair.prefill_url)))
    for line in grep_log(
        pair.log_path("decode"),
        ["abort", tag, "KV Transfer", "nixl", "error", "warn", "disconnect", "fail"],
        dl0,
        15,
    ):
        print("  decode log:", line)
    for line in grep_log(
        pair.log_path("prefill"),
        ["abort", tag, "expired", "nixl", "error", "warn", "fail"],
        pl0,
        15,
    ):
        print("  prefill log:", line)
    report[key] = {
        "stream": stream,
        "busy": busy,
        "close_after": close_after,
        **info,
        "prefill_after_prefill": p_after,
        "samples": samples,
        "decode_delta": delta(d_before, d_after),
    }


def stream_raw(client: httpx.Client, url: str, body: dict, rid: str | None = None) -> dict:
    """POST a streaming request and keep every non-empty line with its arrival time."""
    headers = {"X-Request-Id": rid} if rid else {}
    t0 = time.perf_counter()
    lines = []
    with client.stream("POST", url, json=body, headers=headers) as r:
        t_headers = time.perf_counter() - t0
        for line in r.iter_lines():
            if line:
                lines.append((round(time.perf_counter() - t0, 3), line[:500]))
    return {
        "status": r.status_code,
        "t_headers": round(t_headers, 3),
        "seconds": round(time.perf_counter() - t0, 3),
        "lines": lines,
    }


def experiment_bogus(client, pair, report) -> None:
    section("(c1) decode with a bogus handshake (remote_port of nothing, unknown engine id)")
    body = client_body("completions", "expC1", stream=False, max_tokens=8)
    p = post_json(client, pair.prefill_url + "/v1/completions", prefill_body(body), "expC1")
    bogus = copy.deepcopy(p["json"])
    (dead_port,) = free_ports(1)
    bogus["kv_transfer_params"]["remote_port"] = dead_port
    bogus["kv_transfer_params"]["remote_engine_id"] = "bogus-" + uuid.uuid4().hex[:8]
    dl0 = n_lines(pair.log_path("decode"))
    d = post_json(client, pair.decode_url + "/v1/completions", decode_body(body, bogus), "expC1")
    print(
        f"decode: HTTP {d['status']} after {d['seconds']:.2f} s; "
        f"body: {json.dumps(d['json'])[:600]}"
    )
    print(f"decode /health afterwards: {client.get(pair.decode_url + '/health').status_code}")
    for line in grep_log(
        pair.log_path("decode"), ["error", "fail", "handshake", "expC1", "warn"], dl0, 15
    ):
        print("  decode log:", line)
    report["c1"] = {"status": d["status"], "seconds": d["seconds"], "body": d["json"]}
    # the same, streaming
    sbody = client_body("completions", "expC1s", stream=True, max_tokens=8)
    p = post_json(client, pair.prefill_url + "/v1/completions", prefill_body(sbody), "expC1s")
    bogus = copy.deepcopy(p["json"])
    bogus["kv_transfer_params"]["remote_port"] = dead_port
    bogus["kv_transfer_params"]["remote_engine_id"] = "bogus-" + uuid.uuid4().hex[:8]
    ds = stream_raw(
        client, pair.decode_url + "/v1/completions", decode_body(sbody, bogus), "expC1s"
    )
    show("decode STREAMING with bogus handshake", ds)
    report["c1_stream"] = ds
    # the prefill engine still holds expC1's blocks until the lease ends: wait them out
    watch_prefill_blocks(pair, 45, "c1 (orphaned prefill blocks)")

    section("(c2) decode while the prefill engine is dead (after a successful handshake earlier)")
    body = client_body("completions", "expC2", stream=False, max_tokens=8)
    p = post_json(client, pair.prefill_url + "/v1/completions", prefill_body(body), "expC2")
    sbody = client_body("completions", "expC2s", stream=True, max_tokens=8)
    ps = post_json(client, pair.prefill_url + "/v1/completions", prefill_body(sbody), "expC2s")
    t = time.perf_counter()
    pair.prefill.stop()
    print(f"prefill engine stopped in {time.perf_counter() - t:.1f} s")
    dl0 = n_lines(pair.log_path("decode"))
    d = post_json(
        client, pair.decode_url + "/v1/completions", decode_body(body, p["json"]), "expC2"
    )
    print(
        f"decode: HTTP {d['status']} after {d['seconds']:.2f} s; "
        f"body: {json.dumps(d['json'])[:600]}"
    )
    print(f"decode /health afterwards: {client.get(pair.decode_url + '/health').status_code}")
    ds = stream_raw(
        client, pair.decode_url + "/v1/completions", decode_body(sbody, ps["json"]), "expC2s"
    )
    show("decode STREAMING while the prefill engine is dead", ds)
    report["c2_stream"] = ds
    # and a brand-new request with kv params of the dead engine again (second try)
    d2 = post_json(
        client, pair.decode_url + "/v1/completions", decode_body(body, p["json"]), "expC2b"
    )
    print(
        f"decode again: HTTP {d2['status']} after {d2['seconds']:.2f} s; "
        f"body: {json.dumps(d2['json'])[:300]}"
    )
    # a plain request on decode (no kv params) still works?
    plain = dict(body)
    d3 = post_json(client, pair.decode_url + "/v1/completions", plain)
    print(
        f"decode plain request (no kv_transfer_params): HTTP {d3['status']} "
        f"in {d3['seconds']:.2f} s"
    )
    for line in grep_log(
        pair.log_path("decode"), ["error", "fail", "handshake", "expC2", "warn"], dl0, 20
    ):
        print("  decode log:", line)
    report["c2"] = {
        "status": d["status"],
        "seconds": d["seconds"],
        "body": d["json"],
        "again_status": d2["status"],
        "again_seconds": d2["seconds"],
        "plain_status": d3["status"],
    }


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--work-dir")
    ap.add_argument("--no-single", action="store_true", help="skip the plain-engine comparison")
    ap.add_argument("--no-experiments", action="store_true")
    ap.add_argument("--no-flows", action="store_true", help="skip the P/D flows (experiments only)")
    ap.add_argument(
        "--lease",
        type=float,
        default=30,
        help="kv_lease_duration (s) for both engines; vLLM default 30",
    )
    ap.add_argument("--json", help="write a JSON report here")
    ap.add_argument(
        "--block-size",
        type=int,
        default=None,
        help="--block-size for the engines (vLLM CPU default 128)",
    )
    args = ap.parse_args()

    report: dict = {}
    all_ok = True
    kv_extra = None if args.lease == 30 else {"kv_lease_duration": int(args.lease)}
    t0 = time.monotonic()
    extra = ["--block-size", str(args.block_size)] if args.block_size else []
    # --max-num-seqs 1 on decode lets the experiments queue a P/D request behind a blocker.
    with (
        VllmPair(
            args.work_dir,
            kv_extra_config=kv_extra,
            extra_args=extra,
            decode_args=["--max-num-seqs", "1"],
        ) as pair,
        httpx.Client(timeout=120) as client,
    ):
        report["timings"] = dict(pair.timings)
        report["rss_mb"] = {e.role: e.rss() // 2**20 for e in pair.engines}
        report["flags"] = pair.flags
        section("pair started")
        show("timings (s)", pair.timings)
        show("RSS (MiB, process tree)", report["rss_mb"])
        show("optional flags used", pair.flags)
        print("work dir:", pair.work_dir)
        print(
            "prefill:",
            pair.prefill_url,
            "pid",
            pair.prefill.pid,
            "side channel",
            pair.prefill.side_channel_port,
        )
        print(
            "decode :",
            pair.decode_url,
            "pid",
            pair.decode.pid,
            "side channel",
            pair.decode.side_channel_port,
        )

        if not args.no_flows:
            for kind in ("completions", "chat"):
                for stream in (False, True):
                    all_ok &= run_flow(client, pair, kind, stream, f"{kind}{int(stream)}", report)
            # Repeat one case with the same prompt: prefix caches on both engines are warm now.
            section(
                "prefix caching: the same 150-word prompt twice "
                "(first cold, then warm caches on both engines)"
            )
            all_ok &= run_flow(client, pair, "completions", False, "repeat", report, n_words=150)
            all_ok &= run_flow(client, pair, "completions", False, "repeat", report, n_words=150)

            section("decode /metrics (nixl / kv_transfer / kv cache)")
            for line in metrics(pair.decode_url, KV_METRICS):
                print("  ", line)
            section("prefill /metrics (nixl / kv_transfer / kv cache)")
            for line in metrics(pair.prefill_url, KV_METRICS):
                print("  ", line)
            time.sleep(11)  # the periodic stats loggers print every 10 s
            section("log lines (nixl / KV Transfer)")
            for role in ("prefill", "decode"):
                for line in grep_log(
                    pair.log_path(role),
                    ["KV Transfer", "nixl", "kv_connector", "KV cache usage", "handshake"],
                    0,
                    25,
                ):
                    print(f"  {role}:", line)

        if not args.no_experiments:
            experiment_close_early(
                client, pair, report, args.lease, key="a1", stream=True, busy=False
            )
            experiment_close_early(
                client, pair, report, args.lease, key="a2", stream=True, busy=True
            )
            experiment_close_early(
                client,
                pair,
                report,
                args.lease,
                key="b1",
                stream=False,
                busy=False,
                close_after=0.02,
            )
            experiment_close_early(
                client,
                pair,
                report,
                args.lease,
                key="b2",
                stream=False,
                busy=False,
                close_after=0.3,
            )
            experiment_close_early(
                client, pair, report, args.lease, key="b3", stream=False, busy=True, close_after=0.3
            )
            experiment_bogus(client, pair, report)

        report["rss_mb_end"] = {e.role: e.rss() // 2**20 for e in pair.engines}
        t_stop = time.monotonic()
    report["stop_s"] = time.monotonic() - t_stop
    report["pair_total_s"] = time.monotonic() - t0
    section("pair stopped")
    show("stop (s)", report["stop_s"])

    if not args.no_single:
        section("plain engine (no kv-transfer) vs the prefill engine's answers")
        with (
            SingleEngine(
                Path(args.work_dir) / "single" if args.work_dir else None, extra_args=extra
            ) as single,
            httpx.Client(timeout=120) as client,
        ):
            show("single engine timings (s)", single.timings)
            seen = set()
            for f in report.get("flows", []):
                key = json.dumps(f["baseline_body"], sort_keys=True)
                if key in seen:
                    continue
                seen.add(key)
                r = post_json(client, single.url + f["kind_path"], f["baseline_body"])
                ids = r["json"]["choices"][0].get("token_ids")
                same = ids == f["baseline_token_ids"]
                all_ok &= same
                print(
                    f"{f['kind']} stream={f['stream']}: "
                    f"plain engine == prefill-engine baseline: {same}"
                )
                show("  plain engine usage", r["json"].get("usage"))
            report["single_timings"] = single.timings

    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2, default=str))
    section(f"ALL TOKEN-ID COMPARISONS MATCH: {all_ok}")
    return 0 if all_ok else 1


if __name__ == "__main__":
    sys.exit(main())

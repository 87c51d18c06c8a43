"""SGLang's dialect: what pd-router (``--dialect sglang``) costs in front of engines that
speak it, against sglang-router (SGLang's own Rust router, PD mode) in front of the same
engines, in the same run.

Starts, on 127.0.0.1, one simulated prefill and two simulated decode engines in SGLang's
dialect (decode: ``--slots 256 --ttft 0 --itl 0``), pd-router (``--decode-slots
64``) and, when it is installed (``benchmarks/processes.py``: SGLANG_ROUTER_HINT),
sglang-router 0.3.2 (``--pd-disaggregation``, round robin, no retries, no circuit breaker,
no periodic health checks). Then:

* A, throughput: streaming ``/v1/completions``, ``--tokens`` (64) tokens, 64 clients,
  ``--requests`` (2000) per pass, ``--rounds`` (2) passes per router in alternating order:
  requests/s, TTFT p50/p99, each router's CPU ms per request;
* B, one client: ``--ttft-requests`` (300) sequential requests of 16 tokens per mode, the
  modes interleaved: MANUAL (the client sends both engines the request with a room itself:
  a router's job without the router), pd-router and sglang-router; TTFT percentiles and
  the router's own share (minus manual); then as many again through each router alone,
  for its CPU ms per request at one client.

It prints numbers and asserts nothing. Every process it starts is stopped by its PID.

    python benchmarks/sglang_bench.py [--quick] [--sglang-router PATH] [--json PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from benchmarks.processes import (  # noqa: E402
    SGLANG_ROUTER_HINT,
    SGLANG_ROUTER_VENV,
    SGLANG_ROUTER_VERSION,
    CpuMeter,
    SglangRouterProcess,
    event_loop_factory,
    find_sglang_router,
    raise_on_sigterm,
    running,
)
from benchmarks.report import log, machine_info, percentile  # noqa: E402
from benchmarks.workloads.requests import (  # noqa: E402
    FILLER,
    PATH,
    REQUEST_TIMEOUT,
    StreamResult,
    completion_body,
    new_session,
    stream_completion,
)
from benchmarks.workloads.throughput import throughput  # noqa: E402
from pd_router.engines import bootstrap  # noqa: E402
from pd_router.sim.fleet import RouterProcess, SimFleet  # noqa: E402

SGLANG = ["--dialect", "sglang"]
DECODE_ARGS = [*SGLANG, "--slots", "256", "--ttft", "0", "--itl", "0"]


async def manual(session: Any, prefill: str, decode: str, body: dict[str, Any]) -> StreamResult:
    """Both engines sent the request with a room at once, as a router does; TTFT from then."""
    start = time.perf_counter()
    host = bootstrap.host_of(prefill)
    sent = bootstrap.request(body, host, int(prefill.rsplit(":", 1)[1]))

    async def prefill_answer() -> None:
        async with session.post(prefill + PATH, json=sent, timeout=REQUEST_TIMEOUT) as answer:
            await answer.read()

    task = asyncio.ensure_future(prefill_answer())
    result = await stream_completion(session, decode + PATH, sent, want_ttft=True, started=start)
    await task
    return result


async def one_client(
    routers: dict[str, str], prefill: str, decodes: list[str], requests: int, warmup: int
) -> tuple[dict[str, list[float]], dict[str, Counter[str]]]:
    modes = ["manual", *routers]
    ttfts: dict[str, list[float]] = {mode: [] for mode in modes}
    errors: dict[str, Counter[str]] = {mode: Counter() for mode in modes}
    async with new_session() as session:
        for index in range(warmup + requests):
            for shift in range(len(modes)):
                mode = modes[(index + shift) % len(modes)]
                body = completion_body(f"b-{mode}-{index} {FILLER}", 16)
                if mode == "manual":
                    decode = decodes[index % len(decodes)]
                    result = await manual(session, prefill, decode, body)
                else:
                    result = await stream_completion(
                        session, routers[mode] + PATH, body, want_ttft=True
                    )
                if index < warmup:
                    continue
                if result.ok and result.ttft is not None:
                    ttfts[mode].append(result.ttft)
                else:
                    errors[mode][result.error or "no_text"] += 1
    return ttfts, errors


def ms(values: list[float], q: float) -> float:
    return percentile(values, q) * 1000.0 if values else float("nan")


async def bench(args: argparse.Namespace, fleet: SimFleet, routers: dict[str, Any]) -> dict:
    pids = {name: process.pid for name, process in routers.items()}
    urls = {name: process.url for name, process in routers.items()}
    prefill = fleet.prefill[0].url
    decodes = [engine.url for engine in fleet.decode]
    log(f"warm-up: 100 requests per router; pids {pids}")
    for url in urls.values():
        await throughput([url], requests=100, concurrency=8, tokens=8, time_cap=60, tag="warm")
    a: dict[str, dict[str, list[float]]] = {
        name: {"cpu": [], "rps": [], "ttft": []} for name in routers
    }
    a_errors: Counter[str] = Counter()
    for round_ in range(args.rounds):
        order = list(routers) if round_ % 2 == 0 else list(reversed(routers))
        for name in order:
            meter = CpuMeter({name: pids[name]})
            ttfts: list[float] = []
            meter.start()
            sent, _, outcomes, seconds, _ = await throughput(
                [urls[name]],
                requests=args.requests,
                concurrency=64,
                tokens=args.tokens,
                time_cap=120,
                tag=f"a{round_}{name}",
                ttfts=ttfts,
            )
            used = meter.stop()
            ok = outcomes.pop("ok", 0)
            a_errors.update({f"{name}:{kind}": n for kind, n in outcomes.items()})
            a[name]["cpu"].append(used[name] / max(sent, 1))
            a[name]["rps"].append(ok / seconds)
            a[name]["ttft"].extend(ttfts)
            log(
                f"  A round {round_ + 1} {name:14} {ok} ok {ok / seconds:7.1f} req/s  "
                f"CPU {used[name] / max(sent, 1):.3f} ms/request  TTFT p50/p99 "
                f"{ms(ttfts, 50):.1f}/{ms(ttfts, 99):.1f} ms"
            )
    log(f"B: one client, {args.ttft_requests} sequential requests per mode, interleaved")
    b_ttfts, b_errors = await one_client(urls, prefill, decodes, args.ttft_requests, 20)
    # CPU at one client, one router at a time: interleaved, a router that waits tens of ms
    # between its requests (sglang-router's) leaves the others' caches cold, and theirs.
    b_cpu = {}
    async with new_session() as session:
        for name, url in urls.items():
            meter = CpuMeter({name: pids[name]})
            meter.start()
            for index in range(args.ttft_requests):
                body = completion_body(f"c-{name}-{index} {FILLER}", 16)
                await stream_completion(session, url + PATH, body)
            b_cpu[name] = meter.stop()[name] / args.ttft_requests
    return {
        "a": {
            name: {
                "cpu_ms_per_request": statistics.fmean(numbers["cpu"]),
                "requests_per_s": statistics.fmean(numbers["rps"]),
                "ttft_p50_ms": ms(numbers["ttft"], 50),
                "ttft_p99_ms": ms(numbers["ttft"], 99),
            }
            for name, numbers in a.items()
        },
        "a_errors": dict(a_errors),
        "b": {
            mode: {q: ms(values, int(q[1:])) for q in ("p50", "p90", "p99")}
            for mode, values in b_ttfts.items()
        },
        "b_errors": {mode: dict(counts) for mode, counts in b_errors.items() if counts},
        "b_cpu_ms_per_request": b_cpu,
    }


def report(results: dict[str, Any], args: argparse.Namespace) -> None:
    print("=" * 88)
    machine = machine_info()
    print(f"machine: nproc={machine['nproc']} {machine['cpu_model']} python {machine['python']}")
    print(f"load average at start: {results['loadavg_start']}  at end: {results['loadavg_end']}")
    print(
        f"fleet: 1 prefill + 2 decode sim engines (decode: {' '.join(DECODE_ARGS)}); "
        "pd-router --dialect sglang --decode-slots 64"
    )
    print(f"\nA. 64 clients, {args.requests} streamed requests x {args.rounds} rounds, "
          f"{args.tokens} tokens")  # fmt: skip
    print(f"   {'':24}{'CPU ms/request':>16}{'requests/s':>12}{'TTFT p50':>10}{'TTFT p99':>10}")
    for name, row in results["a"].items():
        print(
            f"   {name:24}{row['cpu_ms_per_request']:16.3f}{row['requests_per_s']:12.1f}"
            f"{row['ttft_p50_ms']:10.2f}{row['ttft_p99_ms']:10.2f}"
        )
    if results["a_errors"]:
        print(f"   errors: {results['a_errors']}")
    print(f"\nB. one client, {args.ttft_requests} requests per mode, 16 tokens, interleaved")
    print(f"   {'TTFT ms':24}{'p50':>8}{'p90':>8}{'p99':>8}")
    for mode, row in results["b"].items():
        print(f"   {mode:24}{row['p50']:8.2f}{row['p90']:8.2f}{row['p99']:8.2f}")
    manual = results["b"]["manual"]
    for mode, row in results["b"].items():
        if mode != "manual":
            print(
                f"   {mode}'s own (- manual): p50 {row['p50'] - manual['p50']:+.2f} ms, "
                f"p99 {row['p99'] - manual['p99']:+.2f} ms"
            )
    if results["b_errors"]:
        print(f"   errors: {results['b_errors']}")
    more = args.ttft_requests
    print(f"   router CPU ms per request at one client ({more} more, one router at a time):")
    for name, value in results["b_cpu_ms_per_request"].items():
        print(f"     {name:22}{value:.3f}")
    a = results["a"]
    if "sglang-router" in a:
        ours, theirs = a["pd-router"], a["sglang-router"]
        print(
            "\npd-router vs sglang-router (same engines, same run): A CPU ms/request "
            f"{ours['cpu_ms_per_request']:.3f} vs {theirs['cpu_ms_per_request']:.3f} "
            f"({ours['cpu_ms_per_request'] / theirs['cpu_ms_per_request']:.2f}x); B "
            f"{results['b_cpu_ms_per_request']['pd-router']:.3f} vs "
            f"{results['b_cpu_ms_per_request']['sglang-router']:.3f}"
        )


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=2000, help="workload A per pass")
    parser.add_argument("--rounds", type=int, default=2, help="workload A passes per router")
    parser.add_argument("--tokens", type=int, default=64, help="workload A max_tokens")
    parser.add_argument("--ttft-requests", type=int, default=300, help="workload B per mode")
    parser.add_argument("--quick", action="store_true", help="300 x 1 round; B 100")
    parser.add_argument("--sglang-router", metavar="PATH", help="the executable to compare")
    parser.add_argument("--json", metavar="PATH", help="also write every number as JSON")
    args = parser.parse_args(argv)
    if args.quick:
        args.requests, args.rounds, args.ttft_requests = 300, 1, 100
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    restore = raise_on_sigterm()
    executable = args.sglang_router or find_sglang_router()
    if executable is None:
        log(SGLANG_ROUTER_HINT.format(venv=SGLANG_ROUTER_VENV, version=SGLANG_ROUTER_VERSION))
    random.seed()
    try:
        with SimFleet(1, 2, prefill_args=SGLANG, decode_args=DECODE_ARGS) as fleet:
            prefill = fleet.prefill[0]
            decodes = [engine.url for engine in fleet.decode]
            # The sim serves its bootstrap on its HTTP port.
            routers: dict[str, Any] = {
                "pd-router": RouterProcess(
                    [f"{prefill.url},bootstrap_port={prefill.port}"],
                    decodes,
                    *SGLANG,
                    "--decode-slots",
                    "64",
                    "--log-level",
                    "warning",
                )
            }
            if executable is not None:
                routers["sglang-router"] = SglangRouterProcess(
                    executable, [(prefill.url, prefill.port)], decodes
                )
            with running(routers.values()):
                results: dict[str, Any] = {"loadavg_start": os.getloadavg()}
                with asyncio.Runner(loop_factory=event_loop_factory()) as runner:
                    results.update(runner.run(bench(args, fleet, routers)))
                results["loadavg_end"] = os.getloadavg()
    finally:
        restore()
    report(results, args)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2, default=str))
        print(f"results written to {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

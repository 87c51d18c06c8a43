"""What ``--state redis://...`` costs the router: CPU per request and added TTFT.

    python benchmarks/state_cost.py --quick          # ~10 s
    python benchmarks/state_cost.py                  # ~90 s: 6 rounds of 5000 + 1000
    python benchmarks/state_cost.py --decode-slots 1024 --profile

Starts, on 127.0.0.1, one set of simulated engines (1 prefill, 2 decode, instant: ``--ttft 0
--itl 0 --slots 256``, as stream_bench.py does), one redis-server (``tests/redis_server.py``)
and two routers in front of the same engines, both ``--decode-slots`` 64: A keeps its slots
in its own process, B shares them through that Redis (``--state``). Each round then runs,
on A and B in turn (A first in odd rounds, B first in even ones, so that the machine's
noise falls on both alike):

1. throughput: ``--requests`` streaming ``/v1/completions`` (64 clients, ``max_tokens`` 64)
   through each router; the router's CPU milliseconds per request (utime + stime from
   /proc), and redis-server's, as it is part of what B costs. A pass ends when Redis counts
   no slot reserved any more (B's releases are sent by a worker after the responses), so
   that each pass pays for its own releases; meanwhile Redis's count is sampled every
   0.1 s: above the 64 requests in flight, it is releases not sent yet;
2. sequential: ``--ttft-requests`` streams per router from one keep-alive client
   (``max_tokens`` 16), A and B alternating request by request: TTFT, from sending the
   request to the first SSE event, and CPU per request without concurrency.

Prints each round, then a table of A, B and B - A next to issue 22's targets (router CPU
per request at most +0.08 ms, with 64 clients and with one; TTFT p50 at most +0.3 ms). It
reports; it asserts nothing.
When B answers 429s that A does not (Redis counted its slots as taken), its CPU per request
is not like for like: more ``--decode-slots`` measures it without them. ``--profile`` adds
a pass per router with py-spy attached and lists, by function, the router's own time per
request in A and in B, where B spends more first.

Every process it starts (engines, routers, redis-server, py-spy) is stopped by its PID on
every exit path, SIGTERM and Ctrl-C included.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import statistics
import sys
import tempfile
import time
from asyncio.subprocess import DEVNULL, PIPE
from collections import Counter
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType

import aiohttp

# benchmarks/ and tests/ are not installed: import them from this checkout.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.processes import (  # noqa: E402
    CLK_TCK,
    PY_SPY_RATE,
    CpuMeter,
    event_loop_factory,
    py_spy_command,
    raise_on_sigterm,
    read_profile,
    run_coroutine,
)
from benchmarks.report import log, percentile  # noqa: E402
from benchmarks.workloads.requests import (  # noqa: E402
    FILLER,
    PATH,
    completion_body,
    new_session,
    stream_completion,
)
from benchmarks.workloads.throughput import throughput  # noqa: E402
from pd_router.shared.redis import Redis, Settings  # noqa: E402
from pd_router.sim.fleet import RouterProcess, SimFleet  # noqa: E402
from tests.redis_server import RedisServer  # noqa: E402

TARGET_CPU_MS = 0.08  # issue 22: router CPU per request, B - A
TARGET_TTFT_P50_MS = 0.3  # issue 22: TTFT at p50, one client, B - A
DECODE_ARGS = ("--standalone", "--slots", "256", "--ttft", "0", "--itl", "0")
ROUTERS = ("A", "B")
TIME_CAP = 120.0  # seconds per throughput pass
# Redis's count of reserved slots per node, all routers together (shared/scripts.py).
USED_KEY = "{pdr}:used"
DRAIN_SECONDS = 30.0
COUNTS = ("answered 429 (no slot)", "slots reserved in Redis, most")  # rows without decimals


@dataclass
class Pass:
    """One router's throughput pass, and the CPU every process used meanwhile."""

    router: str
    round: int
    requests: int
    seconds: float
    errors: Counter[str]
    cpu_ms: dict[str, float]
    capped: bool
    most_reserved: int  # the most slots Redis counted as reserved, sampled every 0.1 s
    drain_seconds: float  # after the last response, until Redis counted no slot reserved
    other_busy_pct: float  # of the machine, by processes this script did not start

    def per_request(self, process: str) -> float:
        return self.cpu_ms[process] / max(self.requests, 1)

    def describe(self) -> str:
        capped = "  (time cap hit)" if self.capped else ""
        return (
            f"  round {self.round} throughput {self.router}:"
            f" {self.requests / self.seconds:6.1f} req/s"
            f"  router {self.per_request(self.router):.3f} ms/req"
            f"  redis {self.per_request('redis'):.3f} ms/req"
            f"  Redis: up to {self.most_reserved} slots reserved, 0 after"
            f" {self.drain_seconds:.2f} s  other load {self.other_busy_pct:.0f}%"
            f"  errors={dict(self.errors) or 0}{capped}"
        )


@dataclass
class Latency:
    """Sequential TTFT samples per router (seconds), and what the routers used meanwhile."""

    samples: dict[str, list[float]] = field(default_factory=lambda: {r: [] for r in ROUTERS})
    errors: dict[str, Counter[str]] = field(default_factory=lambda: {r: Counter() for r in ROUTERS})
    cpu_ms: Counter[str] = field(default_factory=Counter)
    sent: int = 0  # per router

    def ms(self, router: str, q: float, start: int = 0, stop: int | None = None) -> float:
        values = self.samples[router][start:stop]
        return percentile(values, q) * 1000.0 if values else float("nan")


async def first_event_time(
    session: aiohttp.ClientSession, url: str, tokens: int, tag: str
) -> tuple[float, str]:
    """Seconds from sending a streamed request to its first SSE event, and "" or what failed."""
    first: list[float] = []

    def on_event(_: bytes) -> None:
        if not first:
            first.append(time.perf_counter())

    body = completion_body(f"{tag} {FILLER}", tokens)
    start = time.perf_counter()
    result = await stream_completion(session, url + PATH, body, on_event=on_event)
    if not result.ok or not first:
        return float("nan"), result.error or "no_event"
    return first[0] - start, ""


@contextlib.asynccontextmanager
async def py_spy(command: list[str]) -> AsyncIterator[asyncio.subprocess.Process]:
    """py-spy running for the block; killed by its PID if it still runs at the end."""
    process = await asyncio.create_subprocess_exec(
        *command, stdin=DEVNULL, stdout=DEVNULL, stderr=PIPE
    )
    try:
        yield process
    finally:
        if process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                process.kill()
            await process.wait()


class StateCost:
    def __init__(
        self, args: argparse.Namespace, urls: dict[str, str], pids: dict[str, int], redis: int
    ) -> None:
        self.args = args
        self.urls = urls
        self.pids = pids  # routers, redis-server and engines: CpuMeter's "other" is the rest
        self.redis = Redis(Settings("127.0.0.1", redis), timeout=5.0)
        self.passes: list[Pass] = []
        self.latency = Latency()
        # Where each round's TTFT samples start, per router.
        self.round_starts: list[dict[str, int]] = []
        self.profiles: dict[str, tuple[Counter[str], int, str]] = {}
        self.loadavg: list[tuple[float, float, float]] = []

    async def run(self) -> None:
        async with self.redis:
            await self._run()

    async def _run(self) -> None:
        args = self.args
        self.loadavg.append(os.getloadavg())
        log(f"warm-up: {2 * args.concurrency} streams and 20 sequential requests per router")
        for router in ROUTERS:
            warm = await self._throughput(router, 0, 2 * args.concurrency)
            if warm.errors:
                raise RuntimeError(f"warm-up through {router} failed: {dict(warm.errors)}")
        await self._ttft(0, 20, record=False)
        for round_ in range(1, args.rounds + 1):
            # A first in odd rounds, B first in even ones.
            for router in sorted(ROUTERS, reverse=round_ % 2 == 0):
                self.passes.append(await self._throughput(router, round_, args.requests))
                log(self.passes[-1].describe())
            self.round_starts.append({r: len(self.latency.samples[r]) for r in ROUTERS})
            await self._ttft(round_, args.ttft_requests)
            p50 = {r: self.latency.ms(r, 50, self.round_starts[-1][r]) for r in ROUTERS}
            log(
                f"  round {round_} TTFT p50: A {p50['A']:.3f} ms  B {p50['B']:.3f} ms"
                f"  B - A {p50['B'] - p50['A']:+.3f} ms"
            )
        if args.profile:
            for router in ROUTERS:
                await self._profile(router)
        self.loadavg.append(os.getloadavg())

    async def reserved(self) -> int:
        """Slots Redis counts as reserved: taken and not yet given back by a release."""
        return sum(int(count) for count in await self.redis.call("HVALS", USED_KEY))

    async def drained(self) -> float:
        """Seconds until Redis counts no slot reserved: router B's releases are sent by a
        worker, after the responses ended, and belong to the pass that caused them."""
        start = time.perf_counter()
        while left := await self.reserved():
            if time.perf_counter() - start > DRAIN_SECONDS:
                log(f"  Redis still counts {left} slots reserved after {DRAIN_SECONDS:g} s")
                break
            await asyncio.sleep(0.01)
        return time.perf_counter() - start

    async def _throughput(self, router: str, round_: int, requests: int) -> Pass:
        most = 0
        done = asyncio.Event()

        async def watch() -> None:
            nonlocal most
            while not done.is_set():
                most = max(most, await self.reserved())
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(done.wait(), 0.1)

        meter = CpuMeter(self.pids)
        meter.start()
        watcher = asyncio.create_task(watch())
        try:
            sent, _, outcomes, seconds, capped = await throughput(
                [self.urls[router]],
                requests=requests,
                concurrency=self.args.concurrency,
                tokens=self.args.tokens,
                time_cap=TIME_CAP,
                tag=f"{router}{round_}-{time.monotonic_ns()}",
            )
        finally:
            done.set()
            await watcher
        drain = await self.drained()
        used = meter.stop()
        outcomes.pop("ok", None)
        capacity = (seconds + drain) * 1000.0 * (os.cpu_count() or 1)
        other = used["other"] / capacity * 100
        return Pass(router, round_, sent, seconds, outcomes, used, capped, most, drain, other)

    async def _ttft(self, round_: int, requests: int, *, record: bool = True) -> None:
        """One client, one request at a time, A and B alternating (who goes first too)."""
        meter = CpuMeter(self.pids)
        meter.start()
        async with new_session() as session:
            for i in range(requests):
                order = ROUTERS if (i + round_) % 2 == 0 else ROUTERS[::-1]
                for router in order:
                    tag = f"ttft-{router}{round_}-{i}"
                    seconds, error = await first_event_time(
                        session, self.urls[router], self.args.ttft_tokens, tag
                    )
                    if not record:
                        continue
                    if error:
                        self.latency.errors[router][error] += 1
                    else:
                        self.latency.samples[router].append(seconds)
        await self.drained()
        used = meter.stop()
        if record:
            self.latency.cpu_ms.update(used)
            self.latency.sent += requests

    async def _profile(self, router: str) -> None:
        """An extra throughput pass with py-spy on ``router``; not in the table above."""
        args = self.args
        out = Path(tempfile.gettempdir()) / f"state-cost-profile-{router}.txt"
        command = py_spy_command(self.pids[router], args.profile_seconds, str(out), args.native)
        if command is None:
            log("profile: py-spy not found (pip install py-spy), skipped")
            return
        log(f"profile: py-spy on router {router} for {args.profile_seconds} s of throughput load")
        out.unlink(missing_ok=True)
        async with py_spy(command) as spy:
            await asyncio.sleep(0.5)  # attached before the load starts
            meter = CpuMeter(self.pids)
            meter.start()
            # As many requests as fit in py-spy's window.
            sent, *_ = await throughput(
                [self.urls[router]],
                requests=10**9,
                concurrency=args.concurrency,
                tokens=args.tokens,
                time_cap=args.profile_seconds - 1.0,
                tag=f"profile-{router}",
            )
            used = meter.stop()
            _, stderr = await asyncio.wait_for(spy.communicate(), 60)
        if spy.returncode != 0 or not out.exists():
            log(f"profile: py-spy exited {spy.returncode}: {stderr.decode(errors='replace')}")
            return
        profile = read_profile(out, top=10**6)
        own = Counter(dict(profile.top_own))
        log(
            f"  {sent} requests, router CPU {used[router] / max(sent, 1):.3f} ms/req with py-spy"
            f" attached, {profile.samples} samples"
        )
        self.profiles[router] = (own, sent, str(out))

    # ------------------------------------------------------------------ report

    def rejected(self, router: str) -> int:
        """Throughput requests ``router`` answered with 429."""
        return sum(run.errors["http_429"] for run in self.passes if run.router == router)

    def cpu(self, router: str, process: str) -> float:
        """CPU ms per request of ``process`` over ``router``'s throughput passes."""
        runs = [run for run in self.passes if run.router == router]
        return sum(run.cpu_ms[process] for run in runs) / max(sum(r.requests for r in runs), 1)

    def print_report(self, redis_url: str) -> None:
        args = self.args
        print()
        print(f"A: router without --state;  B: router --state {redis_url}")
        flags = f"--decode-slots {args.decode_slots}"
        if args.queue_timeout is not None:
            flags += f" --queue-timeout {args.queue_timeout:g}"
        print(
            f"both {flags}, in front of the same 1 prefill + 2 instant decode sim engines; "
            f"{args.rounds} rounds, A and B alternating"
        )
        print(
            f"throughput: {args.requests} streams per router per round, {args.concurrency} "
            f"clients, max_tokens {args.tokens}"
        )
        print(
            f"sequential: {args.ttft_requests} streams per router per round, 1 keep-alive "
            f"client, max_tokens {args.ttft_tokens}; TTFT = request sent -> first SSE event"
        )
        print()
        print(f"{'':36}{'A':>10}{'B':>10}{'B - A':>10}   target (issue 22)")
        for label, values, bound in self._rows():
            a, b = values["A"], values["B"]
            digits = 0 if label.strip() in COUNTS else 3
            cells = [f"{v:10.{digits}f}" if v == v else f"{'-':>10}" for v in (a, b)]
            cells.append(f"{b - a:+10.{digits}f}" if b - a == b - a else f"{'-':>10}")
            target = ""
            if bound is not None:
                verdict = "met" if round(b - a, 3) <= bound else "OVER"
                under_load = label.strip() == "router CPU ms/request"
                if under_load and self.rejected("B") > self.rejected("A"):
                    verdict = "not like for like: B's 429s, below"
                target = f"   <= +{bound}  {verdict}"
            print(f"{label:36}{''.join(cells)}{target}")
        print()
        self._print_spread()
        self._print_errors()
        print(
            "load average at start and end: "
            + ",  ".join(" ".join(f"{v:.2f}" for v in avg) for avg in self.loadavg)
        )
        if self.profiles:
            self._print_profiles()

    def _rows(self) -> list[tuple[str, dict[str, float], float | None]]:
        """(label, value for A and for B, issue 22's bound on B - A or None)."""
        latency = self.latency

        def each(value: Callable[[list[Pass]], float]) -> dict[str, float]:
            return {r: value([p for p in self.passes if p.router == r]) for r in ROUTERS}

        def ttft(q: float) -> dict[str, float]:
            return {r: latency.ms(r, q) for r in ROUTERS}

        def mean_ttft(router: str) -> float:
            samples = latency.samples[router]
            return statistics.fmean(samples) * 1000.0 if samples else float("nan")

        router_cpu = {r: self.cpu(r, r) for r in ROUTERS}
        redis_cpu = {r: self.cpu(r, "redis") for r in ROUTERS}
        sent = max(latency.sent, 1)
        return [
            ("throughput: requests/s",
             each(lambda runs: sum(p.requests for p in runs) / sum(p.seconds for p in runs)),
             None),
            ("  answered 429 (no slot)", {r: self.rejected(r) for r in ROUTERS}, None),
            ("  router CPU ms/request", router_cpu, TARGET_CPU_MS),
            ("  redis-server CPU ms/request", redis_cpu, None),
            ("  router + redis-server", {r: router_cpu[r] + redis_cpu[r] for r in ROUTERS}, None),
            ("  slots reserved in Redis, most",
             each(lambda runs: max(p.most_reserved for p in runs)), None),
            ("  s to drain them after a pass, most",
             each(lambda runs: max(p.drain_seconds for p in runs)), None),
            ("sequential: router CPU ms/request",
             {r: latency.cpu_ms[r] / sent for r in ROUTERS}, TARGET_CPU_MS),
            # Redis works for B only: its CPU over the phase, per request of B.
            ("  redis-server CPU ms/request",
             {"A": float("nan"), "B": latency.cpu_ms["redis"] / sent}, None),
            ("  TTFT p50 ms", ttft(50), TARGET_TTFT_P50_MS),
            ("  TTFT p90 ms", ttft(90), None),
            ("  TTFT p99 ms", ttft(99), None),
            ("  TTFT mean ms", {r: mean_ttft(r) for r in ROUTERS}, None),
        ]  # fmt: skip

    def _print_errors(self) -> None:
        for router in ROUTERS:
            errors = sum((p.errors for p in self.passes if p.router == router), Counter())
            errors += self.latency.errors[router]
            if errors:
                print(f"errors through {router}: {dict(errors)}")
        rejected = {r: self.rejected(r) for r in ROUTERS}
        if rejected["B"] > rejected["A"]:
            most = max(p.most_reserved for p in self.passes if p.router == "B")
            print(
                f"B answered {rejected['B']} throughput requests with 429 (A: {rejected['A']}): "
                f"Redis counted up to {most} slots reserved while at most "
                f"{self.args.concurrency} requests were in flight, releases still on their way. "
                "A 429 costs less than a stream, so B's CPU per request is not like for like; "
                "more --decode-slots (both routers) measures it without them."
            )  # fmt: skip

    def _print_spread(self) -> None:
        """Per round, so that the reader sees how much of B - A is noise."""
        cpu_deltas, ttft_deltas = [], []
        for round_ in range(1, self.args.rounds + 1):
            runs = {p.router: p for p in self.passes if p.round == round_}
            cpu_deltas.append(runs["B"].per_request("B") - runs["A"].per_request("A"))
            bounds = {
                r: (
                    (self.round_starts[round_ - 1][r], self.round_starts[round_][r])
                    if round_ < len(self.round_starts)
                    else (self.round_starts[round_ - 1][r], None)
                )
                for r in ROUTERS
            }
            p50 = {r: self.latency.ms(r, 50, *bounds[r]) for r in ROUTERS}
            ttft_deltas.append(p50["B"] - p50["A"])
        print("per round, B - A:")
        print("  router CPU ms/request " + " ".join(f"{d:+.3f}" for d in cpu_deltas))
        print("  TTFT p50 ms           " + " ".join(f"{d:+.3f}" for d in ttft_deltas))
        tick = 1000.0 / CLK_TCK
        print(
            f"  (CPU is counted in {tick:g} ms clock ticks: a resolution of "
            f"{tick / max(self.args.requests, 1):.4f} ms/request in a round, "
            f"{tick / max(self.args.requests * self.args.rounds, 1):.4f} over all rounds)"
        )
        print()

    def _print_profiles(self) -> None:
        """Own time per request by function, B against A, largest B - A first."""
        if set(self.profiles) != set(ROUTERS):
            return
        per_request: dict[str, dict[str, float]] = {}
        for router, (own, sent, _) in self.profiles.items():
            scale = 1000.0 / PY_SPY_RATE / max(sent, 1)  # samples -> ms per request
            per_request[router] = {frame: count * scale for frame, count in own.items()}
        frames = set(per_request["A"]) | set(per_request["B"])
        diff = {f: per_request["B"].get(f, 0.0) - per_request["A"].get(f, 0.0) for f in frames}
        total = {r: sum(per_request[r].values()) for r in ROUTERS}
        print()
        print(
            f"py-spy, own time by function, ms per request (sampled at {PY_SPY_RATE} Hz; "
            f"all frames: A {total['A']:.3f}, B {total['B']:.3f}, B - A "
            f"{total['B'] - total['A']:+.3f}); largest B - A first:"
        )
        print(f"{'A':>8}{'B':>8}{'B - A':>8}  function")
        for frame in sorted(frames, key=lambda f: -diff[f])[: self.args.profile_top]:
            a, b = per_request["A"].get(frame, 0.0), per_request["B"].get(frame, 0.0)
            print(f"{a:8.3f}{b:8.3f}{b - a:+8.3f}  {frame}")
        print(
            f"collapsed stacks: {self.profiles['A'][2]} and {self.profiles['B'][2]}"
            + ("" if self.args.native else "  (--profile-native: C frames too)")
        )


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="2 rounds of 500 + 200")
    parser.add_argument("--rounds", type=int, help="default 6 (--quick: 2)")
    parser.add_argument(
        "--requests", type=int, help="throughput streams per router per round (5000; --quick 500)"
    )
    parser.add_argument(
        "--ttft-requests", type=int, help="sequential streams per router per round (1000; 200)"
    )
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=64, help="max_tokens, throughput")
    parser.add_argument("--ttft-tokens", type=int, default=16, help="max_tokens, TTFT")
    parser.add_argument("--decode-slots", type=int, default=64, help="both routers, per node")
    parser.add_argument(
        "--queue-timeout", type=float, help="both routers (default: the router's, 0: no queue)"
    )
    parser.add_argument("--profile", action="store_true", help="py-spy on each router after")
    parser.add_argument("--profile-seconds", type=int, default=10)
    parser.add_argument("--profile-top", type=int, default=20, help="functions listed")
    parser.add_argument("--profile-native", dest="native", action="store_true")
    args = parser.parse_args(argv)
    defaults = (2, 500, 200) if args.quick else (6, 5000, 1000)
    for name, default in zip(("rounds", "requests", "ttft_requests"), defaults):
        if getattr(args, name) is None:
            setattr(args, name, default)
    return args


@contextlib.contextmanager
def signals_held() -> Iterator[None]:
    """SIGTERM and SIGINT wait for the end of the block, then are delivered as usual.

    One that lands while ``subprocess.Popen`` waits for its child's ``exec`` raises there,
    before the PID is anyone's to stop: that child would outlive this script. Held while
    processes start, a signal ends the run once every one of them is in the ExitStack.
    """
    held: list[int] = []

    def hold(signum: int, frame: FrameType | None) -> None:
        held.append(signum)

    kept = (signal.SIGTERM, signal.SIGINT)
    previous = {sig: signal.getsignal(sig) for sig in kept}
    for sig, handler in previous.items():
        if handler is not signal.SIG_IGN:  # a background job ignores SIGINT: so do we
            signal.signal(sig, hold)
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        for signum in held[:1]:
            signal.raise_signal(signum)


def start_processes(
    stack: contextlib.ExitStack, args: argparse.Namespace
) -> tuple[SimFleet, RedisServer, dict[str, RouterProcess]]:
    """Engines, redis-server and routers A and B, each stopped by its PID when ``stack``
    closes."""
    log("starting 1 prefill + 2 decode sim engines, redis-server and 2 routers")
    fleet = stack.enter_context(SimFleet(prefill=1, decode=2, decode_args=DECODE_ARGS))
    redis = stack.enter_context(RedisServer())
    engines = ([fleet.prefill[0].url], [engine.url for engine in fleet.decode])
    flags = ("--decode-slots", str(args.decode_slots))
    if args.queue_timeout is not None:
        flags += ("--queue-timeout", str(args.queue_timeout))
    routers = {
        "A": RouterProcess(*engines, *flags),
        "B": RouterProcess(*engines, *flags, "--state", redis.url),
    }
    for router in routers.values():
        stack.enter_context(router)
    return fleet, redis, routers


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    wall = time.perf_counter()
    with contextlib.ExitStack() as stack:
        # Unwound in reverse: every process is stopped before SIGTERM's handler is restored.
        stack.callback(raise_on_sigterm())
        with signals_held():
            fleet, redis, routers = start_processes(stack, args)
        pids = {name: router.pid for name, router in routers.items()}
        pids["redis"] = redis.pid
        log("pids: " + "  ".join(f"{name}={pid}" for name, pid in pids.items()))
        pids.update({f"engine{i}": engine.pid for i, engine in enumerate(fleet.engines)})
        bench = StateCost(
            args,
            {name: router.url for name, router in routers.items()},
            {name: pid for name, pid in pids.items() if pid is not None},
            redis.port,
        )
        with asyncio.Runner(loop_factory=event_loop_factory()) as runner:
            run_coroutine(runner, bench.run())
    bench.print_report(redis.url)
    log(f"total wall time: {time.perf_counter() - wall:.1f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

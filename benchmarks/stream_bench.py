"""Streaming benchmark: what pd-router costs next to talking to a decode engine directly.

Starts, on 127.0.0.1, one simulated prefill engine, two simulated decode engines (instant:
``--ttft 0 --itl 0``, ``--standalone`` so they also serve plain requests), ``python -m
pd_router`` in front of them and, when it is installed, vllm-router (the Rust router from
PyPI, in its vLLM P/D mode) next to it, in front of the same engines. Then it drives them
from this process with asyncio + aiohttp:

* Workload A, throughput: streaming ``/v1/completions`` from many concurrent clients,
  DIRECT (round-robin over both decode engines), ROUTED (through pd-router), ROUTED with
  ``--state`` (a second pd-router sharing a redis-server) and VLLM-ROUTER, in alternating
  order. Reports requests/s, chunks/s, TTFT p50/p99, the ratios to direct, errors, and
  CPU milliseconds per request of each router and engine (``/proc/<pid>/stat``).
* Workload B, added TTFT: one client, sequential requests, interleaving DIRECT, MANUAL P/D
  (this client calls the prefill engine, then the decode engine with the returned
  ``kv_transfer_params``: what a router does, minus the router), the routers; and each
  router's CPU per request at one client.
* Workload D, open streams: a second pd-router, in front of the same prefill engine and two
  extra slow decode engines (``--itl 0.05``), holds ``--streams`` streams open at once;
  reports its RSS per open stream, errors and effective tokens/s. Then vllm-router alone in
  front of the same engines, the same way.

Last, issue 22's targets, each met or not, from this run's numbers.

The routed path does more work than the direct one: a real prefill request and a KV pull
from the prefill engine. ROUTED - DIRECT is what a client sees; ROUTED - MANUAL P/D is
the router's own share of it.

Every process shares the machine's cores, so numbers are noisy: compare each number with
its in-run baseline, not with another run. It prints numbers; it asserts nothing.

    python benchmarks/stream_bench.py [--quick] [--streams N] [--profile] [--json PATH]
                                      [--vllm-router PATH | --install-vllm-router]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import os
import resource
import subprocess  # nosec B404
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from benchmarks.processes import (  # noqa: E402
    PY_SPY_RATE,
    VLLM_ROUTER_FAIR_ARGS,
    VLLM_ROUTER_HINT,
    VLLM_ROUTER_VENV,
    VLLM_ROUTER_VERSION,
    CpuMeter,
    Profile,
    VllmRouterProcess,
    event_loop_factory,
    find_vllm_router,
    install_vllm_router,
    proc_status,
    py_spy_command,
    raise_nofile_limit,
    raise_on_sigterm,
    read_profile,
    run_coroutine,
    vllm_router_version,
)
from benchmarks.report import log, machine_info, percentile  # noqa: E402
from benchmarks.workloads.added_ttft import LatencySummary, added_ttft  # noqa: E402
from benchmarks.workloads.open_streams import StreamsRun, hold_streams  # noqa: E402
from benchmarks.workloads.requests import PATH  # noqa: E402
from benchmarks.workloads.throughput import ThroughputRun, throughput  # noqa: E402
from pd_router.sim.fleet import RouterProcess, ServerProcess, SimFleet  # noqa: E402
from tests.redis_server import RedisServer  # noqa: E402

OTHER_LOAD_WARNING_PCT = 10.0

# Where a request's time goes (issue 22's table), from the profile's stacks: a sample
# belongs to the phase of the innermost frame that names one (``phase_of``). Engine I/O
# (a request's write, its answer's parsing) is the phase of the relay step that waited for
# it; callbacks the event loop runs on its own (a socket's bytes parsed) are their own rows.
PHASES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("log line", ("(pd_router/ops/logs.py", "(logging/")),
    ("metrics", ("(pd_router/ops/metrics.py", "Relay._report ")),
    ("parse (JSON)", ("parse_body ",)),
    ("validate", ("(pd_router/edge/validation.py",)),
    ("pick (prefill policy)", ("(pd_router/fleet/prefill.py", "(pd_router/fleet/holdings.py")),
    (
        "release",
        (
            "Reservation.release ",
            "DecodePool._give_back ",
            "Relay.close_upstream ",
            "Response.close ",
            "Upstream.release ",
            "Fleet.leave ",
        ),
    ),
    (
        "reserve",
        ("(pd_router/fleet/pool.py", "Fleet.bind ", "Fleet.admit ", "Relay._reserve "),
    ),
    ("prefill call", ("Relay._prefill_on ", "Relay._prefill ")),
    ("hand-off (decode request)", ("Relay._handoff_to ", "Relay._decode ")),
    # Poured events are written from the engine connection's callback (``_Pour.feed``).
    ("relay events", ("Relay._relay_events ", "_Pour.feed ", "(pd_router/engines/sse.py")),
    ("disconnect watcher", ("Relay._watch ", "_spawn_watcher ")),
    (
        "request head, body read, relay set-up",
        ("OpenAIRoute.__call__ ", "RouterApp.__call__ ", "Relay.__init__ ", "Relay.__call__ "),
    ),
    ("engine bytes in (protocol callbacks)", ("(pd_router/engines/connection.py",)),
    ("client bytes in (uvicorn)", ("(uvicorn/",)),
    ("event loop (epoll, socket reads, wake-ups)", ("Runner.run ",)),
)


# The last phases are what the others call too (an engine request's write, a client's
# event's): a stack is theirs only when no other phase is on it.
_LOW_LEVEL = 3


def phase_of(frames: Sequence[str]) -> str:
    """The phase of one sampled stack (root first)."""
    for rules in (PHASES[:-_LOW_LEVEL], PHASES[-_LOW_LEVEL:]):
        for frame in reversed(frames):
            for phase, marks in rules:
                if any(mark in frame for mark in marks):
                    return phase
    return "other (background work, GC, ...)"


def phase_samples(raw_path: Path) -> Counter[str]:
    """Samples per phase in py-spy's collapsed stacks (\"f1;f2;leaf count\" per line)."""
    phases: Counter[str] = Counter()
    for line in raw_path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if stack and count.isdigit():
            phases[phase_of(stack.split(";"))] += int(count)
    return phases


W = 19  # a column of workload A's table
IDLE_SECONDS = 5.0  # how long each router's idle CPU is read for


# --------------------------------------------------------------------------- the run


@dataclass
class Config:
    requests: int
    concurrency: int
    tokens: int
    rounds: int
    time_cap: float
    warmup: int
    ttft_requests: int
    ttft_tokens: int
    ttft_warmup: int
    decode_slots: int
    engine_slots: int
    profile: bool
    profile_seconds: int
    profile_native: bool
    streams: int
    stream_tokens: int
    stream_itl: float
    stream_hold_itl: float
    stream_batch: int
    stream_warmup: int
    phase_cap: float
    vllm_router: str
    vllm_router_version: str
    state: bool


# Workload A/B mode -> column label; CPU process name -> row label.
MODE_LABELS = {
    "direct": "direct",
    "routed": "pd-router",
    "routed_state": "pd-router --state",
    "vllm_router": "vllm-router",
}
PROCESS_LABELS = {
    "router": "pd-router",
    "router-state": "pd-router --state",
    "redis": "redis-server",
}
SERVER_PROCESSES = (
    "router",
    "router-state",
    "redis",
    "vllm-router",
    "prefill",
    "decode0",
    "decode1",
)
# Each routed mode's router process.
ROUTER_PROCESS = {"routed": "router", "routed_state": "router-state", "vllm_router": "vllm-router"}
ENGINES = ("prefill", "decode0", "decode1")


def _serving(mode: str) -> tuple[str, ...]:
    """The processes that serve ``mode``'s requests (the other routers idle meanwhile)."""
    router = ROUTER_PROCESS.get(mode)
    if router is None:
        return ENGINES
    return (router, *(("redis",) if mode == "routed_state" else ()), *ENGINES)


# Issue 22's targets (see ``Bench.targets``).
CPU_RATIO_TARGET = 0.8
P99_OVER_BASELINE_MS = 1.0
STATE_CPU_MS = 0.08
STATE_TTFT_P50_MS = 0.3


@dataclass
class Target:
    """One of issue 22's targets, from this run's numbers."""

    target: str
    measured: str
    met: bool


class Bench:
    def __init__(
        self,
        config: Config,
        fleet: SimFleet,
        router: RouterProcess,
        vllm: VllmRouterProcess | None = None,
        state: tuple[RouterProcess, RedisServer] | None = None,
    ) -> None:
        self.config = config
        self.fleet = fleet
        self.router = router
        self.vllm = vllm
        self.state = state
        self.decode_urls = [engine.url for engine in fleet.decode]
        self.prefill_url = fleet.prefill[0].url
        self.modes = ["direct", "routed"]
        self.mode_urls = {"direct": self.decode_urls, "routed": [router.url]}
        if state is not None:
            self.modes.append("routed_state")
            self.mode_urls["routed_state"] = [state[0].url]
        if vllm is not None:
            self.modes.append("vllm_router")
            self.mode_urls["vllm_router"] = [vllm.url]
        self.pids: dict[str, int] = {}
        for name, process in self._named_processes():
            if process.pid is None:
                raise RuntimeError(f"{name} is not running")
            self.pids[name] = process.pid
        if state is not None:
            self.pids["redis"] = state[1].pid
        # Workload A's times to first text event, per mode, over its measured passes.
        self.a_ttfts: dict[str, list[float]] = {mode: [] for mode in self.modes}
        # Workload B: CPU ms of each process over the whole phase, and requests per mode.
        self.b_cpu_ms: dict[str, float] = {}
        self.b_requests = 0
        self.b_seconds = 0.0
        # CPU ms per second of each process with no load, read before workload B.
        self.idle_cpu_ms_per_s: dict[str, float] = {}
        self.runs: list[ThroughputRun] = []
        self.profile_run: ThroughputRun | None = None
        self.profile: Profile | None = None
        self.phases: Counter[str] = Counter()
        self.latency: dict[str, LatencySummary] = {}
        self._tags = itertools.count()
        self.loadavg: dict[str, tuple[float, float, float]] = {}
        self.ttft_other_busy_pct = 0.0
        self.vllm_threads_max = vllm.threads_at_start if vllm is not None else 0
        self.streams: list[StreamsRun] = []
        self.notes: list[str] = []  # skipped parts, how vllm-router stopped, ...

    def _named_processes(self) -> Iterator[tuple[str, ServerProcess]]:
        yield "router", self.router
        if self.state is not None:
            yield "router-state", self.state[0]
        if self.vllm is not None:
            yield "vllm-router", self.vllm
        yield "prefill", self.fleet.prefill[0]
        for index, engine in enumerate(self.fleet.decode):
            yield f"decode{index}", engine

    async def _throughput(
        self,
        mode: str,
        round_: int,
        requests: int,
        time_cap: float | None = None,
        ttfts: list[float] | None = None,
    ) -> ThroughputRun:
        config = self.config
        urls = self.mode_urls.get(mode, [self.router.url])
        meter = CpuMeter(self.pids)
        meter.start()
        sent, chunks, outcomes, seconds, capped = await throughput(
            urls,
            requests=requests,
            concurrency=config.concurrency,
            tokens=config.tokens,
            time_cap=config.time_cap if time_cap is None else time_cap,
            tag=f"{mode}{next(self._tags)}",
            ttfts=ttfts,
        )
        used = meter.stop()
        if "vllm-router" in self.pids:
            threads = proc_status(self.pids["vllm-router"], "Threads")
            self.vllm_threads_max = max(self.vllm_threads_max, threads)
        ok = outcomes.pop("ok", 0)
        capacity = seconds * 1000.0 * (os.cpu_count() or 1) / 100.0
        return ThroughputRun(
            mode=mode,
            round=round_,
            requests=sent,
            ok=ok,
            errors=dict(outcomes),
            chunks=chunks,
            seconds=seconds,
            requests_per_s=ok / seconds,
            chunks_per_s=chunks / seconds,
            capped=capped,
            cpu_ms=used,
            cpu_ms_per_request={name: ms / max(sent, 1) for name, ms in used.items()},
            machine_busy_pct=sum(used.values()) / capacity,
            other_busy_pct=used["other"] / capacity,
        )

    async def run(self) -> None:
        self.loadavg["start"] = os.getloadavg()
        try:
            await self._run()
        finally:
            self.loadavg["end"] = os.getloadavg()

    async def _run(self) -> None:
        config = self.config
        labels = ", ".join(MODE_LABELS[mode] for mode in self.modes)
        if config.warmup:
            log(f"warm-up: {config.warmup} requests per mode ({labels})")
            for mode in self.modes:
                run = await self._throughput(mode, 0, config.warmup)
                if run.errors:
                    raise RuntimeError(f"warm-up {mode} failed: {run.errors}")
        for round_ in range(1, config.rounds + 1):
            # Odd rounds in one order, even rounds in the reverse one.
            order = self.modes if round_ % 2 else self.modes[::-1]
            for mode in order:
                ttfts = self.a_ttfts[mode]
                before = len(ttfts)
                run = await self._throughput(mode, round_, config.requests, ttfts=ttfts)
                self.runs.append(run)
                # The pass's own TTFT and the machine's other load during it: the p99 the
                # targets compare pools every round, and a pass that shared the machine
                # with other work weighs in it as much as a quiet one.
                ms = [seconds * 1000.0 for seconds in ttfts[before:]] or [float("nan")]
                log(
                    f"  A round {round_} {MODE_LABELS[mode]:<17} {run.ok:>6} ok"
                    f"  {run.requests_per_s:8.1f} req/s  {run.chunks_per_s:10.0f} chunks/s"
                    f"  {run.seconds:6.2f} s  TTFT p50/p99 {percentile(ms, 50):.0f}"
                    f"/{percentile(ms, 99):.0f} ms  other {run.other_busy_pct:.0f}%"
                    f"  errors={run.errors or 0}"
                    f"{'  (time cap hit)' if run.capped else ''}"
                )
        if config.profile:
            await self._profiled_run()
        log(
            f"B: {config.ttft_requests} sequential requests per mode ({labels}, manual P/D), "
            f"max_tokens={config.ttft_tokens}"
        )
        # Each router's own background work (probes, watches) with no request: part of its
        # CPU per request at one client, where it runs while the other modes' requests do.
        meter = CpuMeter(self.pids)
        meter.start()
        await asyncio.sleep(IDLE_SECONDS)
        self.idle_cpu_ms_per_s = {
            name: ms / IDLE_SECONDS for name, ms in meter.stop().items() if name in self.pids
        }
        meter = CpuMeter(self.pids)
        meter.start()
        start = time.perf_counter()
        routers = {mode: urls[0] for mode, urls in self.mode_urls.items() if mode != "direct"}
        self.latency = await added_ttft(
            routers,
            self.prefill_url,
            self.decode_urls,
            requests=config.ttft_requests,
            tokens=config.ttft_tokens,
            warmup=config.ttft_warmup,
        )
        self.b_seconds = time.perf_counter() - start
        capacity = self.b_seconds * 1000.0 * (os.cpu_count() or 1) / 100.0
        self.b_cpu_ms = meter.stop()
        self.b_requests = config.ttft_requests + config.ttft_warmup
        self.ttft_other_busy_pct = self.b_cpu_ms["other"] / capacity

    def run_streams(self, runner: asyncio.Runner) -> None:
        """Workload D: its own slow decode engines and routers, started and stopped here."""
        config = self.config
        n = config.streams
        slow_args = [
            "--slots",
            str(n),
            "--ttft",
            "0",
            "--itl",
            str(config.stream_itl),
            "--default-max-tokens",
            str(config.stream_tokens),
        ]
        log(
            f"D: {n} open streams; starting 2 slow decode sim engines "
            f"(--itl {config.stream_itl} --slots {n})"
        )
        with SimFleet(prefill=0, decode=2, decode_args=slow_args) as slow:
            decode = [engine.url for engine in slow.decode]

            def set_itl(seconds: float) -> None:
                for engine in slow.decode:
                    engine.configure(itl=seconds)

            routers: list[tuple[str, ServerProcess]] = [
                ("pd-router", RouterProcess([self.prefill_url], decode, "--decode-slots", str(n)))
            ]
            if self.vllm is not None:
                vllm = VllmRouterProcess(self.vllm.executable, [self.prefill_url], decode)
                routers.append(("vllm-router", vllm))
            for name, process in routers:
                try:
                    process.__enter__()
                except RuntimeError as exc:
                    self.notes.append(f"D: {name} did not start: {exc}")
                    log(self.notes[-1])
                    continue
                try:
                    assert process.pid is not None  # nosec B101
                    run = run_coroutine(
                        runner,
                        hold_streams(
                            name,
                            process.url,
                            process.pid,
                            set_itl,
                            streams=n,
                            tokens=config.stream_tokens,
                            itl=config.stream_itl,
                            hold_itl=config.stream_hold_itl,
                            batch=config.stream_batch,
                            cap=config.phase_cap,
                            warmup=config.stream_warmup,
                        ),
                    )
                finally:
                    process.stop()
                if isinstance(process, VllmRouterProcess):
                    self.notes.append(f"D vllm-router stopped: {process.stop_note}")
                self.streams.append(run)
                log(
                    f"  D {name:<11} {run.ok:>5} ok  errors={run.errors or 0}  held at once "
                    f"{run.held_at_peak}  all open after {run.ramp_seconds:.1f} s, all done "
                    f"{run.release_seconds:.1f} s after release  RSS "
                    f"{run.rss_before_kib / 1024:.1f} -> {run.rss_open_kib / 1024:.1f} MiB "
                    f"({run.kib_per_stream:.1f} KiB/stream)"
                )

    async def _profiled_run(self) -> None:
        """An extra routed pass with py-spy attached; not used for the ratios."""
        config = self.config
        out = Path(tempfile.gettempdir()) / "router-profile.txt"
        command = py_spy_command(
            self.pids["router"], config.profile_seconds, str(out), config.profile_native
        )
        if command is None:
            self.profile = Profile(0, error="py-spy not found (pip install py-spy)")
            log("profile: py-spy not found, skipped")
            return
        log(f"profile: py-spy on the router for {config.profile_seconds} s during workload A")
        out.unlink(missing_ok=True)
        spy = subprocess.Popen(  # nosec B603
            command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL
        )
        try:
            await asyncio.sleep(0.5)  # let py-spy attach before the load starts
            # As many requests as fit in py-spy's window.
            self.profile_run = await self._throughput(
                "routed+py-spy", 0, 10**9, time_cap=config.profile_seconds
            )
            _, stderr = await asyncio.to_thread(spy.communicate, None, 60)
        finally:
            if spy.poll() is None:
                spy.kill()
                spy.wait()
        if spy.returncode != 0 or not out.exists():
            message = stderr.decode(errors="replace").strip()[-500:]
            self.profile = Profile(0, error=f"py-spy exited {spy.returncode}: {message}")
            return
        self.profile = read_profile(out)
        self.profile.expected = PY_SPY_RATE * config.profile_seconds
        self.phases = phase_samples(out)

    # ----------------------------------------------------------------------- report

    def results(self) -> dict[str, Any]:
        vllm = None
        if self.vllm is not None:
            vllm = {
                "executable": self.vllm.executable,
                "version": self.config.vllm_router_version,
                "command": self.vllm.command(),
                "threads_at_start": self.vllm.threads_at_start,
                "threads_max": self.vllm_threads_max,
            }
        return {
            "config": asdict(self.config),
            "machine": machine_info(),
            "vllm_router": vllm,
            "throughput": {
                "runs": [asdict(run) for run in self.runs],
                "summary": self.throughput_summary(),
                "profiled_run": asdict(self.profile_run) if self.profile_run else None,
            },
            "ttft": {mode: asdict(summary) for mode, summary in self.latency.items()},
            "ttft_other_busy_pct": self.ttft_other_busy_pct,
            "one_client_cpu_ms_per_request": self.one_client_cpu(),
            "idle_cpu_ms_per_s": self.idle_cpu_ms_per_s,
            "one_client_seconds": self.b_seconds,
            "targets": [asdict(target) for target in self.targets()],
            "streams": [asdict(run) for run in self.streams],
            "comparison": self.comparison(),
            "profile": asdict(self.profile) if self.profile else None,
            "phases": dict(self.phases),
            "loadavg": self.loadavg,
            "notes": self.notes,
        }

    def throughput_summary(self) -> dict[str, Any]:
        summary: dict[str, Any] = {}
        for mode in self.modes:
            runs = [run for run in self.runs if run.mode == mode]
            seconds = sum(run.seconds for run in runs)
            ok = sum(run.ok for run in runs)
            sent = sum(run.requests for run in runs)
            cpu: Counter[str] = Counter()
            for run in runs:
                cpu.update(run.cpu_ms)
            errors: Counter[str] = Counter()
            for run in runs:
                errors.update(run.errors)
            ttfts = [seconds * 1000.0 for seconds in self.a_ttfts.get(mode, [])]
            summary[mode] = {
                "ttft_p50_ms": percentile(ttfts, 50) if ttfts else float("nan"),
                "ttft_p99_ms": percentile(ttfts, 99) if ttfts else float("nan"),
                "requests": sent,
                "ok": ok,
                "errors": sum(errors.values()),
                "error_kinds": dict(errors),
                "requests_per_s": ok / seconds if seconds else 0.0,
                "chunks_per_s": sum(run.chunks for run in runs) / seconds if seconds else 0.0,
                "cpu_ms_per_request": {k: v / max(sent, 1) for k, v in sorted(cpu.items())},
            }
        direct = summary["direct"]
        by_round: dict[int, dict[str, float]] = {}
        for run in self.runs:
            by_round.setdefault(run.round, {})[run.mode] = run.requests_per_s
        for mode in self.modes[1:]:
            # "routed" keeps the key names it had before vllm-router joined.
            suffix = "" if mode == "routed" else f"_{mode}"
            summary[f"ratio_{mode}_over_direct"] = {
                key: (summary[mode][key] / direct[key] if direct[key] else float("nan"))
                for key in ("requests_per_s", "chunks_per_s")
            }
            summary[f"ratio_per_round{suffix}"] = [
                rates[mode] / rates["direct"]
                for _, rates in sorted(by_round.items())
                if rates.get("direct") and mode in rates
            ]
        return summary

    def one_client_cpu(self) -> dict[str, float]:
        """Workload B: each router's CPU ms per request it served at one client (its idle
        work while the other modes ran included: pd-router's health probes, say)."""
        if not self.b_requests:
            return {}
        return {
            mode: self.b_cpu_ms.get(ROUTER_PROCESS[mode], float("nan")) / self.b_requests
            for mode in self.modes
            if mode in ROUTER_PROCESS
        }

    def a_cpu(self, mode: str) -> float:
        """Workload A: the router's CPU ms per request of its own passes."""
        t = self.throughput_summary()
        return float(t[mode]["cpu_ms_per_request"].get(ROUTER_PROCESS[mode], float("nan")))

    def comparison(self) -> dict[str, Any] | None:
        """pd-router next to vllm-router, each against its in-run baseline."""
        if self.vllm is None or not self.runs:
            return None
        t = self.throughput_summary()
        pd_cpu = self.a_cpu("routed")
        vllm_cpu = self.a_cpu("vllm_router")
        result: dict[str, Any] = {
            "cpu_ms_per_request": {"pd_router": pd_cpu, "vllm_router": vllm_cpu},
            "cpu_ratio_pd_over_vllm": pd_cpu / vllm_cpu if vllm_cpu else float("nan"),
            "requests_per_s_ratio_vs_direct": {
                "pd_router": t["ratio_routed_over_direct"]["requests_per_s"],
                "vllm_router": t["ratio_vllm_router_over_direct"]["requests_per_s"],
            },
            "ttft_64_clients_ms": {
                name: {q: t[mode][f"ttft_{q}_ms"] for q in ("p50", "p99")}
                for name, mode in (("pd_router", "routed"), ("vllm_router", "vllm_router"))
            },
        }
        one = self.one_client_cpu()
        if one:
            result["one_client_cpu_ms_per_request"] = {
                "pd_router": one["routed"],
                "vllm_router": one["vllm_router"],
            }
            result["one_client_cpu_ratio_pd_over_vllm"] = (
                one["routed"] / one["vllm_router"] if one["vllm_router"] else float("nan")
            )
        if self.latency:
            manual = self.latency["manual_pd"]
            result["added_ttft_over_manual_pd_ms"] = {
                name: {
                    q: getattr(self.latency[mode], f"{q}_ms") - getattr(manual, f"{q}_ms")
                    for q in ("p50", "p90", "p99")
                }
                for name, mode in (("pd_router", "routed"), ("vllm_router", "vllm_router"))
            }
        streams = {run.router: run for run in self.streams}
        if "pd-router" in streams and "vllm-router" in streams:
            result["open_streams_kib_per_stream"] = {
                "pd_router": streams["pd-router"].kib_per_stream,
                "vllm_router": streams["vllm-router"].kib_per_stream,
            }
        return result

    def targets(self) -> list[Target]:
        """Issue 22's targets that this run measured, each met or not. At one client the
        TTFT baseline is manual P/D: for a disaggregated request, "sending straight to the
        engine" is the client doing P/D itself (a prefill and a KV pull included)."""
        if not self.runs or not self.latency:
            return []
        t = self.throughput_summary()
        lat = self.latency
        manual = lat["manual_pd"]
        one = self.one_client_cpu()
        targets: list[Target] = []

        def add(target: str, measured: str, met: bool) -> None:
            targets.append(Target(target, measured, met))

        if "vllm_router" in self.modes:
            vllm = lat["vllm_router"]
            for where, pd, rust in (
                ("64 clients (A)", self.a_cpu("routed"), self.a_cpu("vllm_router")),
                ("1 client (B)", one["routed"], one["vllm_router"]),
            ):
                ratio = pd / rust if rust else float("nan")
                add(
                    f"router CPU/request at {where} <= {CPU_RATIO_TARGET}x vllm-router's",
                    f"{pd:.3f} vs {rust:.3f} ms ({ratio:.2f}x)",
                    ratio <= CPU_RATIO_TARGET,
                )
            pd_p50 = lat["routed"].p50_ms - manual.p50_ms
            rust_p50 = vllm.p50_ms - manual.p50_ms
            add(
                "TTFT p50 added at 1 client (over manual P/D) <= vllm-router's",
                f"{pd_p50:+.2f} vs {rust_p50:+.2f} ms",
                pd_p50 <= rust_p50,
            )
            pd_p99, rust_p99 = t["routed"]["ttft_p99_ms"], t["vllm_router"]["ttft_p99_ms"]
            add(
                "TTFT p99 at 64 clients <= vllm-router's",
                f"{pd_p99:.2f} vs {rust_p99:.2f} ms",
                pd_p99 <= rust_p99,
            )
        p99 = lat["routed"].p99_ms - manual.p99_ms
        add(
            f"TTFT p99 at 1 client within {P99_OVER_BASELINE_MS:g} ms of manual P/D's",
            f"{lat['routed'].p99_ms:.2f} vs {manual.p99_ms:.2f} ms ({p99:+.2f})",
            p99 <= P99_OVER_BASELINE_MS,
        )
        if "routed_state" in self.modes:
            for where, plain, shared in (
                ("64 clients (A)", self.a_cpu("routed"), self.a_cpu("routed_state")),
                ("1 client (B)", one["routed"], one["routed_state"]),
            ):
                add(
                    f"--state adds <= {STATE_CPU_MS} ms router CPU/request at {where}",
                    f"{shared:.3f} vs {plain:.3f} ms ({shared - plain:+.3f})",
                    shared - plain <= STATE_CPU_MS,
                )
            added = lat["routed_state"].p50_ms - lat["routed"].p50_ms
            add(
                f"--state adds <= {STATE_TTFT_P50_MS} ms TTFT p50 at 1 client",
                f"{lat['routed_state'].p50_ms:.2f} vs {lat['routed'].p50_ms:.2f} ms "
                f"({added:+.2f})",
                added <= STATE_TTFT_P50_MS,
            )
        return targets

    def _print_targets(self, targets: list[Target]) -> None:
        log("issue 22 targets (this run):")
        for target in targets:
            log(f"   {'met    ' if target.met else 'NOT MET'}  {target.target}: {target.measured}")
        log(
            "   (client keys and tracing: benchmarks/keys_cost.py and tracing_cost.py; CPU is "
            "read in 10 ms\n    ticks, so B's CPU per request moves by about 10 ms / requests)"
        )

    def print_report(self) -> None:
        config = self.config
        info = machine_info()
        log("")
        log("=" * 88)
        log(
            f"machine: nproc={info['nproc']}  {info['cpu_model']}  python {info['python']}"
            f"  ({info['platform']})"
        )
        log(
            "load average (1/5/15 min) at start: "
            + " / ".join(f"{v:.2f}" for v in self.loadavg.get("start", ()))
            + "   at end: "
            + " / ".join(f"{v:.2f}" for v in self.loadavg.get("end", ()))
        )
        log("versions: " + "  ".join(f"{k} {v}" for k, v in info["versions"].items()))
        log(
            f"fleet: 1 prefill + 2 decode sim engines (--standalone --slots {config.engine_slots}"
            f" --ttft 0 --itl 0), pd-router --decode-slots {config.decode_slots}"
        )
        if self.vllm is not None:
            log(
                f"       vllm-router {config.vllm_router_version} next to it, same engines "
                f"({self.vllm.executable}):"
            )
            log(f"         --policy round_robin {' '.join(VLLM_ROUTER_FAIR_ARGS[:2])}")
            log(f"         {' '.join(VLLM_ROUTER_FAIR_ARGS[2:])}")
            log(
                f"         default tokio runtime: {self.vllm.threads_at_start} threads at "
                f"start, at most {self.vllm_threads_max} seen under load"
            )
        else:
            log("       vllm-router: not run (see above)")
        if self.runs:
            log("")
            self._print_throughput()
        if self.latency:
            log("")
            self._print_latency()
        if self.profile is not None:
            log("")
            self._print_profile()
        if self.streams:
            log("")
            self._print_streams()
        comparison = self.comparison()
        if comparison is not None:
            log("")
            self._print_comparison(comparison)
        targets = self.targets()
        if targets:
            log("")
            self._print_targets(targets)
        if self.notes:
            log("")
            for note in self.notes:
                log(f"note: {note}")
        log("=" * 88)

    def _print_throughput(self) -> None:
        config = self.config
        t = self.throughput_summary()
        modes = self.modes
        log(
            f"A. throughput: streaming {PATH}, max_tokens={config.tokens}, ignore_eos, "
            f"{config.concurrency} clients, {config.requests} requests x {config.rounds} "
            f"round(s) per mode"
        )
        log(f"   {'':<24}" + "".join(f"{MODE_LABELS[mode]:>{W}}" for mode in modes))
        for key, label, fmt in (
            ("requests_per_s", "requests/s", ".1f"),
            ("chunks_per_s", "chunks/s", ".0f"),
            ("ttft_p50_ms", "TTFT p50 ms", ".2f"),
            ("ttft_p99_ms", "TTFT p99 ms", ".2f"),
        ):
            log(f"   {label:<24}" + "".join(f"{t[mode][key]:>{W}{fmt}}" for mode in modes))
        log(
            f"   {'requests/s vs direct':<24}{1.0:>{W}.3f}"
            + "".join(f"{t[f'ratio_{m}_over_direct']['requests_per_s']:>{W}.3f}" for m in modes[1:])
        )
        log(f"   {'errors':<24}" + "".join(f"{t[mode]['errors']:>{W}}" for mode in modes))
        for mode in modes[1:]:
            per_round = t["ratio_per_round" + ("" if mode == "routed" else f"_{mode}")]
            if len(per_round) > 1:
                log(
                    f"   {MODE_LABELS[mode]} / direct requests/s per round: "
                    + "  ".join(f"{r:.3f}" for r in per_round)
                )
        kinds = {MODE_LABELS[m]: t[m]["error_kinds"] for m in modes if t[m]["errors"]}
        if kinds:
            log(f"   error kinds: {kinds}")
        log("   CPU ms per request (utime+stime of each process, from /proc/<pid>/stat):")
        names: set[str] = set()
        for mode in modes:
            names.update(t[mode]["cpu_ms_per_request"])
        names.discard("other")
        order = [*SERVER_PROCESSES, "loadgen"]
        for name in sorted(names, key=lambda n: order.index(n) if n in order else len(order)):
            label = PROCESS_LABELS.get(name, name)
            log(
                f"     {label:<22}"
                + "".join(
                    f"{t[mode]['cpu_ms_per_request'].get(name, 0.0):>{W}.3f}" for mode in modes
                )
            )
        log(
            f"     {'all servers':<22}"
            + "".join(
                f"{sum(t[mode]['cpu_ms_per_request'].get(k, 0.0) for k in _serving(mode)):>{W}.3f}"
                for mode in modes
            )
        )
        for mode in modes:
            runs = [run for run in self.runs if run.mode == mode]
            log(
                f"   machine CPU busy during {MODE_LABELS[mode]} passes: "
                + ", ".join(
                    f"{run.machine_busy_pct:.0f}% (other processes {run.other_busy_pct:.0f}%)"
                    for run in runs
                )
            )
        noisy = [run for run in self.runs if run.other_busy_pct > OTHER_LOAD_WARNING_PCT]
        if noisy:
            log(
                f"   WARNING: processes this benchmark did not start used more than "
                f"{OTHER_LOAD_WARNING_PCT:.0f}% of the machine in {len(noisy)} pass(es): "
                "requests/s are unreliable, CPU ms per request less so"
            )

    def _print_latency(self) -> None:
        config = self.config
        log(
            f"B. TTFT: 1 client, keep-alive, max_tokens={config.ttft_tokens}, "
            f"{config.ttft_requests} sequential requests per mode, modes interleaved"
        )
        warn = self.ttft_other_busy_pct > OTHER_LOAD_WARNING_PCT
        log(
            f"   other processes used {self.ttft_other_busy_pct:.0f}% of the machine meanwhile"
            + ("  WARNING: latencies are unreliable" if warn else "")
        )
        log(f"   {'':<28}{'p50 ms':>10}{'p90 ms':>10}{'p99 ms':>10}{'mean ms':>10}{'errors':>8}")
        labels = {
            "direct": "direct (decode engine)",
            "manual_pd": "manual P/D (no router)",
            "routed": "routed (pd-router)",
            "routed_state": "routed (pd-router --state)",
            "vllm_router": "routed (vllm-router)",
            "prefill_hop": "  prefill hop alone",
        }
        for mode, label in labels.items():
            if mode not in self.latency:
                continue
            s = self.latency[mode]
            log(
                f"   {label:<28}{s.p50_ms:>10.2f}{s.p90_ms:>10.2f}{s.p99_ms:>10.2f}"
                f"{s.mean_ms:>10.2f}{sum(s.errors.values()):>8}"
            )
        d, m = self.latency["direct"], self.latency["manual_pd"]
        rows = [("added TTFT, pd-router - direct:", self.latency["routed"], d)]
        rows.append(("pd-router's own, - manual P/D:", self.latency["routed"], m))
        if "routed_state" in self.latency:
            rows.append(("pd-router --state, - manual P/D:", self.latency["routed_state"], m))
        if "vllm_router" in self.latency:
            rows.append(("added TTFT, vllm-router - direct:", self.latency["vllm_router"], d))
            rows.append(("vllm-router's own, - manual P/D:", self.latency["vllm_router"], m))
        for label, r, base in rows:
            log(
                f"   {label:<36}p50 {r.p50_ms - base.p50_ms:+6.2f} ms   p90 "
                f"{r.p90_ms - base.p90_ms:+6.2f} ms   p99 {r.p99_ms - base.p99_ms:+6.2f} ms"
            )
        one = self.one_client_cpu()
        log(
            f"   router CPU ms per request at 1 client ({self.b_requests} requests each, warm-up "
            f"included; {self.b_seconds:.1f} s):"
        )
        for mode, ms in one.items():
            idle = self.idle_cpu_ms_per_s.get(ROUTER_PROCESS[mode], 0.0)
            share = idle * self.b_seconds / self.b_requests
            log(
                f"     {MODE_LABELS[mode]:<20}{ms:7.3f}   of which idle work {share:.3f} "
                f"({idle:.1f} ms/s with no request: probes, watches, timers)"
            )
        log(
            "   (routed and manual P/D include a real prefill request and a KV pull from the "
            "prefill engine;\n    direct has neither, so routed - direct is not all router "
            "overhead)"
        )

    def _print_streams(self) -> None:
        config = self.config
        runs = self.streams
        log(
            f"D. open streams: {config.streams} concurrent streaming {PATH}, "
            f"max_tokens={config.stream_tokens}, ignore_eos, through a"
        )
        log(
            f"   second pd-router (--decode-slots {config.streams}) in front of the same prefill "
            f"engine and 2 extra decode"
        )
        log(
            f"   sim engines (--itl {config.stream_itl} --slots {config.streams})"
            + ("; then through vllm-router alone, same engines." if len(runs) > 1 else ".")
        )
        log(
            f"   Opened {config.stream_batch} at a time with the engines at --itl "
            f"{config.stream_hold_itl} (so the first streams are"
        )
        log(
            f"   still open when the last start); RSS read; then back to --itl "
            f"{config.stream_itl} (the release)."
        )
        log(f"   {'':<34}" + "".join(f"{run.router:>14}" for run in runs))

        def row(label: str, values: Iterator[str]) -> None:
            log(f"   {label:<34}" + "".join(f"{value:>14}" for value in values))

        row("streams ok", (f"{run.ok}/{run.streams}" for run in runs))
        row("errors", (str(sum(run.errors.values())) for run in runs))
        row("held open at once", (str(run.held_at_peak) for run in runs))
        row("seconds until all open", (f"{run.ramp_seconds:.1f}" for run in runs))
        row("seconds release -> all done", (f"{run.release_seconds:.1f}" for run in runs))
        row("tokens/s received after release", (f"{r.release_tokens_per_s:.0f}" for r in runs))
        row("  asked for (streams / itl)", (f"{run.asked_tokens_per_s:.0f}" for run in runs))
        row("router RSS before, MiB", (f"{run.rss_before_kib / 1024:.1f}" for run in runs))
        row("router RSS all open, MiB", (f"{run.rss_open_kib / 1024:.1f}" for run in runs))
        row("router RSS max seen, MiB", (f"{run.rss_max_kib / 1024:.1f}" for run in runs))
        row("router RSS after, MiB", (f"{run.rss_after_kib / 1024:.1f}" for run in runs))
        row("KiB per open stream (<= 32)", (f"{run.kib_per_stream:.1f}" for run in runs))
        row("router CPU ms per stream", (f"{run.router_cpu_ms_per_stream:.2f}" for run in runs))
        row("router threads before / open", (f"{r.threads_before}/{r.threads_open}" for r in runs))
        for run in runs:
            if run.errors:
                log(f"   {run.router} errors: {run.errors}")
            if run.warmup_errors:
                log(f"   {run.router} warm-up errors: {run.warmup_errors}")
            if not run.all_open or run.held_at_peak < run.streams:
                log(
                    f"   WARNING {run.router}: only {run.held_at_peak} of {run.streams} streams "
                    "were open at once when RSS was read"
                    + (f" (phase cap {config.phase_cap:.0f} s hit)" if run.capped else "")
                )
        log(
            "   (KiB per open stream = (RSS all open - RSS before) / streams held; tokens/s "
            "below the asked\n    rate means the sim engines, router and load generator ran "
            "out of CPU: streams got slower)"
        )

    def _print_comparison(self, c: dict[str, Any]) -> None:
        cpu = c["cpu_ms_per_request"]
        ratio = c["requests_per_s_ratio_vs_direct"]
        log("pd-router vs vllm-router (same engines, same run):")
        log(
            f"   A. CPU ms/request {cpu['pd_router']:.3f} vs {cpu['vllm_router']:.3f} "
            f"({c['cpu_ratio_pd_over_vllm']:.2f}x);  requests/s vs direct "
            f"{ratio['pd_router']:.3f} vs {ratio['vllm_router']:.3f}"
        )
        a_ttft = c["ttft_64_clients_ms"]
        log(
            "   A. TTFT at 64 clients: "
            + ";  ".join(
                f"{q} {a_ttft['pd_router'][q]:.2f} vs {a_ttft['vllm_router'][q]:.2f} ms"
                for q in ("p50", "p99")
            )
        )
        one = c.get("one_client_cpu_ms_per_request")
        if one:
            log(
                f"   B. CPU ms/request at 1 client {one['pd_router']:.3f} vs "
                f"{one['vllm_router']:.3f} ({c['one_client_cpu_ratio_pd_over_vllm']:.2f}x)"
            )
        ttft = c.get("added_ttft_over_manual_pd_ms")
        if ttft:
            log(
                "   B. added TTFT over manual P/D: "
                + ";  ".join(
                    f"{q} {ttft['pd_router'][q]:+.2f} vs {ttft['vllm_router'][q]:+.2f} ms"
                    for q in ("p50", "p90", "p99")
                )
            )
        kib = c.get("open_streams_kib_per_stream")
        if kib:
            log(
                f"   D. router KiB per open stream {kib['pd_router']:.1f} vs "
                f"{kib['vllm_router']:.1f}"
            )

    def _print_profile(self) -> None:
        profile = self.profile
        assert profile is not None  # nosec B101
        if profile.error:
            log(f"C. profile: {profile.error}")
            return
        run = self.profile_run
        if run is not None:
            log(
                f"C. py-spy on the router ({self.config.profile_seconds} s, extra routed pass: "
                f"{run.requests_per_s:.1f} req/s with py-spy attached, errors={run.errors or 0})"
            )
        busy = profile.samples / profile.expected * 100 if profile.expected else float("nan")
        log(
            f"   {profile.samples} non-idle samples of {profile.expected} at {PY_SPY_RATE} Hz: "
            f"the router's main thread was busy {busy:.0f}% of the time"
        )
        log(f"   top {len(profile.top_own)} functions by own time (% of non-idle samples):")
        for frame, count in profile.top_own:
            share = count / profile.samples * 100 if profile.samples else 0.0
            log(f"   {share:6.1f}%  {count:>6}  {frame}")
        if not self.config.profile_native:
            log("   (time in uvloop's C code, e.g. socket I/O, shows up as its Python caller,")
            log("    such as Runner.run: --profile-native shows C frames too)")
        log("   pd_router functions by inclusive time (a lower bound: py-spy loses the callers")
        log("   of some coroutines that uvloop resumes from C):")
        for frame, count in profile.top_router_inclusive:
            share = count / profile.samples * 100 if profile.samples else 0.0
            log(f"   {share:6.1f}%  {count:>6}  {frame}")
        log(f"   collapsed stacks: {profile.raw_path}")
        total = sum(self.phases.values())
        if run is None or not total:
            return
        cpu = run.cpu_ms_per_request.get("router", 0.0) * 1000.0
        log(
            f"   where a request's router CPU goes ({cpu:.0f} us per request in this pass, "
            "shared out by samples):"
        )
        order = [phase for phase, _ in PHASES] + ["other (background work, GC, ...)"]
        for phase in order:
            share = self.phases.get(phase, 0) / total
            log(f"   {cpu * share:8.1f} us  {share * 100:5.1f}%  {phase}")


# --------------------------------------------------------------------------- main


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="pd-router streaming benchmark against simulated engines (prints numbers)."
    )
    parser.add_argument("--requests", type=int, help="workload A requests per pass")
    parser.add_argument("--concurrency", type=int, default=64, help="workload A clients")
    parser.add_argument("--tokens", type=int, default=64, help="workload A max_tokens")
    parser.add_argument(
        "--rounds", type=int, help="workload A passes per mode, alternating (default 2)"
    )
    parser.add_argument("--time-cap", type=float, default=120.0, help="seconds per pass")
    parser.add_argument("--ttft-requests", type=int, help="workload B requests per mode")
    parser.add_argument("--ttft-tokens", type=int, default=16, help="workload B max_tokens")
    parser.add_argument("--decode-slots", type=int, default=64, help="router --decode-slots")
    parser.add_argument("--engine-slots", type=int, default=256, help="sim decode --slots")
    parser.add_argument(
        "--streams",
        type=int,
        help="workload D streams held open at once (default 4096, --quick 512; 0 skips D)",
    )
    parser.add_argument("--stream-tokens", type=int, default=40, help="workload D max_tokens")
    parser.add_argument(
        "--stream-itl", type=float, default=0.05, help="workload D decode engines' --itl"
    )
    parser.add_argument(
        "--stream-hold-itl",
        type=float,
        default=2.0,
        help="workload D --itl while the streams open (so the first ones are still open when "
        "the last ones start)",
    )
    parser.add_argument(
        "--stream-batch", type=int, default=256, help="workload D streams opened at a time"
    )
    parser.add_argument(
        "--phase-cap", type=float, default=180.0, help="seconds per router in workload D"
    )
    parser.add_argument("--quick", action="store_true", help="fewer requests, one round")
    parser.add_argument("--profile", action="store_true", help="py-spy the router (extra pass)")
    parser.add_argument("--profile-seconds", type=int, default=10)
    parser.add_argument(
        "--profile-native", action="store_true", help="with --profile: C frames too (py-spy)"
    )
    vllm = parser.add_mutually_exclusive_group()
    vllm.add_argument(
        "--vllm-router",
        metavar="PATH",
        help="vllm-router executable to compare with (default: vllm-router on PATH, else "
        f"{VLLM_ROUTER_VENV}/bin/vllm-router)",
    )
    vllm.add_argument("--no-vllm-router", action="store_true", help="leave vllm-router out")
    parser.add_argument(
        "--install-vllm-router",
        action="store_true",
        help=f"if vllm-router is not found, pip-install vllm-router=={VLLM_ROUTER_VERSION} into "
        f"a venv at {VLLM_ROUTER_VENV} first",
    )
    parser.add_argument(
        "--install-timeout", type=float, default=300.0, help="seconds for that install"
    )
    parser.add_argument(
        "--no-state",
        action="store_true",
        help="leave out the pd-router --state redis://... column (and its redis-server)",
    )
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON here")
    return parser.parse_args(argv)


def resolve_vllm_router(args: argparse.Namespace) -> str | None:
    """The vllm-router executable to run, or None (after saying why) to leave it out."""
    if args.no_vllm_router:
        log("vllm-router: left out (--no-vllm-router)")
        return None
    if args.vllm_router:
        if not os.access(args.vllm_router, os.X_OK) or Path(args.vllm_router).is_dir():
            raise SystemExit(f"--vllm-router {args.vllm_router}: not an executable file")
        return str(args.vllm_router)
    found = find_vllm_router()
    if found is None and args.install_vllm_router:
        return install_vllm_router(args.install_timeout)  # it says why if it fails
    if found is None:
        log(VLLM_ROUTER_HINT.format(venv=VLLM_ROUTER_VENV, version=VLLM_ROUTER_VERSION))
    return found


def make_config(args: argparse.Namespace, vllm_router: str | None) -> Config:
    quick = args.quick
    requests = args.requests or (300 if quick else 2000)
    streams = args.streams if args.streams is not None else (512 if quick else 4096)
    return Config(
        requests=requests,
        concurrency=args.concurrency,
        tokens=args.tokens,
        rounds=args.rounds or (1 if quick else 2),
        time_cap=args.time_cap,
        warmup=min(requests, 2 * args.concurrency),
        ttft_requests=args.ttft_requests or (100 if quick else 300),
        ttft_tokens=args.ttft_tokens,
        ttft_warmup=10,
        decode_slots=args.decode_slots,
        engine_slots=args.engine_slots,
        profile=args.profile,
        profile_seconds=args.profile_seconds,
        profile_native=args.profile_native,
        streams=max(streams, 0),
        stream_tokens=args.stream_tokens,
        stream_itl=args.stream_itl,
        stream_hold_itl=args.stream_hold_itl,
        stream_batch=max(args.stream_batch, 1),
        stream_warmup=48,
        phase_cap=args.phase_cap,
        vllm_router=vllm_router or "",
        vllm_router_version=vllm_router_version(vllm_router) if vllm_router else "",
        state=not args.no_state,
    )


def check_file_limit(streams: int) -> str:
    """Raise RLIMIT_NOFILE as far as allowed; why workload D cannot run, or ""."""
    soft, hard = raise_nofile_limit()
    # The router holds a client and an engine connection per stream; the load generator one.
    needed = 2 * streams + 512
    if soft == resource.RLIM_INFINITY or soft >= needed:
        return ""
    return (
        f"workload D skipped: {streams} streams need about {needed} open files in the router "
        f"(2 per stream, plus some), but RLIMIT_NOFILE is {soft} (hard limit {hard}); "
        f"raise it (ulimit -n) or pass a smaller --streams"
    )


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    restore = raise_on_sigterm()
    wall = time.perf_counter()
    try:
        vllm_exe = resolve_vllm_router(args)
        config = make_config(args, vllm_exe)
        skipped_d = check_file_limit(config.streams) if config.streams else ""
        if skipped_d:
            log(skipped_d)
            config.streams = 0
        decode_args = [
            "--standalone",
            "--slots",
            str(config.engine_slots),
            "--ttft",
            "0",
            "--itl",
            "0",
            "--default-max-tokens",
            str(config.tokens),
        ]
        fleet = SimFleet(prefill=1, decode=2, decode_args=decode_args)
        vllm: VllmRouterProcess | None = None
        notes = [skipped_d] if skipped_d else []
        with contextlib.ExitStack() as stack:
            log("starting 1 prefill + 2 decode sim engines and pd-router on 127.0.0.1")
            stack.enter_context(fleet)
            router = RouterProcess(
                [fleet.prefill[0].url],
                [engine.url for engine in fleet.decode],
                "--decode-slots",
                str(config.decode_slots),
            )
            stack.enter_context(router)
            state = None
            if config.state:
                log("starting redis-server and pd-router --state on it")
                redis = stack.enter_context(RedisServer())
                shared = RouterProcess(
                    [fleet.prefill[0].url],
                    [engine.url for engine in fleet.decode],
                    "--decode-slots",
                    str(config.decode_slots),
                    "--state",
                    redis.url,
                )
                state = stack.enter_context(shared), redis
            if vllm_exe:
                log(f"starting vllm-router {config.vllm_router_version} ({vllm_exe})")
                candidate = VllmRouterProcess(
                    vllm_exe, [fleet.prefill[0].url], [engine.url for engine in fleet.decode]
                )
                try:
                    vllm = stack.enter_context(candidate)
                except RuntimeError as exc:
                    notes.append(f"vllm-router did not start, its columns are skipped: {exc}")
                    log(notes[-1])
            bench = Bench(config, fleet, router, vllm, state)
            bench.notes.extend(notes)
            log(
                "pids: "
                + "  ".join(f"{name}={pid}" for name, pid in bench.pids.items())
                + f"  loadgen={os.getpid()}"
            )
            with asyncio.Runner(loop_factory=event_loop_factory()) as runner:
                run_coroutine(runner, bench.run())
                if config.streams:
                    bench.run_streams(runner)
        # Engines and routers are stopped here, before the report.
        if vllm is not None:
            bench.notes.append(f"A/B vllm-router stopped: {vllm.stop_note}")
        results = bench.results()
        results["wall_seconds"] = time.perf_counter() - wall
        bench.print_report()
        log(f"total wall time: {results['wall_seconds']:.1f} s")
        if args.json:
            Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
            log(f"results written to {args.json}")
    finally:
        restore()
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Streaming benchmark: what pd-router costs next to talking to a decode engine directly.

Starts, on 127.0.0.1, one simulated prefill engine, two simulated decode engines (instant:
``--ttft 0 --itl 0``, ``--standalone`` so they also serve plain requests) and ``python -m
pd_router`` in front of them, then drives them from this process with asyncio + aiohttp:

* Workload A, throughput: streaming ``/v1/completions`` from many concurrent clients,
  DIRECT (round-robin over both decode engines) and ROUTED (through the router), in
  alternating rounds. Reports requests/s, chunks/s, the routed/direct ratio, errors, and
  CPU milliseconds per request of the router and of each engine (``/proc/<pid>/stat``).
* Workload B, added TTFT: one client, sequential requests, interleaving DIRECT, MANUAL P/D
  (this client calls the prefill engine, then the decode engine with the returned
  ``kv_transfer_params``: what the router does, minus the router) and ROUTED.

The routed path does more work than the direct one: a real prefill request and a KV pull
from the prefill engine. ROUTED - DIRECT is what a client sees; ROUTED - MANUAL P/D is
the router's own share of it.

Every process shares the machine's cores, so numbers are noisy: compare each number with
its in-run baseline, not with another run. It prints numbers; it asserts nothing.

    python benchmarks/stream_bench.py [--requests N] [--concurrency 64] [--tokens 64]
                                      [--quick] [--profile] [--json PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.metadata
import itertools
import json
import os
import platform
import re
import shutil
import signal
import statistics
import subprocess  # nosec B404
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

import aiohttp
import orjson

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from pd_router.handshake import PREFILL_KV_PARAMS  # noqa: E402
from pd_router.sim.fleet import RouterProcess, ServerProcess, SimFleet  # noqa: E402

CLK_TCK = os.sysconf("SC_CLK_TCK")
OTHER_LOAD_WARNING_PCT = 10.0
MODEL = "sim-model"
PATH = "/v1/completions"
DONE = b"data: [DONE]"
# Words after the unique first one, so every prompt is a few KV blocks long.
FILLER = " ".join(f"w{i}" for i in range(40))
REQUEST_TIMEOUT = aiohttp.ClientTimeout(total=60)


# --------------------------------------------------------------------------- processes


def cpu_ms(pid: int) -> float:
    """utime + stime of one process, in milliseconds."""
    raw = Path(f"/proc/{pid}/stat").read_text()
    # Fields after the command name, which is in parentheses and may contain spaces.
    fields = raw[raw.rindex(")") + 2 :].split()
    # utime and stime are fields 14 and 15 of stat(5); fields[0] here is field 3.
    return (int(fields[11]) + int(fields[12])) * 1000.0 / CLK_TCK


def machine_busy_ms() -> float:
    """CPU milliseconds the whole machine spent not idle since boot (/proc/stat), all cores."""
    fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    # user nice system idle iowait irq softirq steal [guest guest_nice, already in user/nice]
    busy = sum(fields[:8]) - fields[3] - fields[4]
    return busy * 1000.0 / CLK_TCK


class CpuMeter:
    """CPU milliseconds each named process (and this one) used between start() and stop().

    ``machine`` is what every process on the machine used, ``other`` what processes this
    benchmark did not start used: other load that makes a run noisier.
    """

    def __init__(self, pids: dict[str, int]) -> None:
        self.pids = pids
        self._before: dict[str, float] = {}
        self.used: dict[str, float] = {}

    def _sample(self) -> dict[str, float]:
        sample = {name: cpu_ms(pid) for name, pid in self.pids.items()}
        sample["loadgen"] = time.process_time() * 1000.0
        sample["machine"] = machine_busy_ms()
        return sample

    def start(self) -> None:
        self._before = self._sample()

    def stop(self) -> dict[str, float]:
        after = self._sample()
        self.used = {name: after[name] - self._before[name] for name in after}
        machine = self.used.pop("machine")
        self.used["other"] = max(0.0, machine - sum(self.used.values()))
        return self.used


# --------------------------------------------------------------------------- requests


@dataclass
class StreamResult:
    ok: bool
    chunks: int = 0
    error: str = ""
    ttft: float | None = None


def completion_body(prompt: str, max_tokens: int, stream: bool = True) -> dict[str, Any]:
    return {
        "model": MODEL,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": stream,
    }


def _has_text(line: bytes) -> bool:
    try:
        event = orjson.loads(line[6:])
    except orjson.JSONDecodeError:
        return False
    choices = event.get("choices") if isinstance(event, dict) else None
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        return False
    return bool(choices[0].get("text"))


async def stream_completion(
    session: aiohttp.ClientSession,
    url: str,
    body: dict[str, Any],
    *,
    want_ttft: bool = False,
    started: float | None = None,
) -> StreamResult:
    """POST a streaming request and read it to the end.

    ``chunks`` counts ``data:`` events before ``[DONE]``; the result is ok only for a 200
    whose stream ended with ``data: [DONE]`` and had ``max_tokens`` chunks. ``ttft`` (with
    ``want_ttft``) runs from ``started`` (default: now) to the first event with text.
    """
    start = time.perf_counter() if started is None else started
    expected = body["max_tokens"]
    ttft: float | None = None
    chunks = 0
    done = False
    try:
        async with session.post(url, json=body, timeout=REQUEST_TIMEOUT) as response:
            if response.status != 200:
                await response.read()
                return StreamResult(False, error=f"http_{response.status}")
            async for line in response.content:
                if not line.startswith(b"data: "):
                    continue
                if line.startswith(DONE):
                    done = True
                    continue
                chunks += 1
                if want_ttft and ttft is None and _has_text(line):
                    ttft = time.perf_counter() - start
    except (aiohttp.ClientError, TimeoutError) as exc:
        return StreamResult(False, chunks, error=type(exc).__name__)
    if not done:
        return StreamResult(False, chunks, error="no_done")
    if chunks != expected:
        return StreamResult(False, chunks, error="wrong_chunk_count")
    return StreamResult(True, chunks, ttft=ttft)


async def manual_pd(
    session: aiohttp.ClientSession, prefill_url: str, decode_url: str, body: dict[str, Any]
) -> tuple[StreamResult, float]:
    """Prefill, then decode with the prefill's kv_transfer_params: the router's job by hand.

    Returns the decode stream's result (TTFT measured from before the prefill request) and
    how long the prefill request took.
    """
    start = time.perf_counter()
    prefill = {**body, "max_tokens": 1, "stream": False, "kv_transfer_params": PREFILL_KV_PARAMS}
    try:
        async with session.post(
            prefill_url + PATH, json=prefill, timeout=REQUEST_TIMEOUT
        ) as response:
            raw = await response.read()
            status = response.status
    except (aiohttp.ClientError, TimeoutError) as exc:
        return StreamResult(False, error=f"prefill_{type(exc).__name__}"), 0.0
    prefill_time = time.perf_counter() - start
    if status != 200:
        return StreamResult(False, error=f"prefill_http_{status}"), prefill_time
    params = orjson.loads(raw).get("kv_transfer_params")
    decode = {**body, "kv_transfer_params": params}
    result = await stream_completion(
        session, decode_url + PATH, decode, want_ttft=True, started=start
    )
    return result, prefill_time


def new_session() -> aiohttp.ClientSession:
    # limit=0: no client-side cap on connections; keep-alive is aiohttp's default.
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))


# --------------------------------------------------------------------------- workload A


@dataclass
class ThroughputRun:
    mode: str
    round: int
    requests: int
    ok: int
    errors: dict[str, int]
    chunks: int
    seconds: float
    requests_per_s: float
    chunks_per_s: float
    capped: bool
    cpu_ms: dict[str, float]
    cpu_ms_per_request: dict[str, float]
    machine_busy_pct: float
    other_busy_pct: float


async def throughput(
    urls: Sequence[str],
    *,
    requests: int,
    concurrency: int,
    tokens: int,
    time_cap: float,
    tag: str,
) -> tuple[int, int, Counter[str], float, bool]:
    """``requests`` streams from ``concurrency`` clients, round-robin over ``urls``.

    Returns (sent, chunks, outcomes, seconds, capped). No new request starts after
    ``time_cap`` seconds; requests already in flight finish.
    """
    counter = itertools.count()
    outcomes: Counter[str] = Counter()
    chunks = 0
    capped = False
    async with new_session() as session:
        start = time.perf_counter()
        deadline = start + time_cap

        async def client() -> None:
            nonlocal chunks, capped
            while True:
                i = next(counter)
                if i >= requests:
                    return
                if time.perf_counter() > deadline:
                    capped = True
                    return
                url = urls[i % len(urls)] + PATH
                body = completion_body(f"{tag}-{i} {FILLER}", tokens)
                result = await stream_completion(session, url, body)
                chunks += result.chunks
                outcomes["ok" if result.ok else result.error] += 1

        await asyncio.gather(*(client() for _ in range(concurrency)))
        seconds = time.perf_counter() - start
    return sum(outcomes.values()), chunks, outcomes, seconds, capped


# --------------------------------------------------------------------------- workload B


@dataclass
class LatencySummary:
    mode: str
    samples: int
    errors: dict[str, int]
    p50_ms: float
    p90_ms: float
    p99_ms: float
    mean_ms: float


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100) of a non-empty sequence."""
    ordered = sorted(values)
    rank = max(1, -(-len(ordered) * q // 100))
    return ordered[int(rank) - 1]


def summarize(mode: str, seconds: Sequence[float], errors: Counter[str]) -> LatencySummary:
    ms = [s * 1000.0 for s in seconds] or [float("nan")]
    return LatencySummary(
        mode=mode,
        samples=len(seconds),
        errors=dict(errors),
        p50_ms=percentile(ms, 50),
        p90_ms=percentile(ms, 90),
        p99_ms=percentile(ms, 99),
        mean_ms=statistics.fmean(ms),
    )


async def added_ttft(
    router_url: str,
    prefill_url: str,
    decode_urls: Sequence[str],
    *,
    requests: int,
    tokens: int,
    warmup: int,
) -> dict[str, LatencySummary]:
    """One client, one request at a time, the three modes interleaved in rotating order."""
    samples: dict[str, list[float]] = {"direct": [], "manual_pd": [], "routed": []}
    errors: dict[str, Counter[str]] = {mode: Counter() for mode in samples}
    prefill_times: list[float] = []
    modes = list(samples)
    async with new_session() as session:
        for i in range(warmup + requests):
            measured = i >= warmup
            decode_url = decode_urls[i % len(decode_urls)]
            for j in range(len(modes)):
                mode = modes[(i + j) % len(modes)]
                body = completion_body(f"ttft-{mode}-{i} {FILLER}", tokens)
                if mode == "direct":
                    result = await stream_completion(
                        session, decode_url + PATH, body, want_ttft=True
                    )
                elif mode == "routed":
                    result = await stream_completion(
                        session, router_url + PATH, body, want_ttft=True
                    )
                else:
                    result, prefill_time = await manual_pd(session, prefill_url, decode_url, body)
                    if measured and result.ok:
                        prefill_times.append(prefill_time)
                if not measured:
                    continue
                if result.ok and result.ttft is not None:
                    samples[mode].append(result.ttft)
                else:
                    errors[mode][result.error or "no_text"] += 1
    summary = {mode: summarize(mode, samples[mode], errors[mode]) for mode in modes}
    summary["prefill_hop"] = summarize("prefill_hop", prefill_times, Counter())
    return summary


# --------------------------------------------------------------------------- profiling


PY_SPY_RATE = 100  # samples per second, py-spy's default


@dataclass
class Profile:
    samples: int
    expected: int = 0
    top_own: list[tuple[str, int]] = field(default_factory=list)
    top_router_inclusive: list[tuple[str, int]] = field(default_factory=list)
    raw_path: str = ""
    error: str = ""


def py_spy_command(pid: int, duration: int, out: str) -> list[str] | None:
    exe = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    if not Path(exe).exists():
        return None
    return [
        exe,
        "record",
        "--pid",
        str(pid),
        "--duration",
        str(duration),
        "--rate",
        str(PY_SPY_RATE),
        "--nonblocking",
        "--format",
        "raw",
        "--output",
        out,
    ]


_LINE_NUMBER = re.compile(r":\d+\)$")


def read_profile(raw_path: Path, top: int = 15) -> Profile:
    """py-spy's collapsed stacks ("f1;f2;leaf count"), one line per distinct stack.

    Own time: samples per leaf function (line numbers dropped, so one function is one row).
    Inclusive: samples whose stack passes through each ``pd_router`` function below the CLI.
    """
    own: Counter[str] = Counter()
    inclusive: Counter[str] = Counter()
    total = 0
    for line in raw_path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        frames = [_LINE_NUMBER.sub(")", frame) for frame in stack.split(";")]
        own[frames[-1]] += int(count)
        for frame in set(frames):
            # Below the entry point (main, serve), which every sample passes through.
            if "(pd_router/" in frame and not frame.endswith(("cli.py)", "__main__.py)")):
                inclusive[frame] += int(count)
        total += int(count)
    return Profile(
        samples=total,
        top_own=own.most_common(top),
        top_router_inclusive=inclusive.most_common(8),
        raw_path=str(raw_path),
    )


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


def machine_info() -> dict[str, Any]:
    model = ""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    versions = {}
    for package in ("pd-router", "aiohttp", "uvicorn", "starlette", "uvloop", "httptools"):
        try:
            versions[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            versions[package] = "-"
    return {
        "nproc": len(os.sched_getaffinity(0)),
        "cpu_count": os.cpu_count(),
        "cpu_model": model,
        "python": platform.python_version(),
        "implementation": platform.python_implementation(),
        "platform": platform.platform(),
        "versions": versions,
    }


def log(message: str) -> None:
    print(message, flush=True)


class Bench:
    def __init__(self, config: Config, fleet: SimFleet, router: RouterProcess) -> None:
        self.config = config
        self.fleet = fleet
        self.router = router
        self.decode_urls = [engine.url for engine in fleet.decode]
        self.prefill_url = fleet.prefill[0].url
        self.pids: dict[str, int] = {}
        for name, process in self._named_processes():
            if process.pid is None:
                raise RuntimeError(f"{name} is not running")
            self.pids[name] = process.pid
        self.runs: list[ThroughputRun] = []
        self.profile_run: ThroughputRun | None = None
        self.profile: Profile | None = None
        self.latency: dict[str, LatencySummary] = {}
        self._tags = itertools.count()
        self.loadavg: dict[str, tuple[float, float, float]] = {}
        self.ttft_other_busy_pct = 0.0

    def _named_processes(self) -> Iterator[tuple[str, ServerProcess]]:
        yield "router", self.router
        yield "prefill", self.fleet.prefill[0]
        for index, engine in enumerate(self.fleet.decode):
            yield f"decode{index}", engine

    async def _throughput(
        self, mode: str, round_: int, requests: int, time_cap: float | None = None
    ) -> ThroughputRun:
        config = self.config
        urls = self.decode_urls if mode == "direct" else [self.router.url]
        meter = CpuMeter(self.pids)
        meter.start()
        sent, chunks, outcomes, seconds, capped = await throughput(
            urls,
            requests=requests,
            concurrency=config.concurrency,
            tokens=config.tokens,
            time_cap=config.time_cap if time_cap is None else time_cap,
            tag=f"{mode}{next(self._tags)}",
        )
        used = meter.stop()
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
        if config.warmup:
            log(f"warm-up: {config.warmup} requests direct, {config.warmup} routed")
            for mode in ("direct", "routed"):
                run = await self._throughput(mode, 0, config.warmup)
                if run.errors:
                    raise RuntimeError(f"warm-up {mode} failed: {run.errors}")
        for round_ in range(1, config.rounds + 1):
            order = ("direct", "routed") if round_ % 2 else ("routed", "direct")
            for mode in order:
                run = await self._throughput(mode, round_, config.requests)
                self.runs.append(run)
                log(
                    f"  A round {round_} {mode:<7} {run.ok:>6} ok  {run.requests_per_s:8.1f} req/s"
                    f"  {run.chunks_per_s:10.0f} chunks/s  {run.seconds:6.2f} s"
                    f"  errors={run.errors or 0}{'  (time cap hit)' if run.capped else ''}"
                )
        if config.profile:
            await self._profiled_run()
        log(
            f"B: {config.ttft_requests} sequential requests per mode, "
            f"max_tokens={config.ttft_tokens}"
        )
        meter = CpuMeter(self.pids)
        meter.start()
        start = time.perf_counter()
        self.latency = await added_ttft(
            self.router.url,
            self.prefill_url,
            self.decode_urls,
            requests=config.ttft_requests,
            tokens=config.ttft_tokens,
            warmup=config.ttft_warmup,
        )
        capacity = (time.perf_counter() - start) * 1000.0 * (os.cpu_count() or 1) / 100.0
        self.ttft_other_busy_pct = meter.stop()["other"] / capacity

    async def _profiled_run(self) -> None:
        """An extra routed pass with py-spy attached; not used for the ratios."""
        config = self.config
        out = Path(tempfile.gettempdir()) / "router-profile.txt"
        command = py_spy_command(self.pids["router"], config.profile_seconds, str(out))
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

    # ----------------------------------------------------------------------- report

    def results(self) -> dict[str, Any]:
        return {
            "config": asdict(self.config),
            "machine": machine_info(),
            "throughput": {
                "runs": [asdict(run) for run in self.runs],
                "summary": self.throughput_summary(),
                "profiled_run": asdict(self.profile_run) if self.profile_run else None,
            },
            "ttft": {mode: asdict(summary) for mode, summary in self.latency.items()},
            "ttft_other_busy_pct": self.ttft_other_busy_pct,
            "profile": asdict(self.profile) if self.profile else None,
            "loadavg": self.loadavg,
        }

    def throughput_summary(self) -> dict[str, Any]:
        summary: dict[str, Any] = {}
        for mode in ("direct", "routed"):
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
            summary[mode] = {
                "requests": sent,
                "ok": ok,
                "errors": sum(errors.values()),
                "error_kinds": dict(errors),
                "requests_per_s": ok / seconds if seconds else 0.0,
                "chunks_per_s": sum(run.chunks for run in runs) / seconds if seconds else 0.0,
                "cpu_ms_per_request": {k: v / max(sent, 1) for k, v in sorted(cpu.items())},
            }
        direct, routed = summary["direct"], summary["routed"]
        summary["ratio_routed_over_direct"] = {
            key: (routed[key] / direct[key] if direct[key] else float("nan"))
            for key in ("requests_per_s", "chunks_per_s")
        }
        by_round: dict[int, dict[str, float]] = {}
        for run in self.runs:
            by_round.setdefault(run.round, {})[run.mode] = run.requests_per_s
        summary["ratio_per_round"] = [
            rates["routed"] / rates["direct"]
            for _, rates in sorted(by_round.items())
            if rates.get("direct") and "routed" in rates
        ]
        return summary

    def print_report(self) -> None:
        config = self.config
        info = machine_info()
        t = self.throughput_summary()
        direct, routed = t["direct"], t["routed"]
        ratio = t["ratio_routed_over_direct"]
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
            f" --ttft 0 --itl 0), router --decode-slots {config.decode_slots}"
        )
        log("")
        log(
            f"A. throughput: streaming {PATH}, max_tokens={config.tokens}, ignore_eos, "
            f"{config.concurrency} clients, {config.requests} requests x {config.rounds} "
            f"round(s) per mode"
        )
        log(f"   {'':<22}{'direct':>14}{'routed':>14}{'routed/direct':>16}")
        log(
            f"   {'requests/s':<22}{direct['requests_per_s']:>14.1f}"
            f"{routed['requests_per_s']:>14.1f}{ratio['requests_per_s']:>16.3f}"
        )
        log(
            f"   {'chunks/s':<22}{direct['chunks_per_s']:>14.0f}"
            f"{routed['chunks_per_s']:>14.0f}{ratio['chunks_per_s']:>16.3f}"
        )
        log(f"   {'errors':<22}{direct['errors']:>14}{routed['errors']:>14}")
        if len(t["ratio_per_round"]) > 1:
            log(
                "   routed/direct requests/s per round: "
                + "  ".join(f"{r:.3f}" for r in t["ratio_per_round"])
            )
        if direct["errors"] or routed["errors"]:
            log(f"   error kinds: direct={direct['error_kinds']} routed={routed['error_kinds']}")
        log("   CPU ms per request (utime+stime from /proc/<pid>/stat):")
        names = sorted(set(direct["cpu_ms_per_request"]) | set(routed["cpu_ms_per_request"]))
        names.remove("other")
        names.sort(key=lambda n: (n != "router", n == "loadgen", n))
        for name in names:
            d = direct["cpu_ms_per_request"].get(name, 0.0)
            r = routed["cpu_ms_per_request"].get(name, 0.0)
            log(f"     {name:<20}{d:>14.3f}{r:>14.3f}")
        servers = ("router", "prefill", "decode0", "decode1")
        total_d = sum(direct["cpu_ms_per_request"].get(k, 0.0) for k in servers)
        total_r = sum(routed["cpu_ms_per_request"].get(k, 0.0) for k in servers)
        log(f"     {'all servers':<20}{total_d:>14.3f}{total_r:>14.3f}")
        for mode in ("direct", "routed"):
            runs = [run for run in self.runs if run.mode == mode]
            log(
                f"   machine CPU busy during {mode} passes: "
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
        log("")
        log(
            f"B. TTFT: 1 client, keep-alive, max_tokens={config.ttft_tokens}, "
            f"{config.ttft_requests} sequential requests per mode, modes interleaved"
        )
        warn = self.ttft_other_busy_pct > OTHER_LOAD_WARNING_PCT
        log(
            f"   other processes used {self.ttft_other_busy_pct:.0f}% of the machine meanwhile"
            + ("  WARNING: latencies are unreliable" if warn else "")
        )
        log(f"   {'':<26}{'p50 ms':>10}{'p90 ms':>10}{'p99 ms':>10}{'mean ms':>10}{'errors':>8}")
        labels = {
            "direct": "direct (decode engine)",
            "manual_pd": "manual P/D (no router)",
            "routed": "routed (pd-router)",
            "prefill_hop": "  prefill hop alone",
        }
        for mode, label in labels.items():
            s = self.latency[mode]
            log(
                f"   {label:<26}{s.p50_ms:>10.2f}{s.p90_ms:>10.2f}{s.p99_ms:>10.2f}"
                f"{s.mean_ms:>10.2f}{sum(s.errors.values()):>8}"
            )
        d, m, r = self.latency["direct"], self.latency["manual_pd"], self.latency["routed"]
        log(
            f"   added TTFT, routed - direct:     p50 {r.p50_ms - d.p50_ms:+.2f} ms"
            f"   p99 {r.p99_ms - d.p99_ms:+.2f} ms"
        )
        log(
            f"   router's own, routed - manual:   p50 {r.p50_ms - m.p50_ms:+.2f} ms"
            f"   p99 {r.p99_ms - m.p99_ms:+.2f} ms"
        )
        log(
            "   (routed and manual P/D include a real prefill request and a KV pull from the "
            "prefill engine;\n    direct has neither, so routed - direct is not all router "
            "overhead)"
        )
        if self.profile is not None:
            log("")
            self._print_profile()
        log("=" * 88)

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
        log("   (time in uvloop's C code, e.g. socket I/O, shows up as its Python caller,")
        log("    such as Runner.run: py-spy sees Python frames only without --native)")
        log("   pd_router functions by inclusive time (a lower bound: py-spy loses the callers")
        log("   of some coroutines that uvloop resumes from C):")
        for frame, count in profile.top_router_inclusive:
            share = count / profile.samples * 100 if profile.samples else 0.0
            log(f"   {share:6.1f}%  {count:>6}  {frame}")
        log(f"   collapsed stacks: {profile.raw_path}")


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
    parser.add_argument("--quick", action="store_true", help="fewer requests, one round")
    parser.add_argument("--profile", action="store_true", help="py-spy the router (extra pass)")
    parser.add_argument("--profile-seconds", type=int, default=10)
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON here")
    return parser.parse_args(argv)


def make_config(args: argparse.Namespace) -> Config:
    quick = args.quick
    requests = args.requests or (300 if quick else 2000)
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
    )


def _raise_on_sigterm() -> Callable[[], None]:
    """Turn SIGTERM into SystemExit so every ``finally`` (process cleanup) runs."""

    def handler(signum: int, frame: FrameType | None) -> None:
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, handler)

    def restore() -> None:
        signal.signal(signal.SIGTERM, previous)

    return restore


def _event_loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    config = make_config(args)
    restore = _raise_on_sigterm()
    wall = time.perf_counter()
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
    try:
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
            bench = Bench(config, fleet, router)
            log(
                "pids: "
                + "  ".join(f"{name}={pid}" for name, pid in bench.pids.items())
                + f"  loadgen={os.getpid()}"
            )
            with asyncio.Runner(loop_factory=_event_loop_factory()) as runner:
                runner.run(bench.run())
            results = bench.results()
        # Engines and router are stopped here, before the report.
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

"""Soak benchmark: the router's memory and file descriptors stay flat under an adversarial mix.

Starts, on 127.0.0.1, one simulated prefill engine, two fast simulated decode engines and
``python -m pd_router`` in front of them with few decode slots and no queue (``--queue-timeout
0``: a request over the slots gets a 429 at once). Then it sends ``--requests`` requests
(50,000 by default) from ``--concurrency`` clients, a deterministic mix (``--seed``) of:

* ``stream``: SSE ``/v1/chat/completions`` or ``/v1/completions``, read to the end;
* ``plain``: the same, not streamed;
* ``hangup_early``, ``hangup_first``, ``hangup_mid``: a stream whose client closes the
  connection before it reads the response head, after the first event, or mid-stream;
* ``burst``: ``--burst`` streams at once, more than the router's slots: some get 429;
* ``bad_model``: a model the engines do not serve: the prefill engine's 404, relayed;
* ``large_ok``, ``large_rejected``: 1-8 MiB prompts; the rejected ones are over the
  engines' context length: the prefill engine's 400, relayed (the case that used to leak);
* on top, fault windows: every ``--fault-every`` draws of the mix, decode engine 1 answers
  every generation request with ``--fault-statuses`` (500, then 400, ...) for
  ``--fault-span`` draws (``POST /sim/config``): the router relays the engine's error.

Every answer is checked: streams end with ``[DONE]``, engine errors arrive with the
engine's status and message. Every ``--report-every`` requests it prints one line: requests
done, outcomes, the router's RSS (VmRSS; and its range, sampled every 0.2 s since the line
before) and open fds, elapsed time. After ``--warmup`` requests (20% by default) the load
pauses, the router idles ``--settle`` seconds (the sim engines close idle keep-alive
connections after 30 s), and its RSS and fds are the baseline; the same reading after the
last request is the final one. Exit 1 if RSS at rest grew by more than
``--max-rss-growth-mib``, or RSS under load did (the median of the lines' lowest readings,
second half of the run against first half), fds at rest by more than ``--max-fd-growth``,
``/health`` does not show 0 slots in use and an empty queue at the end, or an answer was
wrong; else 0.

    python benchmarks/soak.py [--requests N] [--max-seconds S] [--seed N] [--mix k=w,...]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import os
import random
import statistics
import sys
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import orjson

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from benchmarks.processes import (  # noqa: E402
    HOST,
    event_loop_factory,
    proc_status,
    raise_on_sigterm,
    run_coroutine,
)
from benchmarks.report import log  # noqa: E402
from benchmarks.workloads.requests import FILLER, completion_body, new_session  # noqa: E402
from pd_router.sim.fleet import EngineProcess, RouterProcess, SimFleet  # noqa: E402

MIB = 1 << 20
# Share of each kind of request (weights, normalized); a burst draw sends --burst requests.
DEFAULT_MIX = {
    "stream": 0.40,
    "plain": 0.16,
    "hangup_early": 0.06,
    "hangup_first": 0.06,
    "hangup_mid": 0.06,
    "burst": 0.006,
    "bad_model": 0.04,
    "large_ok": 0.02,
    "large_rejected": 0.03,
}
HANGUPS = ("hangup_early", "hangup_first", "hangup_mid")
# The error each kind gets from an engine through the router: status, part of the message.
RELAYED = {
    "bad_model": (404, "does not exist"),
    "large_rejected": (400, "maximum context length"),
}
FAULT_MESSAGE = "soak: injected engine failure"
# Words in a rejected prompt: over the sim's default --max-model-len (4096 tokens).
REJECTED_WORDS = 6000
REQUEST_TIMEOUT = aiohttp.ClientTimeout(total=60)
JSON_HEADERS = {"content-type": "application/json"}
SAMPLE_SECONDS = 0.2
PATHS = {True: "/v1/chat/completions", False: "/v1/completions"}


@dataclass(frozen=True)
class Job:
    """One draw of the mix; every random choice is made when it is drawn (``--seed``)."""

    index: int
    kind: str
    chat: bool
    stream: bool
    size: int = 0  # large_*: body bytes, about
    cut: int = 0  # hangup_first/mid: events read before hanging up
    delay: float = 0.0  # hangup_early: seconds between sending and hanging up


def draw_jobs(
    seed: int, mix: dict[str, float], tokens: int, large_mib: tuple[int, int]
) -> Iterator[Job]:
    rng = random.Random(seed)
    kinds = [kind for kind, weight in mix.items() if weight > 0]
    weights = [mix[kind] for kind in kinds]
    for index in itertools.count():
        kind = rng.choices(kinds, weights)[0]
        chat = rng.random() < 0.5
        stream = kind != "plain"
        size, cut, delay = 0, 0, 0.0
        if kind in RELAYED or kind.startswith("large_"):
            stream = rng.random() < 0.5
        if kind.startswith("large_"):
            size = rng.randint(large_mib[0] * MIB, large_mib[1] * MIB)
        elif kind == "hangup_first":
            cut = 1
        elif kind == "hangup_mid":
            cut = rng.randint(2, max(tokens - 1, 2))
        elif kind == "hangup_early":
            delay = rng.choice((0.0, 0.001, 0.003))
        yield Job(index, kind, chat, stream, size, cut, delay)


def prompt(job: Job) -> str:
    head = f"soak-{job.index} {FILLER}"
    if job.kind == "large_ok":
        # A few short words first, then one huge word: well within the context length, and
        # the output (the first prompt tokens again) stays small.
        return head + " " + "x" * max(job.size - len(head), 1)
    if job.kind == "large_rejected":
        word = "y" * max(job.size // REJECTED_WORDS - 1, 1)
        return head + (" " + word) * REJECTED_WORDS
    return head


def payload(job: Job, tokens: int) -> bytes:
    body = completion_body(prompt(job), tokens, job.stream)
    if job.chat:
        body["messages"] = [{"role": "user", "content": body.pop("prompt")}]
    if job.kind == "bad_model":
        body["model"] = "no-such-model"
    return orjson.dumps(body)


def error_message(raw: bytes) -> str | None:
    """The message of an OpenAI error body, or None if it is not one."""
    with contextlib.suppress(orjson.JSONDecodeError, LookupError, TypeError):
        message = orjson.loads(raw)["error"]["message"]
        if isinstance(message, str):
            return message
    return None


def judge(job: Job, status: int, raw: bytes, tokens: int, fault_statuses: set[int]) -> str:
    """The outcome: the status code, or ``bad:...`` when it is not the answer this job
    should get (an engine error not passed on, a stream without its end, ...)."""
    relayed = RELAYED.get(job.kind)
    if status == 200:
        if relayed is not None:
            return "bad:200-not-rejected"
        if not job.stream:
            return "200" if error_message(raw) is None and b'"choices"' in raw else "bad:200-body"
        events = raw.count(b"data: ")
        complete = raw.rstrip().endswith(b"data: [DONE]") and events >= tokens + 1
        return "200" if complete else "bad:200-stream-unfinished"
    message = error_message(raw)
    if message is None:
        return f"bad:{status}-no-error-body"
    if status == 429:
        return "429"
    if status in fault_statuses and FAULT_MESSAGE in message:
        return str(status)
    if relayed is not None and status == relayed[0] and relayed[1] in message:
        return str(status)
    return f"bad:{status}"


@dataclass
class Reading:
    done: int
    seconds: float
    rss_kib: int
    fds: int
    health: dict[str, Any] | None = None  # idle readings
    # Progress lines: the lowest and highest RSS sampled under load since the line before.
    low_kib: int = 0
    high_kib: int = 0


def count_fds(pid: int) -> int:
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return 0


class Soak:
    def __init__(self, args: argparse.Namespace, router: RouterProcess, faulty: EngineProcess):
        self.args = args
        self.router = router
        self.faulty = faulty
        pid = router.pid
        if pid is None:
            raise RuntimeError("the router is not running")
        self.pid = pid
        self.jobs = draw_jobs(
            args.seed, args.mix, args.tokens, (args.large_min_mib, args.large_max_mib)
        )
        self.fault_statuses = set(args.fault_statuses)
        self.issued = 0
        self.done = 0
        self.next_report = args.report_every
        self.outcomes: Counter[str] = Counter()
        self.by_kind: dict[str, Counter[str]] = {}
        self.bad_examples: list[str] = []
        self.readings: list[Reading] = []
        # RSS (KiB) sampled every SAMPLE_SECONDS under load since the last line.
        self.window: list[int] = []
        self.started = time.perf_counter()
        self.deadline = self.started + args.max_seconds
        self.capped = False
        self.baseline: Reading | None = None
        self.final: Reading | None = None

    # ------------------------------------------------------------------ bookkeeping

    def elapsed(self) -> float:
        return time.perf_counter() - self.started

    def read(self) -> Reading:
        return Reading(
            self.done, self.elapsed(), proc_status(self.pid, "VmRSS"), count_fds(self.pid)
        )

    def record(self, job: Job, outcome: str) -> None:
        self.done += 1
        self.outcomes[outcome] += 1
        self.by_kind.setdefault(job.kind, Counter())[outcome] += 1
        if outcome.startswith("bad:") and len(self.bad_examples) < 10:
            self.bad_examples.append(
                f"request {job.index} ({job.kind}, chat={job.chat}): {outcome}"
            )
        while self.done >= self.next_report:
            self.next_report += self.args.report_every
            reading = self.read()
            window = [*self.window, reading.rss_kib]
            self.window = []
            reading.low_kib, reading.high_kib = min(window), max(window)
            self.readings.append(reading)
            log(self.progress(reading))

    async def sample_rss(self) -> None:
        while True:
            self.window.append(proc_status(self.pid, "VmRSS"))
            await asyncio.sleep(SAMPLE_SECONDS)

    def progress(self, reading: Reading) -> str:
        statuses = sorted(k for k in self.outcomes if k.isdigit())
        parts = [f"{k}={self.outcomes[k]}" for k in statuses]
        parts.append(f"hup={self.outcomes['hup']}")
        bad = sum(n for k, n in self.outcomes.items() if k.startswith("bad:"))
        parts.append(f"bad={bad}")
        return (
            f"{reading.done:>7} requests  {reading.seconds:6.1f} s  {' '.join(parts)}  |  "
            f"router RSS {reading.rss_kib / 1024:5.1f} MiB (since last line "
            f"{reading.low_kib / 1024:.0f}-{reading.high_kib / 1024:.0f})  fds {reading.fds}"
        )

    # ------------------------------------------------------------------ load

    def next_job(self, limit: int) -> Job | None:
        if self.issued >= limit:
            return None
        if time.perf_counter() > self.deadline:
            self.capped = True
            return None
        job = next(self.jobs)
        self.issued += self.args.burst if job.kind == "burst" else 1
        return job

    async def fault_window(self, session: aiohttp.ClientSession, job: Job) -> None:
        """Turn decode engine 1's injected failure on or off at the window's edges."""
        every, span = self.args.fault_every, self.args.fault_span
        if every <= 0 or not self.fault_statuses:
            return
        window, offset = divmod(job.index, every)
        if window == 0 or offset not in (0, span):
            return
        statuses = self.args.fault_statuses
        status = statuses[(window - 1) % len(statuses)] if offset == 0 else None
        change = {"fail_status": status, "fail_message": FAULT_MESSAGE}
        async with session.post(self.faulty.url + "/sim/config", json=change) as response:
            response.raise_for_status()

    async def exchange(self, session: aiohttp.ClientSession, job: Job) -> str:
        """POST the job and read the whole answer; its outcome."""
        tokens = self.args.tokens
        try:
            async with session.post(
                self.router.url + PATHS[job.chat],
                data=payload(job, tokens),
                headers=JSON_HEADERS,
                timeout=REQUEST_TIMEOUT,
            ) as response:
                raw = await response.read()
                status = response.status
        except (aiohttp.ClientError, TimeoutError) as exc:
            return f"bad:{type(exc).__name__}"
        return judge(job, status, raw, tokens + job.chat, self.fault_statuses)

    async def hang_up(self, job: Job) -> str:
        """Send the request on a connection of its own and close it at the job's point."""
        body = payload(job, self.args.tokens)
        head = (
            f"POST {PATHS[job.chat]} HTTP/1.1\r\nHost: {HOST}:{self.router.port}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
        ).encode()
        try:
            reader, writer = await asyncio.open_connection(HOST, self.router.port)
        except OSError as exc:
            return f"bad:{type(exc).__name__}"
        try:
            async with asyncio.timeout(REQUEST_TIMEOUT.total):
                writer.write(head + body)
                await writer.drain()
                if job.kind == "hangup_early":
                    await asyncio.sleep(job.delay)
                    return "hup"
                status_line = await reader.readline()
                status = int(status_line.split()[1]) if status_line else 0
                if status != 200:
                    # An error before any event (a 429, a fault window): nothing to hang up on.
                    known = status == 429 or status in self.fault_statuses
                    return str(status) if known else f"bad:{status}"
                events = 0
                while events < job.cut:
                    line = await reader.readline()
                    if not line:
                        return "bad:hangup-stream-ended-early"
                    events += line.startswith(b"data: ")
                return "hup"
        except (OSError, TimeoutError, ValueError, IndexError) as exc:
            return f"bad:{type(exc).__name__}"
        finally:
            writer.close()

    async def burst(self, session: aiohttp.ClientSession, job: Job) -> list[str]:
        """``--burst`` streams at once: more than the router's slots."""
        subjobs = [Job(job.index, "burst", i % 2 == 0, True) for i in range(self.args.burst)]
        outcomes = await asyncio.gather(*(self.exchange(session, sub) for sub in subjobs))
        for sub, outcome in zip(subjobs, outcomes):
            self.record(sub, outcome)
        return outcomes

    async def client(self, session: aiohttp.ClientSession, limit: int) -> None:
        while (job := self.next_job(limit)) is not None:
            await self.fault_window(session, job)
            if job.kind == "burst":
                outcomes = await self.burst(session, job)
            else:
                outcome = await (
                    self.hang_up(job) if job.kind in HANGUPS else self.exchange(session, job)
                )
                self.record(job, outcome)
                outcomes = [outcome]
            if "429" in outcomes:
                # Like a client that waits a little after a 429 before it asks again: with
                # one decode node out (a fault window), 429s would otherwise come in a storm.
                await asyncio.sleep(self.args.backoff)

    async def drive(self, limit: int) -> None:
        """Requests until ``limit`` were sent (or time is up), all answered; then every
        client connection closed."""
        sampler = asyncio.create_task(self.sample_rss())
        try:
            async with new_session() as session:
                clients = (self.client(session, limit) for _ in range(self.args.concurrency))
                await asyncio.gather(*clients)
        finally:
            sampler.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await sampler

    async def idle_reading(self, label: str) -> Reading:
        """RSS, fds and /health after ``--settle`` seconds without load."""
        log(f"{label}: {self.done} requests done; router idle for {self.args.settle:g} s ...")
        await asyncio.sleep(self.args.settle)
        async with new_session() as session:
            async with session.get(self.router.url + "/health", timeout=REQUEST_TIMEOUT) as r:
                health = await r.json()
        await asyncio.sleep(0.5)  # the /health connection closed
        reading = self.read()
        reading.health = health
        self.window = []  # the next line's range: under load only
        log(
            f"{label}: router RSS {reading.rss_kib / 1024:.1f} MiB, fds {reading.fds}, "
            f"/health: {health.get('status')}, slots in use {health.get('decode_slots_in_use')}"
            f" of {health.get('decode_slots')}, queue {health.get('queue_depth')}"
        )
        return reading

    async def run(self) -> None:
        args = self.args
        warmup = min(args.warmup, args.requests)
        await self.drive(warmup)
        if self.capped:
            return
        self.baseline = await self.idle_reading("baseline")
        await self.drive(args.requests)
        self.final = await self.idle_reading("final")

    # ------------------------------------------------------------------ verdict

    def verdict(self) -> int:
        args = self.args
        log("outcomes by kind:")
        for kind in sorted(self.by_kind):
            counts = self.by_kind[kind]
            log(
                f"   {kind:<15} {sum(counts.values()):>7}  "
                + " ".join(f"{k}={n}" for k, n in sorted(counts.items()))
            )
        for example in self.bad_examples:
            log(f"   bad answer: {example}")
        if self.capped:
            log(f"NOTE: --max-seconds {args.max_seconds:g} reached after {self.done} requests")
        base, final = self.baseline, self.final
        if base is None or final is None:
            log("verdict: FAIL (inconclusive: the time cap was reached during the warm-up)")
            return 1
        bound = args.max_rss_growth_mib
        rest_growth = (final.rss_kib - base.rss_kib) / 1024
        # Under load, RSS swings with the requests in flight and the garbage not yet
        # collected; its lowest point per line moves with the memory that stays. The median
        # of those lows over the first and over the second half of the lines since the
        # baseline: one dip (the allocator gave memory back) does not move it.
        lines = [r for r in self.readings if r.done > base.done] or [final]
        lows = [r.low_kib / 1024 for r in lines]
        half = len(lows) // 2
        early, late = statistics.median(lows[:half] or lows), statistics.median(lows[half:])
        floor_growth = late - early
        peak = max(r.high_kib for r in lines) / 1024
        fd_growth = final.fds - base.fds
        health = final.health or {}
        bad = sum(n for k, n in self.outcomes.items() if k.startswith("bad:"))
        failures = []
        if rest_growth > bound:
            failures.append(f"RSS at rest grew {rest_growth:+.1f} MiB > +{bound:g}")
        if floor_growth > bound:
            failures.append(f"RSS under load (lows) grew {floor_growth:+.1f} MiB > +{bound:g}")
        if fd_growth > args.max_fd_growth:
            failures.append(f"fds grew {fd_growth:+d} > +{args.max_fd_growth}")
        if health.get("decode_slots_in_use") != 0 or health.get("queue_depth") != 0:
            failures.append("slots in use or queue not back to 0")
        if bad:
            failures.append(f"{bad} wrong answers")
        log(
            f"verdict: {'FAIL (' + '; '.join(failures) + ')' if failures else 'PASS'}  "
            f"{self.done} requests in {self.elapsed():.0f} s; router RSS at rest "
            f"{base.rss_kib / 1024:.1f} -> {final.rss_kib / 1024:.1f} MiB ({rest_growth:+.1f}, "
            f"bound +{bound:g}); under load, lows {early:.1f} -> {late:.1f} MiB "
            f"({floor_growth:+.1f}, bound +{bound:g}), highest {peak:.1f}; fds at rest "
            f"{base.fds} -> {final.fds} ({fd_growth:+d}, bound +{args.max_fd_growth}); "
            f"/health slots in use {health.get('decode_slots_in_use')}, queue "
            f"{health.get('queue_depth')}; wrong answers {bad}"
        )
        return 1 if failures else 0


# --------------------------------------------------------------------------- main


def parse_mix(text: str) -> dict[str, float]:
    mix = dict(DEFAULT_MIX)
    for item in filter(None, text.split(",")):
        kind, _, weight = item.partition("=")
        if kind not in mix:
            raise argparse.ArgumentTypeError(f"unknown kind {kind!r}: one of {', '.join(mix)}")
        try:
            mix[kind] = float(weight)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{item!r}: the weight is not a number") from None
    if sum(mix.values()) <= 0:
        raise argparse.ArgumentTypeError("every weight is 0")
    return mix


def parse_statuses(text: str) -> list[int]:
    return [int(s) for s in text.split(",") if s]


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="pd-router soak: RSS and fds stay flat under an adversarial mix "
        "(exit 1 if not)."
    )

    def add(flag: str, kind: Any, default: Any, text: str) -> None:
        parser.add_argument(flag, type=kind, default=default, help=f"{text} (%(default)s)")

    add("--requests", int, 50_000, "requests in all")
    add("--max-seconds", float, 1800.0, "no new request after this long")
    parser.add_argument(
        "--warmup", type=int, help="requests before the baseline reading (20%% of --requests)"
    )
    add("--seed", int, 1, "seed of the mix")
    parser.add_argument(
        "--mix",
        type=parse_mix,
        default=DEFAULT_MIX,
        metavar="KIND=WEIGHT,...",
        help="change some weights, e.g. stream=0.5,burst=0; the others keep theirs: "
        + ",".join(f"{kind}={weight:g}" for kind, weight in DEFAULT_MIX.items()),
    )
    add("--concurrency", int, 16, "clients")
    add("--burst", int, 32, "streams a burst sends at once")
    add("--backoff", float, 0.2, "seconds a client waits after a 429")
    add("--decode-slots", int, 12, "router --decode-slots (per decode node)")
    add("--tokens", int, 16, "max_tokens of every request")
    add("--ttft", float, 0.002, "decode engines' --ttft")
    add("--itl", float, 0.001, "decode engines' --itl")
    add("--large-min-mib", int, 1, "smallest large prompt, MiB")
    add("--large-max-mib", int, 8, "largest large prompt, MiB")
    add("--fault-every", int, 2500, "a fault window every N draws; 0: none")
    add("--fault-span", int, 250, "draws a fault window lasts")
    parser.add_argument(
        "--fault-statuses",
        type=parse_statuses,
        default=[500, 400],
        help="decode engine 1's fail_status in successive windows (500,400)",
    )
    add("--report-every", int, 5000, "a progress line every N requests")
    add("--settle", float, 32.0, "idle seconds before each reading")
    add("--max-rss-growth-mib", float, 64.0, "RSS bound over the baseline, MiB")
    add("--max-fd-growth", int, 32, "open fds bound over the baseline")
    args = parser.parse_args(argv)
    if args.warmup is None:
        args.warmup = args.requests // 5
    if args.report_every < 1 or args.requests < 1 or args.concurrency < 1 or args.burst < 1:
        parser.error("--requests, --report-every, --concurrency and --burst must be >= 1")
    if not 1 <= args.large_min_mib <= args.large_max_mib:
        parser.error("need 1 <= --large-min-mib <= --large-max-mib")
    if args.fault_span >= args.fault_every > 0:
        parser.error("--fault-span must be below --fault-every")
    return args


def router_log_errors(router: RouterProcess) -> list[str]:
    return [line for line in router.log().splitlines() if " ERROR " in line or "Traceback" in line]


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    restore = raise_on_sigterm()
    try:
        decode_args = ["--ttft", str(args.ttft), "--itl", str(args.itl), "--slots", "256"]
        log(
            f"soak: {args.requests} requests (warm-up {args.warmup}), {args.concurrency} "
            f"clients, seed {args.seed}; 1 prefill + 2 decode sim engines, pd-router "
            f"--decode-slots {args.decode_slots} --queue-timeout 0, on {HOST}"
        )
        total = sum(args.mix.values())
        log("mix: " + " ".join(f"{k}={v / total:.3f}" for k, v in args.mix.items() if v > 0))
        with contextlib.ExitStack() as stack:
            fleet = stack.enter_context(SimFleet(prefill=1, decode=2, decode_args=decode_args))
            router = stack.enter_context(
                RouterProcess(
                    [fleet.prefill[0].url],
                    [engine.url for engine in fleet.decode],
                    "--decode-slots",
                    str(args.decode_slots),
                    "--queue-timeout",
                    "0",
                )
            )
            pids = {"router": router.pid, "prefill": fleet.prefill[0].pid}
            pids.update({f"decode{i}": e.pid for i, e in enumerate(fleet.decode)})
            log(
                "pids: "
                + "  ".join(f"{k}={v}" for k, v in pids.items())
                + f"  loadgen={os.getpid()}"
            )
            soak = Soak(args, router, fleet.decode[1])
            with asyncio.Runner(loop_factory=event_loop_factory()) as runner:
                run_coroutine(runner, soak.run())
            errors = router_log_errors(router)
            log(f"router log: {len(errors)} error lines")
            for line in errors[:5]:
                log(f"   {line}")
            return soak.verdict()
    except KeyboardInterrupt:
        log("interrupted: engines and router stopped")
        return 130
    finally:
        restore()


if __name__ == "__main__":
    sys.exit(main())

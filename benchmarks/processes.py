"""Benchmark process management: CPU and memory of processes by PID, the comparison routers
(vllm-router, sglang-router) as processes, py-spy profiles, and SIGTERM turned into an
orderly exit.

Every benchmark here starts servers as processes and must stop each by its PID on every
exit path; these are the pieces they share.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import resource
import shutil
import signal
import subprocess  # nosec B404
import sys
import time
from collections import Counter
from collections.abc import Callable, Coroutine, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any, TypeVar

from benchmarks.report import log
from pd_router.sim.fleet import ServerProcess, free_port

T = TypeVar("T")
REPO_ROOT = Path(__file__).resolve().parent.parent
CLK_TCK = os.sysconf("SC_CLK_TCK")
HOST = "127.0.0.1"

VLLM_ROUTER_VERSION = "0.1.17"
VLLM_ROUTER_VENV = Path.home() / ".cache" / "pd-router" / "bench-venv"
VLLM_ROUTER_HINT = (
    "vllm-router not found (neither on PATH nor in {venv}): run once with "
    "--install-vllm-router (a venv outside the project, pip install vllm-router=={version}, "
    "~30 s) or pass --vllm-router PATH; its columns are skipped"
)
# Same conditions as pd-router here: no retries, no circuit breaker (pd-router has neither
# on this path), and no periodic health checks during the run (pd-router's probes every few
# seconds cost next to nothing; vllm-router's default is every 60 s anyway).
VLLM_ROUTER_FAIR_ARGS = (
    "--disable-retries",
    "--disable-circuit-breaker",
    "--health-check-interval-secs",
    "3600",
    # Startup only: it polls every engine's /health before it listens; the default is 30 s
    # between polls, but our engines are healthy before it starts.
    "--worker-startup-check-interval",
    "1",
)


def rust_router_args(port: int, policy: str, prometheus_port: int, log_level: str) -> list[str]:
    """How vllm-router and sglang-router (one code base) are run here, after their engines:
    on 127.0.0.1, a Prometheus port of their own (they bind one even when not asked), under
    ``VLLM_ROUTER_FAIR_ARGS``."""
    return [
        "--host",
        HOST,
        "--port",
        str(port),
        "--policy",
        policy,
        "--prometheus-port",
        str(prometheus_port),
        "--log-level",
        log_level,
        *VLLM_ROUTER_FAIR_ARGS,
    ]


@contextlib.contextmanager
def checkouts(revisions: Sequence[str], into: Path) -> Iterator[list[Path]]:
    """Each revision's tree (``.``: the working tree itself), the others checked out as
    detached git worktrees below ``into`` and removed on the way out."""
    trees: list[Path] = []
    added: list[Path] = []
    try:
        for index, revision in enumerate(revisions):
            if revision == ".":
                trees.append(REPO_ROOT)
                continue
            tree = into / str(index)
            subprocess.run(  # nosec B603 B607
                [
                    "git",
                    "-C",
                    str(REPO_ROOT),
                    "worktree",
                    "add",
                    "--detach",
                    "-q",
                    str(tree),
                    revision,
                ],
                check=True,
            )
            added.append(tree)
            trees.append(tree)
        yield trees
    finally:
        for tree in added:
            subprocess.run(  # nosec B603 B607
                ["git", "-C", str(REPO_ROOT), "worktree", "remove", "--force", str(tree)],
                check=False,
            )


@contextlib.contextmanager
def running(processes: Iterable[ServerProcess], timeout: float = 60.0) -> Iterator[None]:
    """All the processes started, then each healthy within ``timeout`` seconds (they start
    in parallel, their imports overlapping); each stopped by its PID on the way out."""
    started = list(processes)
    try:
        for process in started:
            process.start()
        for process in started:
            process.wait_healthy(timeout)
        yield
    finally:
        for process in started:
            process.stop()


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


def proc_status(pid: int, key: str) -> int:
    """One number from /proc/<pid>/status: ``VmRSS`` (KiB), ``Threads``; 0 if it is gone."""
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return 0
    for line in text.splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    return 0


class VllmRouterProcess(ServerProcess):
    """vllm-router in vLLM P/D mode in front of the given engines, on 127.0.0.1.

    It renames its process ``vllm::router``: only the Popen PID identifies it. It binds a
    Prometheus port even when not asked, so it always gets a free one of its own.
    """

    name = "vllm-router"

    def __init__(
        self,
        executable: str,
        prefill: Sequence[str],
        decode: Sequence[str],
        policy: str = "round_robin",
    ) -> None:
        super().__init__()
        self.executable = executable
        self.policy = policy
        self.prefill_urls = list(prefill)
        self.decode_urls = list(decode)
        self.prometheus_port = 0
        self.threads_at_start = 0
        self.stop_note = ""

    def start(self) -> VllmRouterProcess:
        self.prometheus_port = free_port()
        super().start()
        return self

    def command(self) -> list[str]:
        argv = [self.executable, "--vllm-pd-disaggregation"]
        for url in self.prefill_urls:
            argv += ["--prefill", url]
        for url in self.decode_urls:
            argv += ["--decode", url]
        return [*argv, *rust_router_args(self.port, self.policy, self.prometheus_port, "warning")]

    def wait_healthy(self, timeout: float = 30.0) -> None:
        # It listens only once every engine answered GET /health.
        super().wait_healthy(timeout)
        if self.pid is not None:
            self.threads_at_start = proc_status(self.pid, "Threads")

    def stop(self, timeout: float = 5.0) -> int | None:
        """SIGTERM, up to ``timeout`` s, then SIGKILL; notes how it went and checks the PID."""
        pid = self.pid
        if pid is None:
            return super().stop(timeout)
        start = time.perf_counter()
        code = super().stop(timeout)
        took = time.perf_counter() - start
        if code == -signal.SIGKILL:
            self.stop_note = f"pid {pid}: still running {timeout:.0f} s after SIGTERM, SIGKILLed"
        else:
            self.stop_note = f"pid {pid}: exit code {code}, {took:.2f} s after SIGTERM"
        if Path(f"/proc/{pid}").exists():
            self.stop_note += "; WARNING: the pid still exists after it was reaped"
        return code


SGLANG_ROUTER_VERSION = "0.3.2"
SGLANG_ROUTER_VENV = Path.home() / ".cache" / "pd-router" / "sgl-venv"
SGLANG_ROUTER_HINT = (
    "sglang-router not found (neither on PATH nor in {venv}): python3.11 -m venv {venv} && "
    "{venv}/bin/pip install sglang-router=={version} (~20 s), or pass --sglang-router PATH; "
    "its columns are skipped"
)


class SglangRouterProcess(ServerProcess):
    """sglang-router (SGLang's Rust router) in PD mode in front of the given engines, on
    127.0.0.1, under the conditions ``VLLM_ROUTER_FAIR_ARGS`` gives vllm-router (both are
    the same code base): ``prefill`` pairs a URL with its bootstrap port."""

    name = "sglang-router"

    def __init__(
        self, executable: str, prefill: Sequence[tuple[str, int]], decode: Sequence[str]
    ) -> None:
        super().__init__()
        self.executable = executable
        self.prefill = list(prefill)
        self.decode_urls = list(decode)
        self.prometheus_port = 0

    def start(self) -> SglangRouterProcess:
        self.prometheus_port = free_port()
        super().start()
        return self

    def command(self) -> list[str]:
        argv = [self.executable, "launch", "--pd-disaggregation"]
        for url, bootstrap_port in self.prefill:
            argv += ["--prefill", url, str(bootstrap_port)]
        for url in self.decode_urls:
            argv += ["--decode", url]
        return [*argv, *rust_router_args(self.port, "round_robin", self.prometheus_port, "warn")]


def find_sglang_router() -> str | None:
    """``sglang-router`` on PATH, else the one in ``SGLANG_ROUTER_VENV``."""
    for candidate in (shutil.which("sglang-router"), SGLANG_ROUTER_VENV / "bin" / "sglang-router"):
        if candidate and os.access(candidate, os.X_OK):
            return str(candidate)
    return None


def vllm_router_version(executable: str) -> str:
    """The installed vllm-router's version, from the dist-info next to the executable."""
    prefix = Path(executable).resolve().parent.parent
    for dist in prefix.glob("lib/python*/site-packages/vllm_router-*.dist-info"):
        return dist.name.removesuffix(".dist-info").split("-", 1)[1]
    return "?"


def find_vllm_router() -> str | None:
    """``vllm-router`` on PATH, else the one --install-vllm-router puts in the cache venv."""
    for candidate in (shutil.which("vllm-router"), VLLM_ROUTER_VENV / "bin" / "vllm-router"):
        if candidate and os.access(candidate, os.X_OK):
            return str(candidate)
    return None


def install_vllm_router(timeout: float) -> str | None:
    """Make VLLM_ROUTER_VENV and pip-install vllm-router there, within ``timeout`` s.

    Outside the project's venv on purpose: it brings its own fastapi, uvicorn and aiohttp.
    Returns the executable, or None after printing why it failed.
    """
    executable = VLLM_ROUTER_VENV / "bin" / "vllm-router"
    if os.access(executable, os.X_OK):
        return str(executable)
    created = not VLLM_ROUTER_VENV.exists()
    steps = []
    if not (VLLM_ROUTER_VENV / "bin" / "pip").exists():
        steps.append([sys.executable, "-m", "venv", str(VLLM_ROUTER_VENV)])
    steps.append(
        [
            str(VLLM_ROUTER_VENV / "bin" / "pip"),
            "install",
            "--quiet",
            "--disable-pip-version-check",
            f"vllm-router=={VLLM_ROUTER_VERSION}",
        ]
    )
    log(
        f"installing vllm-router=={VLLM_ROUTER_VERSION} into {VLLM_ROUTER_VENV} "
        f"(~30 s, at most {timeout:.0f} s)"
    )
    deadline = time.monotonic() + timeout
    failure = ""
    for step in steps:
        remaining = deadline - time.monotonic()
        try:
            done = subprocess.run(  # nosec B603
                step,
                stdin=subprocess.DEVNULL,
                capture_output=True,
                timeout=max(remaining, 1.0),
                check=False,
            )
        except subprocess.TimeoutExpired:
            failure = f"timed out after {timeout:.0f} s: {' '.join(step)}"
            break
        except OSError as exc:
            failure = f"{' '.join(step)}: {exc}"
            break
        if done.returncode != 0:
            errors = [
                line
                for line in done.stderr.decode(errors="replace").splitlines()
                if line.strip() and not line.startswith("WARNING: Location")
            ]
            tail = "\n    ".join(errors[-8:])
            failure = f"exit code {done.returncode}: {' '.join(step)}\n    {tail}"
            break
    if not failure and not os.access(executable, os.X_OK):
        failure = f"pip succeeded but {executable} is not there"
    if failure:
        log(f"vllm-router install FAILED ({failure}); its columns are skipped")
        if created:
            shutil.rmtree(VLLM_ROUTER_VENV, ignore_errors=True)
        return None
    log(f"installed {executable}")
    return str(executable)


def raise_nofile_limit() -> tuple[int, int]:
    """Raise this process's soft RLIMIT_NOFILE to the hard one; children inherit it."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and (hard == resource.RLIM_INFINITY or soft < hard):
        with contextlib.suppress(ValueError, OSError):
            target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)


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


def py_spy_command(pid: int, duration: int, out: str, native: bool) -> list[str] | None:
    """``native``: C frames too (the kernel's read/write show as libc); it stops the router
    for each sample, where the default samples without stopping it."""
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
        "--native" if native else "--nonblocking",
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
            if "(pd_router/" in frame and not frame.endswith(
                ("cli.py)", "serve.py)", "__main__.py)")
            ):
                inclusive[frame] += int(count)
        total += int(count)
    return Profile(
        samples=total,
        top_own=own.most_common(top),
        top_router_inclusive=inclusive.most_common(8),
        raw_path=str(raw_path),
    )


def _sigterm_to_exit(signum: int, frame: FrameType | None) -> None:
    # Once: a second SIGTERM must not interrupt the cleanup the first one started.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    raise SystemExit(128 + signum)


def raise_on_sigterm() -> Callable[[], None]:
    """Turn SIGTERM into SystemExit so every ``finally`` (process cleanup) runs.

    That is for the synchronous parts (starting and stopping processes); while the event
    loop runs, ``run_coroutine`` handles SIGTERM instead.
    """
    previous = signal.signal(signal.SIGTERM, _sigterm_to_exit)

    def restore() -> None:
        signal.signal(signal.SIGTERM, previous)

    return restore


def run_coroutine(runner: asyncio.Runner, coro: Coroutine[Any, Any, T]) -> T:
    """``runner.run(coro)``, where SIGTERM cancels ``coro`` and then raises SystemExit.

    An exception raised by a signal handler lands in whatever callback runs at that moment;
    uvloop takes one raised in a protocol callback for a transport error, logs it and goes
    on. Cancelling the task instead runs every ``finally`` of the workload (sessions closed,
    engines' knobs restored), and the SystemExit then unwinds the processes' cleanup.
    """
    terminated = False

    async def guarded() -> T:
        loop = asyncio.get_running_loop()
        task = asyncio.current_task()
        assert task is not None  # nosec B101

        def on_sigterm() -> None:
            nonlocal terminated
            terminated = True
            task.cancel()

        loop.add_signal_handler(signal.SIGTERM, on_sigterm)
        try:
            return await coro
        finally:
            # remove_signal_handler leaves SIG_DFL behind: put the synchronous handler back.
            loop.remove_signal_handler(signal.SIGTERM)
            signal.signal(signal.SIGTERM, _sigterm_to_exit if not terminated else signal.SIG_IGN)

    try:
        result = runner.run(guarded())
    except asyncio.CancelledError:
        if terminated:
            raise SystemExit(128 + signal.SIGTERM) from None
        raise
    if terminated:
        raise SystemExit(128 + signal.SIGTERM)
    return result


def event_loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop

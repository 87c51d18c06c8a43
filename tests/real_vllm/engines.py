"""Start real vLLM CPU engines (prefill kv_producer + decode kv_consumer, NixlConnector over
loopback) for the project's real-engine tests.

Standard library only, so it imports in the router's venv; vLLM itself runs from its own venv,
made by ``setup_env.sh`` next to this file (``$PD_ROUTER_VLLM_VENV``, default
``~/.cache/pd-router/vllm-venv``). The tiny random Llama model is built by ``make_model.py``
into ``$PD_ROUTER_VLLM_MODEL_DIR`` (default ``~/.cache/pd-router/tiny-llama-<hash of
make_model.py>``).

Usage::

    from engines import VllmPair          # tests/real_vllm on sys.path

    with VllmPair() as pair:               # ~1-2 min: two engines, ~3 GB RSS each
        pair.prefill_url, pair.decode_url  # "http://127.0.0.1:PORT"
        pair.model                         # "tiny" (served model name)
        pair.log_path("prefill")           # engine log file

Baseline token ids: a kv_producer engine answers a normal request (no
``kv_transfer_params``) completely, like a plain engine, so the prefill engine of the pair
is the baseline and no third engine is needed (``pair.baseline_url``). ``single_engine()``
starts a plain engine (no kv-transfer) should a test want one anyway, and
``VllmPair.another_prefill()`` a second prefill engine (mind the RAM: ~3 GB an engine, three
at most on a 24 GiB machine next to other work).

Every engine runs in its own process group (``start_new_session=True``); stopping sends
SIGTERM to the group, then SIGKILL after 10 s, on every exit path of the context manager,
at interpreter exit (atexit) and, for the server process itself, when the process that
started it dies (PR_SET_PDEATHSIG on Linux). Environment knobs:

- ``PD_ROUTER_VLLM_VENV``: venv path (see setup_env.sh).
- ``PD_ROUTER_VLLM_MODEL_DIR``: where the tiny model is built/reused.
- ``PD_ROUTER_VLLM_STARTUP_TIMEOUT``: seconds to wait for /health (default 300).
- ``PD_ROUTER_VLLM_LOGGING_LEVEL``: VLLM_LOGGING_LEVEL for the engines (default INFO).
"""

from __future__ import annotations

import atexit
import contextlib
import hashlib
import json
import os
import random
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path

HERE = Path(__file__).resolve().parent
SETUP_ENV = HERE / "setup_env.sh"
MAKE_MODEL = HERE / "make_model.py"

CACHE_ROOT = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "pd-router"
SERVED_MODEL_NAME = "tiny"
DEFAULT_STARTUP_TIMEOUT = float(os.environ.get("PD_ROUTER_VLLM_STARTUP_TIMEOUT", "300"))
STOP_GRACE_SECONDS = 10.0

# The kv_transfer_params a router sends to the prefill engine (NixlConnector pull protocol).
PREFILL_KV_TRANSFER_PARAMS: dict = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}

# Flags added only if `api_server --help` lists them (probed once per venv, cached).
OPTIONAL_FLAGS = ("--enable-request-id-headers", "--enable-prompt-tokens-details")


class EngineStartError(RuntimeError):
    """An engine died or did not become healthy in time; the message has its log tail."""


# --------------------------------------------------------------------------------------
# venv and model
# --------------------------------------------------------------------------------------

_venv_lock = threading.Lock()
_venv_ready: dict[str, Path] = {}


# vLLM binds no OpenMP thread to a core: the kernel may move an engine to whichever core
# runs. One core each was the measured setup (shared/notes), but twice in CI this
# machine's second vCPU was starved for minutes (the kernel log: "workqueue lockup - pool
# cpus=1 ... stuck for 178s", RCU starved on cpu 1); the decode engine, bound to it, stood
# still that long and the test waiting on it failed, while whatever could run on the other
# core went on.
NO_BIND = "nobind"


def _say(message: str) -> None:
    print(f"[real vLLM] {message}", file=sys.stderr, flush=True)


# Where the slow steps (minutes, silent otherwise) say what they do; conftest.py points it
# at pytest's terminal, which shows it live where captured output would not.
progress: Callable[[str], None] = _say


@contextlib.contextmanager
def step(what: str) -> Iterator[None]:
    progress(f"{what}...")
    started = time.monotonic()
    yield
    progress(f"{what}: done in {time.monotonic() - started:.0f} s")


def default_venv() -> Path:
    return Path(os.environ.get("PD_ROUTER_VLLM_VENV", CACHE_ROOT / "vllm-venv"))


def ensure_venv(venv: str | os.PathLike | None = None, timeout: float = 1800) -> Path:
    """Run setup_env.sh (idempotent; ~10 s when the venv is ready, ~3 min to install).
    Returns the venv path. Memoised per process."""
    venv_path = Path(venv) if venv else default_venv()
    key = str(venv_path)
    with _venv_lock:
        if key in _venv_ready:
            return _venv_ready[key]
        env = dict(os.environ, PD_ROUTER_VLLM_VENV=key)
        for var in ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME"):
            env.pop(var, None)
        res = subprocess.run(
            ["bash", str(SETUP_ENV)],
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        if res.returncode != 0:
            raise RuntimeError(
                f"setup_env.sh failed (exit {res.returncode}):\n{_tail_text(res.stderr, 60)}"
            )
        lines = res.stdout.strip().splitlines()
        path = Path(lines[-1]) if lines else venv_path
        _venv_ready[key] = path
        return path


def venv_python(venv: Path) -> Path:
    return venv / "bin" / "python"


def default_model_dir() -> Path:
    if "PD_ROUTER_VLLM_MODEL_DIR" in os.environ:
        return Path(os.environ["PD_ROUTER_VLLM_MODEL_DIR"])
    # Key the cached model on the builder's source: edit make_model.py -> new model dir.
    digest = hashlib.sha256(MAKE_MODEL.read_bytes()).hexdigest()[:12]
    return CACHE_ROOT / f"tiny-llama-{digest}"


def ensure_model(venv: Path, model_dir: str | os.PathLike | None = None) -> Path:
    """Build (or reuse) the tiny model with the vLLM venv's python. ~10 s the first time."""
    out = Path(model_dir) if model_dir else default_model_dir()
    res = subprocess.run(
        [str(venv_python(venv)), str(MAKE_MODEL), str(out)],
        env=_clean_env({"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}),
        capture_output=True,
        text=True,
        timeout=600,
    )
    if res.returncode != 0:
        raise RuntimeError(
            f"make_model.py failed (exit {res.returncode}):\n{_tail_text(res.stderr, 60)}"
        )
    return Path(res.stdout.strip().splitlines()[-1])


def supported_flags(venv: Path, flags: Sequence[str] = OPTIONAL_FLAGS) -> set[str]:
    """Which of ``flags`` this vLLM's api_server accepts (from ``--help``, cached per venv)."""
    cache = venv / ".pd_router_api_server_help.txt"
    if not cache.exists():
        res = subprocess.run(
            [str(venv_python(venv)), "-m", "vllm.entrypoints.openai.api_server", "--help"],
            env=_clean_env({"HF_HUB_OFFLINE": "1"}),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            timeout=300,
        )
        if res.returncode != 0:
            raise RuntimeError(f"api_server --help failed:\n{_tail_text(res.stdout, 40)}")
        tmp = cache.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(res.stdout)
        os.replace(tmp, cache)
    text = cache.read_text()
    return {f for f in flags if f"[{f}" in text or f"  {f}" in text}


# --------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------


def _clean_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """The caller's environment without the router venv's Python settings."""
    env = dict(os.environ)
    for var in ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP"):
        env.pop(var, None)
    if extra:
        env.update(extra)
    return env


def _tail_text(text: str, n: int) -> str:
    return "\n".join(text.splitlines()[-n:])


def tail_file(path: str | os.PathLike, n: int = 60) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - 256 * 1024))
            data = f.read().decode("utf-8", "replace")
    except OSError as e:
        return f"<cannot read {path}: {e}>"
    return _tail_text(data, n)


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """n distinct ports that were free a moment ago (all held open while choosing).

    Chosen below the kernel's ephemeral range: vLLM binds its NIXL side channel minutes
    after we choose (model load), and a port from the ephemeral range can meanwhile become
    the local end of some outgoing connection ("Address already in use" in one CI run)."""
    low = _ephemeral_low()
    candidates = random.sample(range(max(1024, low - 12000), low), 400)  # nosec B311
    socks: list[socket.socket] = []
    try:
        for port in candidates:
            if len(socks) == n:
                break
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            try:
                s.bind((host, port))
            except OSError:
                s.close()
                continue
            socks.append(s)
        if len(socks) < n:
            raise OSError(f"no {n} free ports below {low}")
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def http_get(url: str, timeout: float = 5.0) -> tuple[int, str]:
    """GET with the standard library; (status, body). Connection errors raise OSError."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read().decode("utf-8", "replace")
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode("utf-8", "replace")


def metrics(base_url: str, grep: Sequence[str] = (), timeout: float = 30.0) -> list[str]:
    """Lines of GET /metrics (Prometheus text), optionally only those containing any of
    ``grep`` (case-insensitive), comment lines dropped."""
    _, body = http_get(base_url.rstrip("/") + "/metrics", timeout=timeout)
    out = []
    for line in body.splitlines():
        if not line or line.startswith("#"):
            continue
        if grep and not any(g.lower() in line.lower() for g in grep):
            continue
        out.append(line)
    return out


def metric_value(base_url: str, name: str) -> float | None:
    """Sum of all samples of metric ``name`` (exact name, any labels); None if absent."""
    total, seen = 0.0, False
    for line in metrics(base_url, [name]):
        metric = line.split("{", 1)[0].split(" ", 1)[0]
        if metric == name:
            total += float(line.rsplit(" ", 1)[1])
            seen = True
    return total if seen else None


def _set_pdeathsig() -> None:  # runs in the child between fork and exec
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        PR_SET_PDEATHSIG = 1
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except Exception:
        pass


def _group_members(pgid: int) -> list[int]:
    """Live (non-zombie) processes of process group ``pgid``."""
    if not os.path.isdir("/proc"):
        try:
            os.killpg(pgid, 0)
            return [pgid]
        except (ProcessLookupError, PermissionError):
            return []
    return [
        pid
        for pid, fields in _proc_stats()
        if len(fields) >= 3 and fields[0] != "Z" and int(fields[2]) == pgid
    ]


def _proc_stats() -> Iterator[tuple[int, list[str]]]:
    """Every process's pid and its /proc/<pid>/stat fields after the command name
    (state, ppid, pgrp, ...); the name is in parentheses and may contain spaces."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                stat = f.read().decode("utf-8", "replace")
        except OSError:
            continue
        yield int(entry), stat[stat.rfind(")") + 2 :].split()


def stop_process_group(proc: subprocess.Popen, grace: float = STOP_GRACE_SECONDS) -> None:
    """SIGTERM the process group led by ``proc`` (its pid), SIGKILL after ``grace`` s."""
    pgid = proc.pid
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline:
        proc.poll()
        if not _group_members(pgid):
            break
        time.sleep(0.2)
    else:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, signal.SIGKILL)
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and _group_members(pgid):
            time.sleep(0.1)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=5)


_live: set[VllmEngine] = set()
_live_lock = threading.Lock()


@atexit.register
def _stop_all_at_exit() -> None:
    with _live_lock:
        engines = list(_live)
    for e in engines:
        e.stop()


def rss_bytes(pid: int) -> int:
    """RSS of ``pid`` plus all its descendants (bytes, Linux)."""
    children: dict[int, list[int]] = {}
    rss: dict[int, int] = {}
    page = os.sysconf("SC_PAGE_SIZE")
    for p, fields in _proc_stats():
        children.setdefault(int(fields[1]), []).append(p)
        rss[p] = int(fields[21]) * page
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        total += rss.get(p, 0)
        todo.extend(children.get(p, []))
    return total


# --------------------------------------------------------------------------------------
# engines
# --------------------------------------------------------------------------------------


class VllmEngine:
    """One ``vllm.entrypoints.openai.api_server`` process (group). ``role`` is "prefill"
    (kv_producer), "decode" (kv_consumer) or "single" (no kv-transfer)."""

    def __init__(
        self,
        role: str,
        *,
        venv: Path,
        model_dir: Path,
        work_dir: Path,
        port: int,
        side_channel_port: int | None = None,
        cpu_bind: str | None = None,
        kv_extra_config: Mapping | None = None,
        extra_args: Sequence[str] = (),
        extra_env: Mapping[str, str] | None = None,
        optional_flags: Sequence[str] = (),
    ) -> None:
        if role not in ("prefill", "decode", "single"):
            raise ValueError(role)
        self.role = role
        self.venv = venv
        self.model_dir = model_dir
        self.work_dir = work_dir
        self.port = port
        self.side_channel_port = side_channel_port
        self.url = f"http://127.0.0.1:{port}"
        # The port of its KV cache events (--kv-events-config), if it publishes them.
        self.kv_events_port: int | None = None
        self.log_path = work_dir / f"{role}.log"
        self.proc: subprocess.Popen | None = None
        self._log_file = None

        cmd = [
            str(venv_python(venv)), "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(model_dir),
            "--served-model-name", SERVED_MODEL_NAME,
            "--host", "127.0.0.1",
            "--port", str(port),
            "--dtype", "float32",
            "--max-model-len", "512",
            "--enforce-eager",
            *optional_flags,
        ]  # fmt: skip
        env = _clean_env(
            {
                "HF_HUB_OFFLINE": "1",
                "TRANSFORMERS_OFFLINE": "1",
                "HF_HOME": str(work_dir / "hf-home"),
                "VLLM_CPU_KVCACHE_SPACE": "1",
                "VLLM_CACHE_ROOT": str(work_dir / "vllm-cache"),
                "VLLM_NO_USAGE_STATS": "1",
                "DO_NOT_TRACK": "1",
                "VLLM_LOGGING_LEVEL": os.environ.get("PD_ROUTER_VLLM_LOGGING_LEVEL", "INFO"),
                "UCX_NET_DEVICES": "lo",
                "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1",
                "PYTHONUNBUFFERED": "1",
            }
        )
        if cpu_bind is not None:
            env["VLLM_CPU_OMP_THREADS_BIND"] = cpu_bind
        if role in ("prefill", "decode"):
            if side_channel_port is None:
                raise ValueError("side_channel_port is required for prefill/decode")
            env["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(side_channel_port)
            kv_cfg: dict = {
                "kv_connector": "NixlConnector",
                "kv_role": "kv_producer" if role == "prefill" else "kv_consumer",
                "kv_buffer_device": "cpu",
            }
            if kv_extra_config:
                kv_cfg["kv_connector_extra_config"] = dict(kv_extra_config)
            cmd += ["--kv-transfer-config", json.dumps(kv_cfg)]
        cmd += list(extra_args)
        if extra_env:
            env.update(extra_env)
        self.cmd = cmd
        self.env = env

    # -- lifecycle --------------------------------------------------------------------

    def start(self) -> None:
        self.work_dir.mkdir(parents=True, exist_ok=True)
        self._log_file = open(self.log_path, "ab", buffering=0)
        shown_env = {k: v for k, v in self.env.items() if k.startswith(("VLLM_", "UCX_", "HF_"))}
        self._log_file.write(
            f"### pd-router harness: {time.strftime('%H:%M:%S')} starting {self.role}\n"
            f"### env: {shown_env}\n### cmd: {shlex.join(self.cmd)}\n".encode()
        )
        self.proc = subprocess.Popen(
            self.cmd,
            env=self.env,
            cwd=str(self.work_dir),
            stdin=subprocess.DEVNULL,
            stdout=self._log_file,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=_set_pdeathsig if sys.platform.startswith("linux") else None,
        )
        with _live_lock:
            _live.add(self)

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def healthy(self) -> bool:
        try:
            status, _ = http_get(self.url + "/health", timeout=2)
            return status == 200
        except OSError:
            return False

    def log_tail(self, n: int = 60) -> str:
        return tail_file(self.log_path, n)

    def check_alive(self) -> None:
        if self.proc is not None and self.proc.poll() is not None:
            raise EngineStartError(
                f"vLLM {self.role} engine (pid {self.proc.pid}) exited with "
                f"{self.proc.returncode}; log {self.log_path}:\n{self.log_tail()}"
            )

    def stop(self) -> None:
        if self.proc is not None:
            stop_process_group(self.proc)
        if self._log_file is not None:
            with contextlib.suppress(OSError):
                self._log_file.write(
                    f"### pd-router harness: {time.strftime('%H:%M:%S')} stopped\n".encode()
                )
                self._log_file.close()
            self._log_file = None
        with _live_lock:
            _live.discard(self)

    def rss(self) -> int:
        return rss_bytes(self.proc.pid) if self.alive() else 0


@contextlib.contextmanager
def niced(engines: Sequence[VllmEngine], niceness: int = 10) -> Iterator[None]:
    """Run the block with the running ``engines`` (every thread of their process groups) at
    ``niceness``, then back at 0. Only as root, who may lower it again; else a no-op."""
    groups = [e.pid for e in engines if e.alive() and e.pid is not None]
    if os.geteuid() != 0:
        groups = []
    try:
        for pgid in groups:
            with contextlib.suppress(ProcessLookupError):
                os.setpriority(os.PRIO_PGRP, pgid, niceness)
        yield
    finally:
        for pgid in groups:
            with contextlib.suppress(ProcessLookupError):
                os.setpriority(os.PRIO_PGRP, pgid, 0)


def wait_healthy(engines: Sequence[VllmEngine], timeout: float = DEFAULT_STARTUP_TIMEOUT) -> float:
    """Wait until every engine answers 200 on /health; fail early if one dies.
    Returns the seconds waited."""
    t0 = time.monotonic()
    pending = list(engines)
    told = t0
    while pending:
        if time.monotonic() - told >= 30:
            told = time.monotonic()
            waiting = ", ".join(e.role for e in pending)
            progress(f"waiting {told - t0:.0f} s so far for {waiting} to answer /health")
        for e in list(pending):
            e.check_alive()
            if e.healthy():
                pending.remove(e)
        if not pending:
            break
        if time.monotonic() - t0 > timeout:
            tails = "\n".join(f"--- {e.role} ({e.log_path}):\n{e.log_tail(40)}" for e in pending)
            raise EngineStartError(
                f"vLLM engine(s) {[e.role for e in pending]} not healthy after {timeout:.0f} s\n"
                + tails
            )
        time.sleep(1.0)
    return time.monotonic() - t0


class _Harness:
    """Shared set-up: venv, model, work dir."""

    def __init__(
        self,
        work_dir: str | os.PathLike | None,
        venv: str | os.PathLike | None,
        model_dir: str | os.PathLike | None,
        startup_timeout: float,
    ) -> None:
        self._own_work_dir = work_dir is None
        self.work_dir = Path(work_dir) if work_dir else None
        self._venv_arg = venv
        self._model_arg = model_dir
        self.startup_timeout = startup_timeout
        self.model = SERVED_MODEL_NAME
        self.venv: Path | None = None
        self.model_dir: Path | None = None
        self.timings: dict[str, float] = {}

    def _prepare(self) -> None:
        t = time.monotonic()
        with step("the vLLM venv (about 3 min the first time, then seconds)"):
            self.venv = ensure_venv(self._venv_arg)
        self.timings["ensure_venv_s"] = time.monotonic() - t
        t = time.monotonic()
        with step("the tiny test model"):
            self.model_dir = ensure_model(self.venv, self._model_arg)
        self.timings["ensure_model_s"] = time.monotonic() - t
        t = time.monotonic()
        self.flags = sorted(supported_flags(self.venv))
        self.timings["probe_flags_s"] = time.monotonic() - t
        if self.work_dir is None:
            self.work_dir = Path(tempfile.mkdtemp(prefix="pd-router-vllm-"))
        self.work_dir.mkdir(parents=True, exist_ok=True)


class VllmPair(_Harness):
    """Prefill (kv_producer) + decode (kv_consumer) engines with NixlConnector on loopback.

    Attributes after ``__enter__``: ``prefill_url``, ``decode_url``, ``baseline_url`` (the
    prefill engine: it serves requests without kv_transfer_params as a plain engine),
    ``model``, ``prefill``/``decode`` (VllmEngine: ``pid``, ``port``, ``side_channel_port``),
    ``work_dir``, ``timings``; ``log_path(role)``.

    ``kv_extra_config`` becomes ``kv_connector_extra_config`` of both engines, e.g.
    ``{"kv_lease_duration": 10}`` (seconds the prefill engine keeps un-pulled KV blocks;
    default 30, renewed by the decode engine's heartbeats while it waits for them).
    """

    def __init__(
        self,
        work_dir: str | os.PathLike | None = None,
        *,
        venv: str | os.PathLike | None = None,
        model_dir: str | os.PathLike | None = None,
        startup_timeout: float = DEFAULT_STARTUP_TIMEOUT,
        kv_extra_config: Mapping | None = None,
        extra_args: Sequence[str] = (),
        prefill_args: Sequence[str] = (),
        decode_args: Sequence[str] = (),
        extra_env: Mapping[str, str] | None = None,
        spare_prefills: int = 0,
        kv_events: bool = False,
    ) -> None:
        super().__init__(work_dir, venv, model_dir, startup_timeout)
        self.spare_prefills = spare_prefills
        self.kv_events = kv_events
        self.kv_extra_config = kv_extra_config
        self.extra_args = list(extra_args)
        self.prefill_args = list(prefill_args)
        self.decode_args = list(decode_args)
        self.extra_env = dict(extra_env or {})
        self.prefill: VllmEngine | None = None
        self.decode: VllmEngine | None = None
        # Engines started by another_prefill() and still running.
        self.extra: list[VllmEngine] = []
        # Prefill engines started with the pair, running, for another_prefill() to hand out.
        self.spares: list[VllmEngine] = []

    @property
    def engines(self) -> list[VllmEngine]:
        return [e for e in (self.prefill, self.decode) if e is not None]

    @property
    def prefill_url(self) -> str:
        assert self.prefill is not None, "VllmPair not started"
        return self.prefill.url

    @property
    def decode_url(self) -> str:
        assert self.decode is not None, "VllmPair not started"
        return self.decode.url

    baseline_url = prefill_url

    def log_path(self, role: str) -> Path:
        eng = {"prefill": self.prefill, "decode": self.decode}[role]
        assert eng is not None, "VllmPair not started"
        return eng.log_path

    def start(self) -> VllmPair:
        try:
            self._prepare()
            assert self.venv and self.model_dir and self.work_dir
            p_port, d_port, p_side, d_side, *spare_ports = free_ports(4 + 2 * self.spare_prefills)
            self.prefill = self._engine("prefill", p_port, p_side, self.work_dir)
            self.decode = self._engine("decode", d_port, d_side, self.work_dir)
            self.spares = [
                self._engine("prefill", port, side, self.work_dir / f"prefill-{i + 2}")
                for i, (port, side) in enumerate(zip(spare_ports[::2], spare_ports[1::2]))
            ]
            t = time.monotonic()
            spares = f" and {len(self.spares)} more prefill" if self.spares else ""
            with step(f"starting the prefill and decode engines{spares} (1-3 min)"):
                for engine in [*self.engines, *self.spares]:
                    engine.start()
                wait_healthy([*self.engines, *self.spares], self.startup_timeout)
            self.timings["startup_s"] = time.monotonic() - t
        except BaseException:
            self.stop()
            raise
        return self

    def _engine(self, role: str, port: int, side_channel_port: int, work_dir: Path) -> VllmEngine:
        """An engine of this pair's settings for ``role`` (not started)."""
        assert self.venv and self.model_dir
        role_args = self.prefill_args if role == "prefill" else self.decode_args
        events_port = None
        if self.kv_events and role == "prefill":
            # Its KV cache events, on a port of its own (``engine.kv_events_port``).
            (events_port,) = free_ports(1)
            config = {
                "enable_kv_cache_events": True,
                "publisher": "zmq",
                # vLLM binds an endpoint with "*" or "::" in it and connects to any other:
                # an IPv4-mapped address binds 127.0.0.1 alone.
                "endpoint": f"tcp://[::ffff:127.0.0.1]:{events_port}",
                "topic": "kv-events",
            }
            role_args = [*role_args, "--kv-events-config", json.dumps(config)]
        engine = VllmEngine(
            role, port=port, side_channel_port=side_channel_port, cpu_bind=NO_BIND,
            venv=self.venv, model_dir=self.model_dir, work_dir=work_dir,
            kv_extra_config=self.kv_extra_config, extra_env=self.extra_env,
            optional_flags=self.flags, extra_args=self.extra_args + role_args,
        )  # fmt: skip
        engine.kv_events_port = events_port
        return engine

    @contextlib.contextmanager
    def another_prefill(self, name: str = "prefill-2") -> Iterator[VllmEngine]:
        """One more prefill (kv_producer) engine with this pair's settings, for a test that
        needs two (~3 GB RSS), stopped on every exit from the ``with`` block: a spare
        started with the pair (``spare_prefills``) if one is still running, else a new one
        (1-3 min to start), its log and caches in ``work_dir / name``. The decode engine's
        first request to it makes a NIXL handshake of its own. ``diagnosis()`` lists it
        while it runs; ``revive()`` does not restart it.

        The pair's engines, idle, keep both cores busy (NIXL's progress thread and the
        worker's polling, two threads each) and slow a new engine's start: they give way
        (``niced``) meanwhile, which measured 129-161 s against 161-191 s without. A spare
        starts with the pair instead, before anything polls."""
        assert self.work_dir is not None, "VllmPair not started"
        spare = next((e for e in self.spares if e.alive()), None)
        if spare is not None:
            self.spares.remove(spare)
            engine = spare
        else:
            port, side_channel_port = free_ports(2)
            engine = self._engine("prefill", port, side_channel_port, self.work_dir / name)
        self.extra.append(engine)
        try:
            if spare is None:
                with step(f"starting another prefill engine, {name} (1-3 min)"):
                    with niced(self.engines):
                        engine.start()
                        wait_healthy([engine], self.startup_timeout)
            yield engine
        finally:
            self.extra.remove(engine)
            engine.stop()

    def revive(self) -> bool:
        """Restart both engines, on the same ports, if either has exited; True if it did.

        vLLM ends an engine whose model worker has not answered for
        ``VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS``, and this machine has stood still for
        minutes (kernel: workqueue lockups on both vCPUs, 19:17-19:23 in one CI run, when
        the decode engine died that way). One test fails then; the rest need a live pair.
        """
        if all(e.alive() for e in self.engines):
            return False
        with step("an engine had exited: restarting the pair on the same ports"):
            for e in (self.decode, self.prefill):
                if e is not None:
                    e.stop()
            for e in self.engines:
                e.start()
            wait_healthy(self.engines, self.startup_timeout)
        return True

    def diagnosis(self, lines: int = 12) -> str:
        """For a failed test's report: each engine's state and the last errors in its log."""
        parts = []
        for e in [*self.engines, *self.extra, *self.spares]:
            state = (
                "running" if e.alive() else f"exited with {e.proc.returncode if e.proc else None}"
            )
            errors = [
                line
                for line in tail_file(e.log_path, 4000).splitlines()
                if " ERROR " in line or "Traceback" in line or "fatal" in line
            ]
            parts.append(f"--- {e.role} engine (pid {e.pid}): {state}; log {e.log_path}")
            parts += [line[:300] for line in errors[-lines:]] or ["(no ERROR lines)"]
        return "\n".join(parts)

    def stop(self) -> None:
        # Stop both even if one stop raises; decode first (it may be pulling from prefill).
        errors = []
        for e in (*self.spares, self.decode, self.prefill):
            if e is None:
                continue
            try:
                e.stop()
            except BaseException as exc:  # noqa: BLE001
                errors.append(exc)
        if errors:
            raise errors[0]

    def __enter__(self) -> VllmPair:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


class SingleEngine(_Harness):
    """A plain engine (no kv-transfer): ``url``, ``model``, ``log_path()``."""

    def __init__(
        self,
        work_dir: str | os.PathLike | None = None,
        *,
        venv: str | os.PathLike | None = None,
        model_dir: str | os.PathLike | None = None,
        startup_timeout: float = DEFAULT_STARTUP_TIMEOUT,
        extra_args: Sequence[str] = (),
        extra_env: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(work_dir, venv, model_dir, startup_timeout)
        self.extra_args = list(extra_args)
        self.extra_env = dict(extra_env or {})
        self.engine: VllmEngine | None = None

    @property
    def url(self) -> str:
        assert self.engine is not None, "SingleEngine not started"
        return self.engine.url

    def log_path(self, role: str = "single") -> Path:
        assert self.engine is not None
        return self.engine.log_path

    def start(self) -> SingleEngine:
        try:
            self._prepare()
            assert self.venv and self.model_dir and self.work_dir
            (port,) = free_ports(1)
            self.engine = VllmEngine(
                "single", venv=self.venv, model_dir=self.model_dir, work_dir=self.work_dir,
                port=port, extra_args=self.extra_args, extra_env=self.extra_env,
                optional_flags=self.flags,
            )  # fmt: skip
            t = time.monotonic()
            with step("starting a plain vLLM engine (about 1 min)"):
                self.engine.start()
                wait_healthy([self.engine], self.startup_timeout)
            self.timings["startup_s"] = time.monotonic() - t
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        if self.engine is not None:
            self.engine.stop()

    def __enter__(self) -> SingleEngine:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


@contextlib.contextmanager
def single_engine(**kwargs) -> Iterator[SingleEngine]:
    """A plain vLLM engine without kv-transfer (~3 GB). Usually unnecessary: the prefill
    engine of a VllmPair serves requests without kv_transfer_params as a plain engine."""
    with SingleEngine(**kwargs) as eng:
        yield eng


def prefill_body(client_body: Mapping) -> dict:
    """The body a router sends to the prefill engine for ``client_body``."""
    body = dict(client_body)
    body["max_tokens"] = 1
    if "max_completion_tokens" in body:
        body["max_completion_tokens"] = 1
    body["stream"] = False
    body.pop("stream_options", None)
    body.pop("min_tokens", None)
    body["kv_transfer_params"] = dict(PREFILL_KV_TRANSFER_PARAMS)
    return body


def decode_body(client_body: Mapping, prefill_response: Mapping) -> dict:
    """The body a router sends to the decode engine: the client's, plus the prefill
    response's kv_transfer_params."""
    body = dict(client_body)
    body["kv_transfer_params"] = prefill_response["kv_transfer_params"]
    return body


if __name__ == "__main__":  # smoke: start the pair, print URLs, stop
    with VllmPair() as pair:
        print(json.dumps({
            "prefill_url": pair.prefill_url, "decode_url": pair.decode_url,
            "work_dir": str(pair.work_dir), "timings": pair.timings,
            "rss_mb": {e.role: e.rss() // 2**20 for e in pair.engines},
        }, indent=2))  # fmt: skip

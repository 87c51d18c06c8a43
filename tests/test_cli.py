"""The command line's first five minutes: bad values refused in one line before anything
starts, a taken port refused with a hint (and no engines left behind by the demo),
``--port 0``, defaults in ``--help``, the demo's settings from every source, and the
prefill rows of ``pd-router status``. The real CLI runs as a subprocess, except where
only parsing is checked."""

from __future__ import annotations

import argparse
import json
import os
import re
import selectors
import signal
import socket
import subprocess  # nosec B404
import sys
import time
import urllib.request
import uuid
from collections.abc import Iterator, Mapping, Sequence
from importlib import metadata
from pathlib import Path

import openai
import pytest

from pd_router.config import options_of
from pd_router.demo import demo_parser, parse
from pd_router.serve import parse_router_args, router_parser
from pd_router.sim.fleet import free_port
from pd_router.status import format_table, from_admin, from_metrics
from tests.helpers import streamed_text, wait_for

README = Path(__file__).resolve().parent.parent / "README.md"

# Engines nobody listens on: enough for the router to start, or to refuse other flags.
ENGINES = ["--prefill", "http://127.0.0.1:9", "--decode", "http://127.0.0.1:9"]
IN_USE = "address already in use; pass --port to choose another (or --port 0 for any free port)"


def environment(extra: Mapping[str, str] = {}) -> dict[str, str]:
    """This environment without the tester's own PD_ROUTER_* settings, plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PD_ROUTER_")}
    return {**env, **extra}


def run(*argv: str, env: Mapping[str, str] = {}) -> subprocess.CompletedProcess[str]:
    return subprocess.run(  # nosec B603
        [sys.executable, "-m", "pd_router", *argv],
        capture_output=True,
        text=True,
        timeout=30,
        env=environment(env),
    )


def refusal(done: subprocess.CompletedProcess[str]) -> str:
    """The one line of a start refused with exit 2, without argparse's usage."""
    assert done.returncode == 2, done.stderr
    assert done.stdout == "" and "Traceback" not in done.stderr, done.stderr
    [line] = done.stderr.splitlines()
    assert ": error: " in line, done.stderr
    return line


def listening(family: socket.AddressFamily, host: str) -> socket.socket:
    try:
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.bind((host, 0))
    except OSError:
        pytest.skip(f"no {host} here")
    sock.listen()
    return sock


def marked(mark: str) -> list[int]:
    """Live processes that inherited ``mark`` in their environment from a test's command."""
    pids = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and mark.encode() in (entry / "environ").read_bytes():
                pids.append(int(entry.name))
        except OSError:
            continue  # someone else's, or gone meanwhile
    return pids


@pytest.mark.parametrize(
    ("argv", "env", "expected"),
    [
        (
            [*ENGINES, "--port", "70000"],
            {},
            "pd-router: error: argument --port: must be a whole number from 0 to 65535 "
            "(0: any free port), got '70000'",
        ),
        (
            [*ENGINES],
            {"PD_ROUTER_PORT": "-1"},
            "pd-router: error: PD_ROUTER_PORT: must be a whole number from 0 to 65535",
        ),
        (
            [*ENGINES, "--connect-timeout", "0"],
            {},
            "pd-router: error: argument --connect-timeout: must be a number of seconds > 0",
        ),
        (
            # A collector's credentials in a mistyped URL are not repeated.
            [*ENGINES, "--otlp-traces-endpoint", "ftp://user:S3cretT0ken@collector/v1/traces"],
            {},
            "pd-router: error: argument --otlp-traces-endpoint: expected an http:// or https:// "
            "URL of an OTLP/HTTP collector (http://collector:4318/v1/traces), got "
            "'ftp://***@collector/v1/traces'",
        ),
        (
            # Without its scheme, the most likely slip: no URL to parse, masked all the same.
            [*ENGINES, "--otlp-traces-endpoint", "alice:S3cretT0ken@collector:4318"],
            {},
            "pd-router: error: argument --otlp-traces-endpoint: expected an http:// or https:// "
            "URL of an OTLP/HTTP collector (http://collector:4318/v1/traces), got "
            "'***@collector:4318'",
        ),
        (
            [*ENGINES, "--stall-timeout", "1e309"],
            {},
            "pd-router: error: argument --stall-timeout: must be a number of seconds >= 0",
        ),
        (
            # int() and float() take these as 10 and 4: a number is written in ASCII digits.
            [*ENGINES, "--workers", "1_0"],
            {},
            "pd-router: error: argument --workers: must be a whole number >= 1 and <= 64, "
            "got '1_0'",
        ),
        (
            # More digits than int() reads: argparse's "invalid convert value", before.
            [*ENGINES, "--workers", "0" * 5000 + "1"],
            {},
            "pd-router: error: argument --workers: must be a whole number >= 1 and <= 64 of "
            f"at most 18 digits, got '{'0' * 5000}1'",
        ),
        (
            # A number no count reaches: the message names the cap, which is why it is refused.
            [*ENGINES, "--max-body-bytes", "1" + "0" * 19],
            {},
            "pd-router: error: argument --max-body-bytes: must be a whole number >= 1 of at "
            f"most 18 digits, got '1{'0' * 19}'",
        ),
        (
            [*ENGINES, "--decode-slots", "\u0664"],
            {},
            "pd-router: error: argument --decode-slots: must be a whole number >= 1",
        ),
        (
            [*ENGINES],
            {"PD_ROUTER_QUEUE_TIMEOUT": "1_0"},
            "pd-router: error: PD_ROUTER_QUEUE_TIMEOUT: must be a number of seconds >= 0",
        ),
        (
            # An empty address is every interface's: a template's unset variable.
            [*ENGINES, "--host", ""],
            {},
            "pd-router: error: argument --host: must be an address or name to listen on "
            "(0.0.0.0: every interface), got ''",
        ),
        (
            ["demo", "--ttft", "-1"],
            {},
            "pd-router demo: error: argument --ttft: must be a number of seconds >= 0, got '-1'",
        ),
        (
            ["demo", "--itl", "-1"],
            {},
            "pd-router demo: error: argument --itl: must be a number of seconds >= 0, got '-1'",
        ),
        (
            ["demo", "--decode-nodes", "0"],
            {},
            "pd-router demo: error: argument --decode-nodes: must be a whole number >= 1, got '0'",
        ),
        (
            ["demo", "--port", "65536"],
            {},
            "pd-router demo: error: argument --port: must be a whole number from 0 to 65535",
        ),
        (
            ["demo"],
            {"PD_ROUTER_DECODE_NODES": "0"},
            "pd-router demo: error: PD_ROUTER_DECODE_NODES: must be a whole number >= 1",
        ),
        (
            ["demo", "--models", "alpha,beta"],
            {},
            "pd-router demo: error: argument --models: expected a model name, without spaces "
            "or commas (several: --models alpha beta), got 'alpha,beta'",
        ),
        (
            ["demo", "--models", "alpha", "beta", "alpha"],
            {},
            "pd-router demo: error: --models: 'alpha' is named twice",
        ),
        (
            ["demo", "--prefill", "http://127.0.0.1:9"],
            {},
            "pd-router demo: error: the demo starts its own engines: --prefill and --decode",
        ),
        (
            ["demo", "--decode-dns", "decode.ns:8200"],
            {},
            "pd-router demo: error: the demo starts its own engines: --prefill and --decode",
        ),
        (
            ["demo", "--port", "0"],
            {"PD_ROUTER_PREFILL_DNS": "prefill.ns:8100"},
            "pd-router demo: error: the demo starts its own engines: --prefill and --decode",
        ),
        (
            ["--prefill", "http://127.0.0.1:9", "--decode-dns", "decode.ns:8200,slot=2"],
            {},
            "pd-router: error: --decode-dns: 'decode.ns:8200,slot=2': unknown option 'slot' "
            "(did you mean slots?)",
        ),
        (
            [*ENGINES, "--otlp-traces-endpoint", "collector:4318"],
            {},
            "pd-router: error: argument --otlp-traces-endpoint: expected an http:// or https:// "
            "URL of an OTLP/HTTP collector (http://collector:4318/v1/traces), got "
            "'collector:4318'",
        ),
        (
            ENGINES,
            {"PD_ROUTER_OTLP_TRACES_ENDPOINT": "grpc://collector:4317"},
            "pd-router: error: PD_ROUTER_OTLP_TRACES_ENDPOINT: expected an http:// or https:// "
            "URL",
        ),
        (
            ENGINES,
            {"OTEL_EXPORTER_OTLP_ENDPOINT": "collector:4318"},
            "pd-router: error: OTEL_EXPORTER_OTLP_ENDPOINT: expected an http:// or https:// URL",
        ),
        (
            ENGINES,
            {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4317", "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"},
            "pd-router: error: OTEL_EXPORTER_OTLP_PROTOCOL=grpc: pd-router exports traces over "
            "OTLP/HTTP with protobuf (http/protobuf) only; point it at the collector's HTTP port",
        ),
        (
            ["demo", "--otlp-traces-endpoint", "http://c:4318"],
            {"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "grpc"},
            "pd-router demo: error: OTEL_EXPORTER_OTLP_TRACES_PROTOCOL=grpc: pd-router exports",
        ),
    ],
)
def test_a_bad_value_is_one_line_and_exit_2(
    argv: list[str], env: dict[str, str], expected: str
) -> None:
    assert refusal(run(*argv, env=env)).startswith(expected)


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (
            [*ENGINES, "--queue-timout", "5"],
            "pd-router: error: unrecognized arguments: --queue-timout 5 "
            "(did you mean --queue-timeout?); see pd-router --help",
        ),
        (
            ["demo", "--bogus"],
            "pd-router demo: error: unrecognized arguments: --bogus; see pd-router demo --help",
        ),
        (
            ["status", "--bogus"],
            "pd-router status: error: unrecognized arguments: --bogus; "
            "see pd-router status --help",
        ),
        (
            ["statsu"],
            "pd-router: error: unknown command 'statsu' (did you mean status?); "
            "see pd-router --help",
        ),
        (
            [],
            "pd-router: error: the following settings are required: --prefill (or "
            "PD_ROUTER_PREFILL, or prefill in the config file) or --prefill-dns (or "
            "PD_ROUTER_PREFILL_DNS, or prefill_dns in the config file), --decode (or "
            "PD_ROUTER_DECODE, or decode in the config file) or --decode-dns (or "
            "PD_ROUTER_DECODE_DNS, or decode_dns in the config file); see pd-router --help",
        ),
        (
            ["serve", *ENGINES],
            "pd-router: error: unknown command 'serve' (commands: demo, status); "
            "see pd-router --help",
        ),
    ],
)
def test_a_mistake_on_the_command_line_is_one_line_with_a_hint(
    argv: list[str], expected: str
) -> None:
    assert refusal(run(*argv)) == expected


def test_version_and_usage_name_the_commands() -> None:
    done = run("--version")
    assert (done.returncode, done.stdout) == (0, f"pd-router {metadata.version('pd-router')}\n")
    usage = run("--help").stdout.split("\n\n")[0]
    assert usage.splitlines() == [
        "usage: pd-router --prefill URL ... --decode URL ... [options]",
        "       pd-router demo [options]",
        "       pd-router status [options]",
    ]


def test_a_bad_value_in_the_demos_config_file_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "demo.toml"
    path.write_text("port = 70000\n")
    line = refusal(run("demo", "--config", str(path)))
    assert line.startswith(f"pd-router demo: error: {path}: port: must be a whole number from 0")


@pytest.mark.parametrize(
    "flags",
    [
        ["--api-keys-file", "/nonexistent/keys"],
        ["--ssl-keyfile", "key.pem"],
        ["--state", "http://x"],
    ],
    ids=["keys", "tls", "state"],
)
def test_a_setting_the_demos_router_refuses_is_one_line(flags: list[str]) -> None:
    """Refused once its engines are up (the router is made for their URLs): before, a
    traceback and exit code 1; now as the router's own command says it, its engines
    stopped."""
    line = refusal(run("demo", "--port", "0", *flags))
    assert line.startswith("pd-router demo: error: "), line


@pytest.mark.parametrize(
    ("flags", "said"),
    [
        (
            ["--dialect", "sglang", "--max-local-prefill", "5"],
            "--max-local-prefill needs --dialect vllm",
        ),
        (["--bootstrap-port", "0"], "argument --bootstrap-port: must be a whole number from 1"),
        (
            ["--bootstrap-port", "65536"],
            "argument --bootstrap-port: must be a whole number from 1 to 65535, got '65536'",
        ),
        (
            ["--prefill", "http://127.0.0.1:9,bootstrap_port=x"],
            "bootstrap_port must be a port number, got 'x'",
        ),
    ],
    ids=["local-prefill", "port", "port-above", "label"],
)
def test_sglang_settings_that_cannot_work_are_refused_at_start(flags: list[str], said: str) -> None:
    assert said in refusal(run(*ENGINES, *flags))


def _numeric(actions: Sequence[argparse.Action]) -> Iterator[str]:
    for option in options_of(actions).values():
        if option.number:
            yield option.flag


@pytest.mark.parametrize("command", ["pd-router", "pd-router demo"])
@pytest.mark.parametrize("bad", ["-1", "soon"])
def test_every_numeric_flag_names_its_range(
    command: str, bad: str, capsys: pytest.CaptureFixture[str]
) -> None:
    make = router_parser if command == "pd-router" else demo_parser
    engines = ENGINES if command == "pd-router" else []
    flags = list(_numeric(make()[1]))
    assert "--port" in flags and (command == "pd-router" or "--ttft" in flags)
    for flag in flags:
        parser, actions = make()
        with pytest.raises(SystemExit) as exit_info:
            parse_router_args(parser, actions, [*engines, flag, bad], {})
        error = capsys.readouterr().err.splitlines()[-1]
        assert exit_info.value.code == 2, flag
        assert re.search(rf"argument {flag}: must be .*(>=? \d|from [01] to 65535)", error), error


@pytest.mark.parametrize(
    ("family", "host", "shown"),
    [(socket.AF_INET, "127.0.0.1", "127.0.0.1"), (socket.AF_INET6, "::1", "[::1]")],
)
def test_a_taken_port_is_one_line_with_a_hint(
    family: socket.AddressFamily, host: str, shown: str
) -> None:
    with listening(family, host) as taken:
        port = taken.getsockname()[1]
        done = run(*ENGINES, "--host", host, "--port", str(port))
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr == f"pd-router: error: cannot listen on {shown}:{port}: {IN_USE}\n"


def test_a_host_that_is_no_text_is_one_line() -> None:
    """A byte of argv that is not UTF-8 (Python keeps it as a lone surrogate) crashed the
    start with a traceback: the socket cannot encode it."""
    assert refusal(run(*ENGINES, "--host", "\udcff")) == (
        "pd-router: error: --host '\\udcff': not an address"
    )


def test_the_demo_on_a_taken_port_starts_no_engine() -> None:
    mark = f"pd-router-test-cli-{uuid.uuid4().hex}"
    seen: set[int] = set()
    with listening(socket.AF_INET, "127.0.0.1") as taken:
        port = taken.getsockname()[1]
        demo = subprocess.Popen(  # nosec B603
            [sys.executable, "-m", "pd_router", "demo", "--port", str(port)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=environment({"CLI_TEST_MARK": mark}),
        )
        # Watched while it runs: engines started, then stopped on the way out, would leave
        # no trace afterwards.
        deadline = time.monotonic() + 30
        while demo.poll() is None and time.monotonic() < deadline:
            seen.update(marked(mark))
            time.sleep(0.01)
        if demo.poll() is None:
            demo.kill()
        stdout, stderr = demo.communicate()
    engines = sorted(seen - {demo.pid})
    for pid in marked(mark):
        os.kill(pid, signal.SIGKILL)
    assert engines == [], "the demo started simulated engines"
    # No banner: it is printed once the engines are up.
    assert demo.returncode == 2 and stdout == ""
    assert stderr == f"pd-router demo: error: cannot listen on 127.0.0.1:{port}: {IN_USE}\n"


class Running:
    """The CLI as a process of ours, its output read as it comes."""

    def __init__(self, argv: Sequence[str], env: Mapping[str, str] = {}) -> None:
        self.process = subprocess.Popen(  # nosec B603
            [sys.executable, "-m", "pd_router", *argv],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=environment(env),
        )
        self.output = {"stdout": b"", "stderr": b""}

    def wait_for(self, stream: str, pattern: str, timeout: float = 20.0) -> re.Match[bytes]:
        """The first match of ``pattern`` in what the process wrote to ``stream``."""
        deadline = time.monotonic() + timeout
        with selectors.DefaultSelector() as selector:
            for name in self.output:
                selector.register(getattr(self.process, name), selectors.EVENT_READ, name)
            while not (found := re.search(pattern.encode(), self.output[stream])):
                left = deadline - time.monotonic()
                assert left > 0, f"no {pattern!r} in {self.output}"
                for key, _ in selector.select(left):
                    self.output[key.data] += os.read(key.fd, 65536)
                assert self.process.poll() is None, f"exited early: {self.output}"
        return found

    def stop(self) -> int:
        self.process.send_signal(signal.SIGTERM)
        try:
            code = self.process.wait(timeout=20)
        finally:
            if self.process.poll() is None:
                self.process.kill()
                self.process.wait()
        assert self.process.stdout is not None and self.process.stderr is not None
        self.process.stdout.close()
        self.process.stderr.close()
        return code


def get(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=10) as response:  # nosec B310
        body: bytes = response.read()
        return body


@pytest.mark.parametrize(("host", "shown"), [("127.0.0.1", "127.0.0.1"), ("::1", "[::1]")])
def test_port_0_serves_and_logs_the_port_it_got(host: str, shown: str) -> None:
    if host == "::1":
        listening(socket.AF_INET6, host).close()  # skips without IPv6
    router = Running([*ENGINES, "--host", host, "--port", "0", "--health-interval", "0"])
    try:
        port = int(router.wait_for("stderr", rf"listening on http://{re.escape(shown)}:(\d+)")[1])
        assert port != 0
        assert b"pd_router_queue_depth" in get(f"http://{shown}:{port}/metrics")
    finally:
        assert router.stop() == 0


def test_the_demo_takes_a_config_file_and_the_environment(tmp_path: Path) -> None:
    """File over the demo's defaults, environment over the file; port 0 is in the banner."""
    path = tmp_path / "demo.toml"
    path.write_text("port = 0\ndecode_nodes = 1\ndecode_slots = 2\nttft = 0\nitl = 0\n")
    mark = f"pd-router-test-cli-{uuid.uuid4().hex}"
    env = {"PD_ROUTER_DECODE_SLOTS": "3", "CLI_TEST_MARK": mark}
    demo = Running(["demo", "--config", str(path)], env)
    try:
        url = demo.wait_for("stdout", r"try: curl (http://127\.0\.0\.1:(\d+))/v1/completions")
        assert int(url[2]) != 0
        metrics = get(url[1].decode() + "/metrics").decode()
        decode = re.findall(r'pd_router_node_slots\{[^}]*role="decode"[^}]*\} (\S+)', metrics)
        assert decode == ["3.0"]  # one decode node (the file), three slots (the environment)
        request = urllib.request.Request(
            url[1].decode() + "/v1/completions",
            data=b'{"model": "sim-model", "prompt": "hello cli", "max_tokens": 2}',
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=10) as response:  # nosec B310
            assert b"hello cli" in response.read()
        # A chat's second turn finds its first turn's blocks in a prefill engine's cache.
        opening = [{"role": "system", "content": "word " * 40}, {"role": "user", "content": "hi"}]
        cached = []
        for messages in (opening, [*opening, {"role": "assistant", "content": "hi hi"}]):
            request = urllib.request.Request(
                url[1].decode() + "/v1/chat/completions",
                data=json.dumps({"model": "sim-model", "messages": messages}).encode(),
                headers={"Content-Type": "application/json"},
            )
            with urllib.request.urlopen(request, timeout=10) as response:  # nosec B310
                usage = json.loads(response.read())["usage"]
            cached.append(usage["prompt_tokens_details"]["cached_tokens"])
        assert cached == [0, 32], "two prefill engines: the prefix policy found the cache"
    finally:
        assert demo.stop() == 0
    assert marked(mark) == [], "simulated engines left running"


def test_the_demos_defaults_are_under_every_source(tmp_path: Path) -> None:
    defaults = parse([], {})[1]
    assert (defaults.decode_slots, defaults.queue_timeout, defaults.decode_nodes) == (4, 10.0, 2)
    assert (defaults.ttft, defaults.itl, defaults.port) == (0.05, 0.02, 8000)
    path = tmp_path / "demo.toml"
    path.write_text("decode_slots = 2\nqueue_timeout = 0\n")
    config = ["--config", str(path)]
    assert parse(config, {})[1].decode_slots == 2
    assert parse(config, {"PD_ROUTER_DECODE_SLOTS": "3"})[1].decode_slots == 3
    args = parse([*config, "--decode-slots", "5"], {"PD_ROUTER_DECODE_SLOTS": "3"})[1]
    assert (args.decode_slots, args.queue_timeout) == (5, 0.0)


def test_the_demos_models_from_every_source(tmp_path: Path) -> None:
    assert parse([], {})[1].models == ["sim-model"]
    path = tmp_path / "demo.toml"
    path.write_text('models = "alpha"\n')  # one model alone, as an array of one
    config = ["--config", str(path)]
    assert parse(config, {})[1].models == ["alpha"]
    assert parse(config, {"PD_ROUTER_MODELS": " beta\tgamma "})[1].models == ["beta", "gamma"]
    environment = {"PD_ROUTER_MODELS": "beta gamma"}
    assert parse([*config, "--models", "x", "--models", "y"], environment)[1].models == ["x", "y"]


def admin_nodes(url: str, token: str) -> list[dict[str, object]]:
    request = urllib.request.Request(
        url + "/admin/nodes", headers={"Authorization": f"Bearer {token}"}
    )
    with urllib.request.urlopen(request, timeout=10) as response:  # nosec B310
        nodes: list[dict[str, object]] = json.loads(response.read())["nodes"]
        return nodes


def wait_models_read(url: str, token: str, count: int) -> None:
    """Until the router has read what each of its ``count`` nodes serves (until then a
    node is taken to serve every model)."""

    def read() -> bool:
        nodes = admin_nodes(url, token)
        return len(nodes) == count and all(node["models"] is not None for node in nodes)

    wait_for(read, timeout=30, what="every node's models read")


@pytest.mark.parametrize("dialect", ["vllm", "sglang"])
def test_the_demo_serves_each_model_on_its_own_engines_and_names_the_prefill(
    dialect: str,
) -> None:
    """Its engines speak the router's dialect (before, --dialect sglang started vLLM
    engines, and every request failed)."""
    mark = f"pd-router-test-cli-{uuid.uuid4().hex}"
    argv = ["demo", "--port", "0", "--models", "alpha", "beta", "--admin-token", "t"]
    argv += ["--dialect", dialect]
    argv += ["--prefill-nodes", "1", "--decode-nodes", "1", "--ttft", "0", "--itl", "0"]
    demo = Running(argv, {"CLI_TEST_MARK": mark})
    try:
        banner = demo.wait_for(
            "stdout",
            r"alpha: prefill http://(\S+), decode http://\S+; beta: prefill http://(\S+), "
            r"decode http://\S+; try: curl (http://127\.0\.0\.1:\d+)/v1/completions",
        )
        prefill = {"alpha": banner[1].decode(), "beta": banner[2].decode()}
        url = banner[3].decode()
        wait_models_read(url, "t", 4)
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        for model in ("alpha", "beta", "alpha"):
            answer = client.completions.create(model=model, prompt="hello demo", max_tokens=3)
            assert answer.model == model
            assert answer.choices[0].text == f"[prefill {prefill[model]}] hello demo hello"
            stream = client.chat.completions.create(
                model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=2, stream=True
            )
            text = streamed_text(stream)
            assert text == f"[prefill {prefill[model]}] user: hi"
        with pytest.raises(openai.NotFoundError) as caught:
            client.completions.create(model="gamma", prompt="hello", max_tokens=1)
        assert "served: alpha, beta" in caught.value.message
    finally:
        assert demo.stop() == 0
    assert marked(mark) == [], "simulated engines left running"


def test_a_demo_killed_with_sigkill_leaves_no_engine_running() -> None:
    """Its `with` never ends then: the kernel stops its simulated engines (SIGTERM)."""
    mark = f"pd-router-test-cli-{uuid.uuid4().hex}"
    argv = ["demo", "--port", "0", "--prefill-nodes", "1", "--decode-nodes", "1"]
    demo = Running(argv, {"CLI_TEST_MARK": mark})
    try:
        demo.wait_for("stdout", r"try: curl")
        engines = [pid for pid in marked(mark) if pid != demo.process.pid]
        assert len(engines) == 2, engines
    finally:
        demo.process.kill()
        demo.process.wait()
        assert demo.process.stdout is not None and demo.process.stderr is not None
        demo.process.stdout.close()
        demo.process.stderr.close()
    try:
        wait_for(lambda: marked(mark) == [], timeout=20, what="the demo's engines gone with it")
    finally:
        for pid in marked(mark):  # only when the test failed: not left for the next one
            os.kill(pid, signal.SIGKILL)


def readme_recipe() -> list[str]:
    """The commands of README's 'Simulated engines by hand', one a line."""
    text = README.read_text()
    block = text.split("<!-- sim-recipe:", 1)[1].split("```sh\n", 1)[1].split("```", 1)[0]
    return block.strip().splitlines()


def test_the_readmes_two_model_recipe_works(tmp_path: Path) -> None:
    """Its commands, run as written except for free ports instead of 8000-8201, and an admin
    token (added) to see when the router has read each engine's model."""
    commands = readme_recipe()
    ports = {
        port: str(free_port())
        for port in sorted(set(re.findall(r"\b8[0-2]0[01]\b", "\n".join(commands))))
    }
    assert len(commands) == 5 and len(ports) == 5
    processes: list[subprocess.Popen[bytes]] = []
    try:
        for index, command in enumerate(commands):
            argv = re.sub(r"\b8[0-2]0[01]\b", lambda found: ports[found[0]], command).split()
            program = {"python": [sys.executable], "pd-router": [sys.executable, "-m", "pd_router"]}
            argv = [*program[argv[0]], *argv[1:]]
            if "pd_router.sim" not in argv:
                argv += ["--admin-token", "t"]
            with open(tmp_path / f"{index}.log", "wb") as log:
                processes.append(
                    subprocess.Popen(  # nosec B603
                        argv, stdout=log, stderr=subprocess.STDOUT, env=environment()
                    )
                )
        url = f"http://127.0.0.1:{ports['8000']}"

        def up() -> bool:
            assert all(process.poll() is None for process in processes), [
                (tmp_path / f"{index}.log").read_text() for index in range(len(processes))
            ]
            try:
                return get(url + "/health") is not None
            except OSError:
                return False

        wait_for(up, timeout=60, what="the recipe's router healthy")
        wait_models_read(url, "t", 4)
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        for model in ("alpha", "beta"):
            answer = client.completions.create(model=model, prompt=f"hello {model}", max_tokens=4)
            assert (answer.model, answer.choices[0].text) == (
                model,
                f" hello {model} hello {model}",
            )
    finally:
        for process in processes:
            process.terminate()
        for process in processes:
            try:
                process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_every_sim_option_says_what_it_does_and_its_default(role: str) -> None:
    done = subprocess.run(  # nosec B603
        [sys.executable, "-m", "pd_router.sim", role, "--help"],
        capture_output=True,
        text=True,
        timeout=30,
        env=environment({"COLUMNS": "100"}),
    )
    assert done.returncode == 0, done.stderr
    entries: dict[str, str] = {}
    for block in re.split(r"\n(?=  -)", done.stdout.split("options:\n", 1)[1]):
        invocation, _, text = block.strip().partition("  ")
        entries[invocation.strip()] = " ".join(text.split())
    assert entries["--port PORT"] == "port to listen on (required)"
    assert entries["--model NAME"].endswith("(default: sim-model)")
    undocumented = [
        invocation
        for invocation, text in entries.items()
        if invocation not in ("-h, --help", "--port PORT") and "(default: " not in text
    ]
    assert len(entries) >= 9 and undocumented == []


def test_the_demo_refuses_engines_from_its_config_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "demo.toml"
    path.write_text('decode = ["http://127.0.0.1:9"]\n')
    with pytest.raises(SystemExit) as exit_info:
        parse(["--config", str(path)], {})
    assert exit_info.value.code == 2
    assert "the demo starts its own engines" in capsys.readouterr().err


def help_entries(*argv: str) -> dict[str, str]:
    """``--help``, as each option's invocation (flag and metavar) -> its help text."""
    done = run(*argv, "--help", env={"COLUMNS": "100"})
    assert done.returncode == 0, done.stderr
    entries: dict[str, str] = {}
    options = done.stdout.split("options:\n", 1)[1]
    for block in re.split(r"\n(?=  -)", options):
        invocation, _, text = block.strip().partition("  ")
        entries[invocation.strip()] = " ".join(text.split())
    return entries


def test_help_shows_each_default_and_unit() -> None:
    entries = help_entries()
    assert entries["--queue-timeout SECONDS"].endswith("(default: 0)")
    assert entries["--port PORT"].endswith("(default: 8000)")
    assert entries["--read-timeout SECONDS"].endswith("(default: 600)")
    assert entries["--max-body-bytes BYTES"].endswith("(default: 33554432)")
    assert entries["--access-log, --no-access-log"].endswith("(default: off)")
    unset = {"-h, --help", "--version", "--admin-token TOKEN", "--config FILE", "--state URL"}
    unset |= {"--dns-server HOST:PORT", "--otlp-traces-endpoint URL"}
    unset |= {"--api-keys-file FILE", "--engine-api-key KEY"}
    unset |= {"--ssl-certfile FILE", "--ssl-keyfile FILE", "--engine-ca FILE"}
    unset |= {"--engine-cert FILE", "--engine-key FILE"}
    missing = [
        invocation
        for invocation, text in entries.items()
        if "(default: " not in text
        and invocation not in unset
        and not invocation.startswith(("--prefill", "--decode ", "--decode-dns "))
    ]
    assert missing == []


def test_demo_help_shows_the_demos_own_defaults() -> None:
    entries = help_entries("demo")
    assert entries["--decode-slots N"].endswith("(default: 4)")
    assert entries["--queue-timeout SECONDS"].endswith("(default: 10)")
    assert entries["--decode-nodes N"].endswith("(default: 2)")
    assert entries["--ttft SECONDS"].endswith("(default: 0.05)")
    assert entries["--itl SECONDS"].endswith("(default: 0.02)")
    assert not any(invocation.startswith("--prefill ") for invocation in entries)
    assert entries["--prefill-policy {prefix,cost,least_loaded,round_robin}"].endswith(
        "(default: prefix)"
    )


def test_status_shows_a_prefill_nodes_slots_from_either_source() -> None:
    labels = 'node="0",url="http://p0:8100",role="prefill"'
    metrics = f"""
# TYPE pd_router_queue_depth gauge
pd_router_queue_depth 0.0
# TYPE pd_router_node_slots gauge
pd_router_node_slots{{{labels}}} 1.0
# TYPE pd_router_node_slots_in_use gauge
pd_router_node_slots_in_use{{{labels}}} 0.0
"""
    node = {
        "id": 0,
        "url": "http://p0:8100",
        "role": "prefill",
        "state": "serving",
        "slots": 1,
        "in_use": 0,
        "bound_requests": [],
        "consecutive_failures": 0,
    }
    admin = {"nodes": [node], "queue_depth": 0, "in_flight": 0}
    for snapshot in (from_metrics(metrics), from_admin(admin)):
        row = format_table(snapshot, "http://r").splitlines()[-1].split()
        assert (row[1], row[3]) == ("prefill", "0/1")


def test_the_readmes_table_documents_every_flag_with_the_default_help_shows() -> None:
    """README's table of flags is the operator's reference: a default changed in the code
    and not there (or the other way round), or a flag it leaves out, is caught here."""
    lines = README.read_text(encoding="utf-8").splitlines()
    start = lines.index("| flag | default | meaning |")
    documented: dict[str, str] = {}
    for line in lines[start + 2 :]:
        if not line.startswith("| `-"):
            break
        flag, default = (cell.strip() for cell in re.split(r"(?<!\\)\|", line)[1:3])
        documented[flag.strip("`").split()[0].rstrip("`")] = default
    shown: dict[str, str | None] = {}
    for invocation, text in help_entries().items():
        default = re.search(r"\(default: ([^()]*)\)$", text)
        shown[invocation.split()[0].rstrip(",")] = default[1] if default else None
    del shown["-h"], shown["--version"]
    assert sorted(shown) == sorted(documented)
    for flag, default in shown.items():
        if flag == "--config":
            assert documented[flag] == "`PD_ROUTER_CONFIG`, else unset"
        elif default is None:
            assert documented[flag].startswith(("unset", "required, unless")), flag
        else:
            assert documented[flag] == default, flag

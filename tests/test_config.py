"""Settings from the command line, ``PD_ROUTER_*`` variables and a TOML file: precedence,
node lists with slots and labels, and refusals that name the key. No server needed, except
for the one check of the installed ``pd-router`` command."""

from __future__ import annotations

import argparse
import shutil
import subprocess  # nosec B404
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

import pytest

from pd_router.config import options_of
from pd_router.fleet.nodes import NodeSpec
from pd_router.serve import build_router, parse_router_args, router_parser

NODES = ["--prefill", "http://p0:8100", "--decode", "http://d0:8200"]


def parse(
    argv: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
    toml: str | None = None,
    tmp_path: Path | None = None,
) -> argparse.Namespace:
    """What ``pd-router ARGV`` would run with, given this environment and config file."""
    argv = list(argv)
    if toml is not None:
        assert tmp_path is not None
        path = tmp_path / "pd-router.toml"
        path.write_text(toml)
        argv += ["--config", str(path)]
    parser, actions = router_parser()
    return parse_router_args(parser, actions, argv, dict(env or {}))


def refusal(
    capsys: pytest.CaptureFixture[str],
    argv: Sequence[str],
    env: Mapping[str, str] | None = None,
    toml: str | None = None,
    tmp_path: Path | None = None,
) -> str:
    """The message of a start-up that is refused like an argparse error (exit 2)."""
    with pytest.raises(SystemExit) as exit_info:
        parse(argv, env, toml, tmp_path)
    assert exit_info.value.code == 2
    return capsys.readouterr().err


def test_defaults_without_file_or_environment() -> None:
    args = parse(NODES)
    assert (args.host, args.port, args.queue_timeout, args.decode_slots) == (
        "127.0.0.1",
        8000,
        0.0,
        1,
    )
    assert args.admin_token is None and args.access_log is False
    assert args.prefill == [NodeSpec("http://p0:8100")]


def test_precedence_cli_over_env_over_file_over_default(tmp_path: Path) -> None:
    toml = 'queue_timeout = 30\ndecode_slots = 4\nhost = "0.0.0.0"\nlog_level = "debug"\n'
    env = {"PD_ROUTER_QUEUE_TIMEOUT": "20", "PD_ROUTER_DECODE_SLOTS": "6"}
    args = parse([*NODES, "--queue-timeout", "10"], env, toml, tmp_path)
    assert args.queue_timeout == 10.0  # command line
    assert args.decode_slots == 6  # environment
    assert args.host == "0.0.0.0" and args.log_level == "debug"  # file
    assert args.port == 8000 and args.health_interval == 1.0  # defaults
    # Take away the higher source and the next one shows through.
    assert parse(NODES, env, toml, tmp_path).queue_timeout == 20.0
    assert parse(NODES, {}, toml, tmp_path).queue_timeout == 30.0


def test_switches_and_strings_from_each_source(tmp_path: Path) -> None:
    env = {"PD_ROUTER_ACCESS_LOG": "yes", "PD_ROUTER_ADMIN_TOKEN": "from-env"}
    args = parse(NODES, env)
    assert args.access_log is True and args.admin_token == "from-env"
    assert parse([*NODES, "--no-access-log"], env).access_log is False
    args = parse(NODES, {}, 'access_log = true\nadmin_token = "from-file"\n', tmp_path)
    assert args.access_log is True and args.admin_token == "from-file"
    # An empty variable is unset, not an empty token.
    assert parse(NODES, {"PD_ROUTER_ADMIN_TOKEN": ""}).admin_token is None
    # As a template may render a boolean (Ansible's True): a switch's word in any case.
    assert parse(NODES, {"PD_ROUTER_ACCESS_LOG": "True"}).access_log is True
    assert parse(NODES, {"PD_ROUTER_ACCESS_LOG": "OFF"}).access_log is False


def test_nodes_from_file_with_slots_and_labels(tmp_path: Path) -> None:
    toml = """
queue_timeout = 30
decode_slots = 4

[[prefill]]
url = "http://p0:8100"
labels = { zone = "a" }

[[decode]]
url = "http://d0:8200/"
slots = 8
labels = { zone = "a", gpu = "h100" }

[[decode]]
url = "http://d1:8200"
"""
    args = parse([], {}, toml, tmp_path)
    nodes = build_router(args).fleet.nodes
    view = [(n.id, n.role, n.url, n.slots, n.labels) for n in nodes]
    assert view == [
        (0, "prefill", "http://p0:8100", 1, {"zone": "a"}),
        (1, "decode", "http://d0:8200", 8, {"zone": "a", "gpu": "h100"}),
        (2, "decode", "http://d1:8200", 4, {}),
    ]


def test_nodes_as_plain_strings_in_file_and_environment(tmp_path: Path) -> None:
    toml = 'prefill = ["http://p0:8100"]\ndecode = ["http://d0:8200,slots=8", "http://d1:8200"]\n'
    args = parse([], {}, toml, tmp_path)
    assert args.decode == [NodeSpec("http://d0:8200", 8), NodeSpec("http://d1:8200")]
    # Whitespace (spaces, tabs, newlines) separates nodes; a comma is a node's own option.
    env = {
        "PD_ROUTER_DECODE": " http://e0:8200,slots=2\n\thttp://e1:8200 ",
        "PD_ROUTER_DECODE_SLOTS": "3",
    }
    args = parse([], env, toml, tmp_path)
    assert [(n.url, n.slots) for n in build_router(args).fleet.pool.nodes] == [
        ("http://e0:8200", 2),
        ("http://e1:8200", 3),
    ]
    assert args.prefill == [NodeSpec("http://p0:8100")]  # from the file still


def test_a_toml_value_has_the_settings_type_and_a_list_takes_one_item_alone(
    tmp_path: Path,
) -> None:
    """The README's rule: numbers as numbers, strings as strings, a list as an array or as
    its one item; the environment, all text, says the same in its own spelling."""
    toml = """
prefill = "http://p0:8100"
decode = { url = "http://d0:8200", slots = 2 }
decode_dns = "d.ns:8200"
queue_timeout = 5
max_body_bytes = 1024
"""
    env = {
        "PD_ROUTER_PREFILL": "http://p0:8100",
        "PD_ROUTER_DECODE": "http://d0:8200,slots=2",
        "PD_ROUTER_DECODE_DNS": "d.ns:8200",
        "PD_ROUTER_QUEUE_TIMEOUT": "5",
        "PD_ROUTER_MAX_BODY_BYTES": "1024",
    }
    from_file, from_env = parse([], {}, toml, tmp_path), parse([], env)
    assert from_file.prefill == [NodeSpec("http://p0:8100")]
    assert from_file.decode == [NodeSpec("http://d0:8200", 2)]
    assert (from_file.queue_timeout, from_file.max_body_bytes) == (5.0, 1024)
    assert vars(from_file) == {**vars(from_env), "config": vars(from_file)["config"]}


def test_a_higher_source_replaces_a_node_list(tmp_path: Path) -> None:
    toml = 'prefill = ["http://p0:8100", "http://p1:8100"]\ndecode = ["http://d0:8200"]\n'
    args = parse(["--prefill", "http://cli:8100"], {}, toml, tmp_path)
    assert args.prefill == [NodeSpec("http://cli:8100")]


def test_config_file_named_by_environment(tmp_path: Path) -> None:
    path = tmp_path / "router.toml"
    path.write_text("queue_timeout = 7\n")
    assert parse(NODES, {"PD_ROUTER_CONFIG": str(path)}).queue_timeout == 7.0


@pytest.mark.parametrize(
    ("toml", "expected"),
    [
        ("queue_timout = 3\n", "unknown key 'queue_timout' (did you mean queue_timeout?)"),
        ("queue-timeout = 3\n", "unknown key 'queue-timeout' (did you mean queue_timeout?)"),
        ('config = "other.toml"\n', "unknown key 'config'"),
        ("[[decode]]\nurl = 'http://d0:8200'\nweight = 2\n", "decode[0]: unknown key 'weight'"),
    ],
)
def test_unknown_key_in_file_is_refused(
    toml: str, expected: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    message = refusal(capsys, NODES, {}, toml, tmp_path)
    assert "pd-router.toml: " in message and expected in message


def test_unknown_environment_variable_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    message = refusal(capsys, NODES, {"PD_ROUTER_QUEUE_TIMOUT": "3", "HOME": "/root"})
    assert "unknown environment variable PD_ROUTER_QUEUE_TIMOUT" in message
    assert "did you mean PD_ROUTER_QUEUE_TIMEOUT?" in message


@pytest.mark.parametrize(
    ("toml", "expected"),
    [
        ("queue_timeout = -1\n", "queue_timeout: must be a number of seconds >= 0, got '-1'"),
        ("health_interval = inf\n", "health_interval: must be a number of seconds >= 0"),
        ("read_timeout = nan\n", "read_timeout: must be a number of seconds > 0"),
        ('queue_timeout = "soon"\n', 'queue_timeout: expected a number, got "soon"'),
        ('queue_timeout = "5"\n', 'queue_timeout: expected a number, got "5"'),
        ("decode_slots = 0\n", "decode_slots: must be a whole number >= 1 and <= 1000000, got '0'"),
        ("decode_slots = 1000001\n", "decode_slots: must be a whole number >= 1 and <= 1000000"),
        ("port = 80.5\n", "port: must be a whole number from 0 to 65535 (0: any free port)"),
        ("port = true\n", "port: expected a number, got true"),
        (
            "decode_slots = 4.0\n",
            "decode_slots: must be a whole number >= 1 and <= 1000000, got '4.0'",
        ),
        ("host = 1\n", "host: expected a string, got 1"),
        ('host = ""\n', "host: must be an address or name to listen on"),
        ('log_level = "loud"\n', "log_level: expected one of debug, info, warning, error"),
        # A token is never repeated, even one written as a number.
        ("admin_token = 1234\n", "admin_token: expected a string, got a number"),
        ("engine_api_key = 84512369\n", "engine_api_key: expected a string, got a number"),
        ('access_log = "yes"\n', 'access_log: expected true or false, got "yes"'),
        (
            "decode = []\n",
            "decode: expected a URL or a table ({ url = ..., slots = N, labels = { ... } }), "
            "or a non-empty array of them, got an empty array",
        ),
        ("decode = 8200\n", "decode: expected a URL or a table"),
        ('decode = ["d0:8200"]\n', "decode[0]: 'd0:8200': expected an http(s)://host:port URL"),
        ("[[decode]]\nurl = 'http://d0:8200'\nslots = 0\n", "decode[0].slots: expected a whole"),
        (
            "[[decode]]\nurl = 'http://d0:8200'\nslots = true\n",
            "decode[0].slots: expected a whole number from 1 to 1000000, got True",
        ),
        ("[[decode]]\nurl = 'http://d0:8200,slots=2'\n", "decode[0].url: "),
        ("[[decode]]\nslots = 2\n", "decode[0].url: expected a URL string"),
        ("[[prefill]]\nurl = 'http://p:1'\nlabels = { n = 3 }\n", "prefill[0].labels: label 'n'"),
        ("[[prefill]]\nurl = 'http://p:1'\nlabels = { 'a b' = 'x' }\n", "prefill[0].labels: "),
        # Read as a port by SGLang's dialect at every request: refused at start, not then.
        (
            "[[prefill]]\nurl = 'http://p:1'\nlabels = { bootstrap_port = 'x' }\n",
            "prefill[0].labels: 'bootstrap_port': bootstrap_port must be a port number, got 'x'",
        ),
    ],
)
def test_bad_value_in_file_is_refused_naming_the_key(
    toml: str, expected: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    message = refusal(capsys, NODES, {}, toml, tmp_path)
    assert expected in message
    assert "1234" not in message and "84512369" not in message


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({"PD_ROUTER_PORT": "http"}, "PD_ROUTER_PORT: must be a whole number from 0 to 65535"),
        ({"PD_ROUTER_HEALTH_INTERVAL": "-2"}, "PD_ROUTER_HEALTH_INTERVAL: must be a number"),
        ({"PD_ROUTER_HEALTH_INTERVAL": "inf"}, "PD_ROUTER_HEALTH_INTERVAL: must be a number"),
        ({"PD_ROUTER_ACCESS_LOG": "maybe"}, "PD_ROUTER_ACCESS_LOG: expected one of 1, true"),
        ({"PD_ROUTER_LOG_FORMAT": "xml"}, "PD_ROUTER_LOG_FORMAT: expected one of text, json"),
        ({"PD_ROUTER_DECODE": "http://d0:8200,slots=x"}, "PD_ROUTER_DECODE: 'http://d0:8200,"),
        (
            {"PD_ROUTER_PREFILL": "http://p0:8100,http://p1:8100"},
            "PD_ROUTER_PREFILL: 'http://p0:8100,http://p1:8100': separate nodes with spaces",
        ),
    ],
)
def test_bad_value_in_environment_is_refused_naming_the_variable(
    env: dict[str, str], expected: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert expected in refusal(capsys, NODES, env)


def test_unreadable_file_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "nowhere.toml"
    assert "nowhere.toml: No such file" in refusal(capsys, [*NODES, "--config", str(missing)])
    assert "not valid TOML" in refusal(capsys, NODES, {}, "queue_timeout = = 3\n", tmp_path)
    latin = tmp_path / "latin.toml"
    latin.write_bytes(b"queue_timeout = 5\n\xff\xfe = 1\n")
    assert "latin.toml: not UTF-8 (byte 18)" in refusal(capsys, [*NODES, "--config", str(latin)])


@pytest.mark.parametrize(
    ("argv", "env", "toml"),
    [
        (["--admin-token", "s3cr3t "], {}, None),
        (["--admin-token", "s3cr3t\udcff"], {}, None),  # a byte of argv that is not UTF-8
        ([], {}, 'admin_token = " s3cr3t"\n'),
        ([], {}, 'admin_token = "s3cr3t\\n"\n'),
        ([], {"PD_ROUTER_ADMIN_TOKEN": "s3cr\x01t"}, None),
    ],
)
def test_an_admin_token_no_client_could_send_is_refused_unrepeated(
    argv: list[str],
    env: dict[str, str],
    toml: str | None,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Before, one with a space at an end started a router whose admin API refused every
    call (the token a client sends is stripped); one not UTF-8 crashed it at start."""
    message = refusal(capsys, [*NODES, *argv], env, toml, tmp_path)
    assert "admin_token" in message.lower().replace("-", "_") and "s3cr" not in message
    assert parse([*NODES, "--admin-token", "tök €"]).admin_token == "tök €"


def test_missing_nodes_name_every_spelling(capsys: pytest.CaptureFixture[str]) -> None:
    message = refusal(capsys, ["--prefill", "http://p0:8100"])
    assert "--decode (or PD_ROUTER_DECODE, or decode in the config file)" in message
    assert "--prefill" not in message.split("required:")[1]


def _console_script() -> str:
    """The installed ``pd-router`` entry point of the environment running the tests."""
    beside = Path(sys.executable).with_name("pd-router")
    found = str(beside) if beside.exists() else shutil.which("pd-router")
    if found is None:
        pytest.skip("the pd-router console script is not installed")
    return found


def test_console_script_refuses_a_bad_config(tmp_path: Path) -> None:
    path = tmp_path / "bad.toml"
    path.write_text(
        'prefill = ["http://p0:8100"]\ndecode = ["http://d0:8200"]\nqueue_timeout = -5\n'
    )
    done = subprocess.run(  # nosec B603
        [_console_script(), "--config", str(path)], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 2
    assert "queue_timeout: must be a number of seconds >= 0, got '-5'" in done.stderr
    assert str(path) in done.stderr and done.stdout == ""


def test_console_script_refuses_an_unknown_environment_variable() -> None:
    env = {"PATH": "/usr/bin:/bin", "PD_ROUTER_DECODE_SLOT": "4"}
    done = subprocess.run(  # nosec B603
        [_console_script(), *NODES], capture_output=True, text=True, timeout=60, env=env
    )
    assert done.returncode == 2
    assert "PD_ROUTER_DECODE_SLOT" in done.stderr and "PD_ROUTER_DECODE_SLOTS" in done.stderr


def test_demo_still_parses_its_flags() -> None:
    done = subprocess.run(  # nosec B603
        [sys.executable, "-m", "pd_router", "demo", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0 and "--decode-nodes" in done.stdout


def test_kubernetes_service_links_are_not_settings() -> None:
    """A Service named pd-router makes Kubernetes inject these into every pod."""
    parser, actions = router_parser()
    environ = {
        "PD_ROUTER_SERVICE_HOST": "10.0.0.7",
        "PD_ROUTER_SERVICE_PORT": "8000",
        "PD_ROUTER_SERVICE_PORT_HTTP": "8000",
        "PD_ROUTER_PORT": "tcp://10.0.0.7:8000",
        "PD_ROUTER_PORT_8000_TCP": "tcp://10.0.0.7:8000",
        "PD_ROUTER_PORT_8000_TCP_ADDR": "10.0.0.7",
        "PD_ROUTER_QUEUE_TIMEOUT": "7",
        # A Service named pd-router-state, as examples/kubernetes/ has (before, the router
        # refused to start: "unknown environment variable PD_ROUTER_STATE_PORT").
        "PD_ROUTER_STATE_SERVICE_HOST": "10.0.0.8",
        "PD_ROUTER_STATE_SERVICE_PORT": "6379",
        "PD_ROUTER_STATE_SERVICE_PORT_REDIS": "6379",
        "PD_ROUTER_STATE_PORT": "tcp://10.0.0.8:6379",
        "PD_ROUTER_STATE_PORT_6379_TCP": "tcp://10.0.0.8:6379",
        "PD_ROUTER_STATE_PORT_6379_TCP_PROTO": "tcp",
        "PD_ROUTER_STATE_PORT_6379_TCP_PORT": "6379",
        "PD_ROUTER_STATE_PORT_6379_TCP_ADDR": "10.0.0.8",
    }
    args = parse_router_args(
        parser, actions, ["--prefill", "http://p:1", "--decode", "http://d:2"], environ
    )
    assert args.port == 8000 and args.queue_timeout == 7.0


# Names to discover nodes by (--prefill-dns, --decode-dns)

DNS = ["--prefill-dns", "prefill.ns:8100", "--decode-dns", "_http._tcp.decode.ns,slots=8,zone=a"]


def test_dns_names_alone_are_enough_and_make_a_discovery() -> None:
    args = parse([*DNS, "--dns-server", "10.96.0.10:5353", "--discovery-interval", "2"])
    assert args.prefill is None and args.decode is None
    assert [(s.role, s.name, s.port) for s in args.prefill_dns] == [("prefill", "prefill.ns", 8100)]
    (decode,) = args.decode_dns
    assert (decode.role, decode.port, decode.slots, dict(decode.labels)) == (
        "decode",
        None,
        8,
        {"zone": "a"},
    )
    router = build_router(args)
    assert router.fleet.nodes == []
    assert router.discovery is not None
    assert [g.spec for g in router.discovery.groups] == [*args.prefill_dns, decode]
    assert (router.discovery.interval, router.discovery.server) == (2.0, ("10.96.0.10", 5353))


def test_dns_names_beside_static_nodes_and_from_every_source(tmp_path: Path) -> None:
    args = parse(
        NODES,
        {"PD_ROUTER_DECODE_DNS": "d1.ns:8200,slots=2 d2.ns:8200"},
        'prefill_dns = ["p1.ns:8100"]\n'
        '[[decode_dns]]\nname = "d3.ns"\nport = 8200\nslots = 4\nlabels = { zone = "b" }\n',
        tmp_path,
    )
    assert [spec.url for spec in args.decode] == ["http://d0:8200"]
    assert [(s.name, s.slots) for s in args.decode_dns] == [("d1.ns", 2), ("d2.ns", None)]
    assert [s.name for s in args.prefill_dns] == ["p1.ns"]
    from_file = parse(
        NODES,
        {},
        '[[decode_dns]]\nname = "d3.ns"\nport = 8200\nlabels = { zone = "b" }\n',
        tmp_path,
    )
    (spec,) = from_file.decode_dns
    assert (spec.name, spec.port, dict(spec.labels)) == ("d3.ns", 8200, {"zone": "b"})


@pytest.mark.parametrize(
    ("argv", "env", "toml", "expected"),
    [
        (["--decode-dns", "d.ns"], {}, None, "--decode-dns: 'd.ns': the port is missing"),
        (
            [],
            {"PD_ROUTER_PREFILL_DNS": "p.ns:0"},
            None,
            "PD_ROUTER_PREFILL_DNS: 'p.ns:0': the port must be",
        ),
        (
            [],
            {},
            'decode_dns = [{ name = "d.ns" }]\n',
            "decode_dns[0]: 'd.ns': the port is missing",
        ),
        (
            [],
            {},
            'decode_dns = [{ name = "d.ns", port = 1, slot = 2 }]\n',
            "decode_dns[0]: unknown key 'slot'",
        ),
        ([], {}, "decode_dns = []\n", "decode_dns: expected NAME:PORT or a table"),
        (
            ["--dns-server", "dns.local:53"],
            {},
            None,
            "argument --dns-server: expected an IP address",
        ),
        # ASCII digits only, as every port (int() took each of these as 53).
        (["--dns-server", "10.0.0.1:+53"], {}, None, "argument --dns-server: expected an IP"),
        (["--dns-server", "10.0.0.1:5_3"], {}, None, "argument --dns-server: expected an IP"),
        (["--dns-server", "10.0.0.1:\u0665\u0663"], {}, None, "argument --dns-server: expected"),
    ],
)
def test_bad_dns_settings_are_refused_naming_the_setting(
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
    argv: list[str],
    env: dict[str, str],
    toml: str | None,
    expected: str,
) -> None:
    message = refusal(capsys, [*NODES, *argv], env, toml, tmp_path if toml else None)
    assert expected in message, message


def test_without_nodes_or_names_both_are_named(capsys: pytest.CaptureFixture[str]) -> None:
    message = refusal(capsys, ["--prefill-dns", "p.ns:8100"])
    assert (
        "--decode (or PD_ROUTER_DECODE, or decode in the config file) or --decode-dns "
        "(or PD_ROUTER_DECODE_DNS, or decode_dns in the config file)" in message
    )
    assert "--prefill" not in message.split("required:")[1]


@pytest.mark.parametrize(
    ("text", "server"),
    [
        ("127.0.0.1:5353", ("127.0.0.1", 5353)),
        ("10.0.0.10", ("10.0.0.10", 53)),
        ("[::1]:53", ("::1", 53)),
    ],
)
def test_dns_server_spellings(text: str, server: tuple[str, int]) -> None:
    assert parse([*NODES, "--dns-server", text]).dns_server == server


def test_prefill_policy_from_each_source(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert build_router(parse(NODES)).fleet.prefill.name == "prefix"
    file = 'prefill_policy = "round_robin"'
    assert parse(NODES, toml=file, tmp_path=tmp_path).prefill_policy == "round_robin"
    env = {"PD_ROUTER_PREFILL_POLICY": "least_loaded"}
    args = parse(NODES, env=env, toml=file, tmp_path=tmp_path)
    assert build_router(args).fleet.prefill.name == "least_loaded"
    error = refusal(capsys, NODES, env={"PD_ROUTER_PREFILL_POLICY": "random"})
    assert (
        "PD_ROUTER_PREFILL_POLICY: expected one of prefix, cost, least_loaded, round_robin" in error
    )


def test_the_config_flag_is_over_the_config_variable(tmp_path: Path) -> None:
    """``--config`` names the file even when ``PD_ROUTER_CONFIG`` names another: the command
    line wins here as for every other setting."""
    flagged, exported = tmp_path / "flag.toml", tmp_path / "env.toml"
    flagged.write_text("queue_timeout = 7\n")
    exported.write_text("queue_timeout = 9\n")
    env = {"PD_ROUTER_CONFIG": str(exported)}
    assert parse([*NODES, "--config", str(flagged)], env).queue_timeout == 7.0
    assert parse(NODES, env).queue_timeout == 9.0


# Numeric flags whose 0 means something (README: fail fast, no limit, off, any free port,
# always disaggregate) take it; those whose 0 could never work are refused at start.
ZERO_TAKEN = [
    "--port",
    "--queue-timeout",
    "--max-local-prefill",
    "--handoff-grace",
    "--header-timeout",
    "--body-timeout",
    "--send-timeout",
    "--idle-timeout",
    "--health-interval",
    "--stall-timeout",
    "--discovery-drain-timeout",
    "--shutdown-timeout",
]
ZERO_REFUSED = [
    "--decode-slots",
    "--connect-timeout",
    "--read-timeout",
    "--engine-cache-tokens",
    "--bootstrap-port",
    "--max-body-bytes",
    "--max-header-bytes",
    "--max-response-bytes",
    "--max-connections",
    "--health-timeout",
    "--unhealthy-after",
    "--healthy-after",
    "--workers",
    "--discovery-interval",
]


def test_each_numeric_flag_takes_0_where_it_means_something(
    capsys: pytest.CaptureFixture[str],
) -> None:
    numeric = {option.flag for option in options_of(router_parser()[1]).values() if option.number}
    assert numeric == {*ZERO_TAKEN, *ZERO_REFUSED}, "a new numeric flag: which list is it in?"
    for flag in ZERO_TAKEN:
        args = parse([*NODES, flag, "0"])
        assert getattr(args, flag[2:].replace("-", "_")) == 0, flag
    for flag in ZERO_REFUSED:
        message = refusal(capsys, [*NODES, flag, "0"])
        assert f"argument {flag}: must be" in message and "got '0'" in message, message

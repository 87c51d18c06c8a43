"""``pd-router status``: a real router (started from a TOML file with labels) in front of
simulated engines, asked through the command as a person would run it; and the table and
the parsing of its sources, without a server."""

from __future__ import annotations

import http.server
import os
import subprocess  # nosec B404
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from pd_router.sim.fleet import EngineProcess, ServerProcess, SimFleet, free_port
from pd_router.status import NodeRow, Snapshot, format_table, from_admin, from_metrics
from tests.helpers import RawClient, RouterProcess, flush_state, slots_in_use, wait_for
from tests.redis_server import RedisServer

# Not ASCII: the router reads a token as UTF-8 bytes, and status must send it so.
TOKEN = "status-test-tökén"


class ConfiguredRouter(RouterProcess):
    """The router with every setting from a config file: no --prefill/--decode flags."""

    def __init__(self, config: Path) -> None:
        ServerProcess.__init__(self, ["--config", str(config)])


@pytest.fixture(scope="module")
def fleet() -> Iterator[SimFleet]:
    with SimFleet(prefill=1, decode=2, decode_args=["--slots", "16"]) as fleet:
        yield fleet


@pytest.fixture(scope="module")
def router(fleet: SimFleet, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RouterProcess]:
    # A third decode node where nothing listens: the prober makes it dead.
    nowhere = f"http://127.0.0.1:{free_port()}"
    config = tmp_path_factory.mktemp("status") / "pd-router.toml"
    config.write_text(
        f"""
decode_slots = 4
health_interval = 0.1
unhealthy_after = 2
admin_token = "{TOKEN}"

[[prefill]]
url = "{fleet.prefill[0].url}"
labels = {{ zone = "a" }}

[[decode]]
url = "{fleet.decode[0].url}"
slots = 8
labels = {{ zone = "a", gpu = "h100" }}

[[decode]]
url = "{fleet.decode[1].url}"

[[decode]]
url = "{nowhere}"
""",
        encoding="utf-8",
    )
    with ConfiguredRouter(config) as router:
        wait_for(lambda: router.metrics().get(_state(3, nowhere, "dead")) == 1, what="node 3 dead")
        yield router


def _state(node: int, url: str, state: str) -> str:
    return f"pd_router_node_state{{node={node},role=decode,state={state},url={url}}}"


def status(*args: str, token: str | None = None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PD_ROUTER_")}
    if token is not None:
        env["PD_ROUTER_ADMIN_TOKEN"] = token
    return subprocess.run(  # nosec B603
        [sys.executable, "-m", "pd_router", "status", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )


# What a router with no node answers on /metrics.
EMPTY_METRICS = b"pd_router_queue_depth 0.0\npd_router_in_flight 0.0\n"


def status_of_stub(
    answers: dict[str, tuple[int, bytes]], *args: str, token: str | None = None
) -> tuple[subprocess.CompletedProcess[str], list[tuple[str, str | None]], str]:
    """``pd-router status`` against a stub router answering each GET path as ``answers``
    says (status, body): the command's result, what was asked (path, Authorization) and
    the stub's URL."""
    asked: list[tuple[str, str | None]] = []

    class Router(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            asked.append((self.path, self.headers.get("authorization")))
            code, body = answers[self.path]
            self.send_response(code)
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Router)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        return status("--url", url, *args, token=token), asked, url
    finally:
        server.shutdown()
        server.server_close()


def rows(output: str) -> dict[str, list[str]]:
    """Table rows (the lines starting with a node id) by node URL, split into columns."""
    table = [line.split() for line in output.splitlines() if line[:1].isdigit()]
    return {next(c for c in cells if c.startswith("http://")): cells for cells in table}


def test_status_from_metrics_lists_every_node(router: RouterProcess, fleet: SimFleet) -> None:
    done = status("--url", router.url)
    assert done.returncode == 0, done.stderr
    table = rows(done.stdout)
    prefill, d0, d1 = fleet.prefill[0].url, fleet.decode[0].url, fleet.decode[1].url
    assert table[prefill][:5] == ["0", "prefill", "serving", "0/1", "0"]
    assert table[d0][:5] == ["1", "decode", "serving", "0/8", "0"]
    assert table[d1][:5] == ["2", "decode", "serving", "0/4", "0"]
    dead = next(cells for url, cells in table.items() if url not in (prefill, d0, d1))
    assert dead[:4] == ["3", "decode", "dead", "0/4"] and int(dead[4]) >= 2
    # /metrics has no labels: no column for them.
    assert "LABELS" not in done.stdout and "zone=" not in done.stdout
    assert f"pd-router {router.url}: 3 of 4 nodes serving" in done.stdout
    assert "0 queued, 0 in flight" in done.stdout


def test_status_with_admin_token_shows_labels_and_requests(
    router: RouterProcess, fleet: SimFleet
) -> None:
    for engine in fleet.decode:
        engine.configure(itl=0.2)
    body = {"model": "sim-model", "prompt": "slow stream", "max_tokens": 50, "stream": True}
    client = RawClient(router.url, "/v1/completions", body)
    try:
        client.read_until(b"data: ")
        wait_for(lambda: router.in_use() == 1, what="one slot in use")
        done = status("--url", router.url, token=TOKEN)
    finally:
        client.hang_up()
        for engine in fleet.decode:
            engine.configure(itl=0)
    assert done.returncode == 0, done.stderr
    table = rows(done.stdout)
    assert table[fleet.prefill[0].url][-1] == "zone=a"
    assert table[fleet.decode[0].url][-1] == "gpu=h100,zone=a"
    busy = [cells for cells in table.values() if cells[3] == "1/8" or cells[3] == "1/4"]
    assert len(busy) == 1 and busy[0][5] == "1"  # its REQUESTS column
    assert "1 in flight" in done.stdout and "decode slots 1/16 in use" in done.stdout
    assert "node 3 dead (probe refused) last error: health check failed:" in done.stdout
    router.assert_idle()


def test_status_with_a_wrong_token_says_so(router: RouterProcess) -> None:
    done = status("--url", router.url, "--admin-token", "wrong")
    assert done.returncode == 1 and "admin token was refused" in done.stderr


def test_a_timeout_that_could_never_be_met_is_refused() -> None:
    for bad in ("0", "-1", "inf", "soon"):
        done = status("--url", "http://127.0.0.1:9", "--timeout", bad)
        assert done.returncode == 2, done
        assert done.stderr == (
            "pd-router status: error: argument --timeout: must be a number of seconds > 0, "
            f"got {bad!r}\n"
        )


def test_status_of_an_unreachable_router_fails_clearly() -> None:
    url = f"http://127.0.0.1:{free_port()}"
    done = status("--url", url)
    assert done.returncode == 1 and done.stdout == ""
    assert f"router at {url}: cannot reach it" in done.stderr


def test_nodes_added_through_the_admin_api_keep_their_labels(router: RouterProcess) -> None:
    auth = {"Authorization": f"Bearer {TOKEN}".encode()}
    nodes = f"{router.url}/admin/nodes"
    with EngineProcess("prefill") as engine:
        spec = {"url": engine.url, "role": "prefill", "labels": {"zone": "b"}}
        bad = httpx.post(nodes, json={**spec, "labels": {"zone": 1}}, headers=auth, timeout=10)
        assert bad.status_code == 400 and "label 'zone' must be a string" in bad.text
        added = httpx.post(nodes, json=spec, headers=auth, timeout=10)
        assert added.status_code == 201 and added.json()["labels"] == {"zone": "b"}
        node_id = added.json()["id"]
        try:
            done = status("--url", router.url, token=TOKEN)
            assert done.returncode == 0, done.stderr
            table = [line.split() for line in done.stdout.splitlines()]
            row = next(cells for cells in table if cells[:1] == [str(node_id)])
            assert row[1:3] == ["prefill", "serving"] and row[-1] == "zone=b"
        finally:
            httpx.post(f"{nodes}/{node_id}/drain", headers=auth, timeout=10)
            assert httpx.delete(f"{nodes}/{node_id}", headers=auth, timeout=10).status_code == 200


# Without a server


def test_format_table() -> None:
    snapshot = Snapshot(
        nodes=[
            NodeRow(0, "prefill", "http://p0:8100", "serving", 1, 0, 0, labels={"zone": "a"}),
            NodeRow(1, "decode", "http://d0:8200", "draining", 8, 3, 0, {"gpu": "h100"}, 3),
            NodeRow(2, "decode", "http://d1:8200", "dead", 4, 0, 5, {}, 0, "connection refused"),
            NodeRow(
                3,
                "decode",
                "http://d2:8200",
                "unhealthy",
                4,
                1,
                0,
                {},
                1,
                "stalled 42 s: ...",
                reason="stalled",
            ),
        ],
        queue_depth=2,
        in_flight=3,
        shutting_down=False,
    )
    assert format_table(snapshot, "http://r:8000") == (
        "pd-router http://r:8000: 1 of 4 nodes serving, decode slots 4/16 in use, "
        "2 queued, 3 in flight\n"
        "\n"
        "ID  ROLE     STATE      SLOTS  FAILURES  REQUESTS  URL             LABELS\n"
        "0   prefill  serving    0/1    0         -         http://p0:8100  zone=a\n"
        "1   decode   draining   3/8    0         3         http://d0:8200  gpu=h100\n"
        "2   decode   dead       0/4    5         0         http://d1:8200\n"
        "3   decode   unhealthy  1/4    0         1         http://d2:8200\n"
        "\n"
        "node 2 last error: connection refused\n"
        "node 3 unhealthy (stalled) last error: stalled 42 s: ...\n"
    )


def test_what_engines_and_the_admin_api_wrote_cannot_drive_the_terminal() -> None:
    """An engine's error text (its own message, passed on as ``last_error``) and labels set
    through the admin API reach the operator's terminal: escape sequences, carriage
    returns, line breaks and bidi overrides in them are shown escaped, so none can clear
    the screen, set the window's title or forge a line of the table."""
    lie = "boom\x1b[2J\x1b]2;pwned\x07\r\nnode 0 serving (fake) all good\u202e"
    row = NodeRow(0, "prefill", "http://p0:8100", "serving", 1, 0, 1, {"z\x1b[1m": "a"}, None, lie)
    table = format_table(Snapshot(nodes=[row]), "http://r")
    assert table.isprintable() is False  # its own line breaks
    assert all(line.isprintable() for line in table.splitlines())
    assert len(table.splitlines()) == 6
    assert table.splitlines()[-1] == (
        "node 0 last error: boom\\u001b[2J\\u001b]2;pwned\\u0007\\u000d\\u000a"
        "node 0 serving (fake) all good\\u202e"
    )


def test_a_router_not_ready_says_why_in_the_header() -> None:
    row = NodeRow(0, "decode", "http://d0:8200", "dead", 2, 0, 3)
    snapshot = Snapshot(nodes=[row], not_ready="no prefill node serving, no decode node serving")
    assert format_table(snapshot, "http://r").splitlines()[0] == (
        "pd-router http://r: 0 of 1 nodes serving, decode slots 0/2 in use, 0 queued, "
        "0 in flight, NOT READY: no prefill node serving, no decode node serving"
    )


@pytest.mark.parametrize(
    ("health", "says"),
    [
        (b"<html>gateway</html>", "HTTP 503"),
        (b"[]", "HTTP 503"),
        (b'{"status": "unavailable", "prefill_nodes": false, "decode_nodes": 1}', "HTTP 503"),
        (
            b'{"status": "unavailable", "prefill_nodes": 0, "decode_nodes": 2}',
            "no prefill node serving",
        ),
    ],
    ids=["page", "list", "false", "no-prefill"],
)
def test_a_503_health_of_any_shape_is_shown_not_failed_on(health: bytes, says: str) -> None:
    """Behind a proxy, /health's 503 may be the proxy's page: the nodes read from /metrics
    are shown all the same, the header saying the router is not ready."""
    done, _, _ = status_of_stub({"/metrics": (200, EMPTY_METRICS), "/health": (503, health)})
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[0].endswith(f"NOT READY: {says}")


def test_format_table_leaves_out_what_the_source_does_not_know() -> None:
    snapshot = Snapshot(nodes=[NodeRow(0, "decode", "http://d0:8200", "serving", 2, 1, 0)])
    assert format_table(snapshot, "http://r:8000").splitlines()[2:] == [
        "ID  ROLE    STATE    SLOTS  FAILURES  URL",
        "0   decode  serving  1/2    0         http://d0:8200",
    ]
    assert format_table(Snapshot(shutting_down=True), "http://r").endswith(
        "SHUTTING DOWN\n(no nodes)\n"
    )


def test_from_metrics() -> None:
    labels = 'node="1",url="http://d0:8200",role="decode"'
    text = f"""
# TYPE pd_router_queue_depth gauge
pd_router_queue_depth 2.0
# TYPE pd_router_in_flight gauge
pd_router_in_flight 5.0
# TYPE pd_router_node_slots gauge
pd_router_node_slots{{{labels}}} 8.0
# TYPE pd_router_node_slots_in_use gauge
pd_router_node_slots_in_use{{{labels}}} 5.0
# TYPE pd_router_node_state gauge
pd_router_node_state{{{labels},state="serving"}} 0.0
pd_router_node_state{{{labels},state="draining"}} 1.0
pd_router_node_state{{{labels},state="dead"}} 0.0
# TYPE pd_router_node_consecutive_failures gauge
pd_router_node_consecutive_failures{{{labels}}} 1.0
"""
    snapshot = from_metrics(text)
    assert (snapshot.queue_depth, snapshot.in_flight) == (2, 5)
    assert snapshot.nodes == [NodeRow(1, "decode", "http://d0:8200", "draining", 8, 5, 1)]


def test_from_metrics_of_workers_sums_their_counts() -> None:
    """With --workers every series comes once per worker: slots in use, queue and requests
    in flight are the workers' sums, a node is one row."""
    text = "# TYPE pd_router_queue_depth gauge\n"
    text += 'pd_router_queue_depth{worker="1"} 2.0\npd_router_queue_depth{worker="2"} 1.0\n'
    text += "# TYPE pd_router_in_flight gauge\n"
    text += 'pd_router_in_flight{worker="1"} 5.0\npd_router_in_flight{worker="2"} 3.0\n'
    for kind, value in (("slots", 8.0), ("slots_in_use", 4.0)):
        text += f"# TYPE pd_router_node_{kind} gauge\n"
        for worker in ("1", "2"):
            labels = f'node="1",url="http://d0:8200",role="decode",worker="{worker}"'
            text += f"pd_router_node_{kind}{{{labels}}} {value}\n"
    snapshot = from_metrics(text)
    assert (snapshot.queue_depth, snapshot.in_flight) == (3, 8)
    assert [(row.id, row.slots, row.in_use) for row in snapshot.nodes] == [(1, 8, 8)]


def test_the_source_of_discovered_nodes_from_either_source_and_in_the_table() -> None:
    labels = 'node="4",url="http://10.0.0.7:8200",role="decode"'
    text = f"""
# TYPE pd_router_queue_depth gauge
pd_router_queue_depth 0.0
# TYPE pd_router_node_state gauge
pd_router_node_state{{{labels},state="joining"}} 1.0
# TYPE pd_router_node_source gauge
pd_router_node_source{{{labels},source="dns:vllm-decode:8200"}} 1.0
"""
    (row,) = from_metrics(text).nodes
    assert (row.state, row.source) == ("joining", "dns:vllm-decode:8200")
    node = {
        "id": 4,
        "role": "decode",
        "url": "http://10.0.0.7:8200",
        "state": "joining",
        "slots": 8,
        "in_use": 0,
        "consecutive_failures": 0,
        "bound_requests": [],
        "source": "dns:vllm-decode:8200",
    }
    document = {"nodes": [node], "queue_depth": 0, "in_flight": 0}
    (admin,) = from_admin(document).nodes
    assert (admin.state, admin.source) == ("joining", "dns:vllm-decode:8200")
    static = NodeRow(0, "decode", "http://d0:8200", "serving", 2, 0, 0)
    assert format_table(Snapshot(nodes=[static, row]), "http://r").splitlines()[2:] == [
        "ID  ROLE    STATE    SLOTS  FAILURES  URL                   SOURCE",
        "0   decode  serving  0/2    0         http://d0:8200        static",
        "4   decode  joining  0/0    0         http://10.0.0.7:8200  dns:vllm-decode:8200",
    ]


def test_from_metrics_of_something_else_is_an_error() -> None:
    with pytest.raises(Exception, match="is this a pd-router"):
        from_metrics("# TYPE up gauge\nup 1.0\n")


def test_from_admin() -> None:
    node = {
        "id": 4,
        "url": "http://d0:8200",
        "role": "decode",
        "state": "serving",
        "slots": 8,
        "in_use": 2,
        "bound_requests": ["a", "b"],
        "consecutive_failures": 0,
        "last_error": None,
        "labels": {"zone": "b"},
        "models": ["alpha", "beta"],
    }
    document = {"nodes": [node], "queue_depth": 0, "in_flight": 2, "shutting_down": False}
    assert from_admin(document).nodes == [
        NodeRow(
            4, "decode", "http://d0:8200", "serving", 8, 2, 0, {"zone": "b"}, 2, None,
            models=["alpha", "beta"],
        )
    ]  # fmt: skip
    (unread,) = from_admin({**document, "nodes": [{**node, "models": None}]}).nodes
    assert unread.models == []


def test_with_a_shared_state_requests_are_every_routers() -> None:
    node = {
        "id": 1,
        "url": "http://d0:8200",
        "role": "decode",
        "state": "serving",
        "slots": 8,
        "in_use": 1,
        "bound_requests": ["a"],
        "consecutive_failures": 0,
        "in_flight_by_router": {"r1": 1, "r2": 4},
        "fleet_in_flight": 5,
    }
    document = {
        "nodes": [node],
        "queue_depth": 0,
        "in_flight": 1,
        "routers": {"r2": 4, "r1": 1, "r3": 0},
    }
    snapshot = from_admin(document)
    assert snapshot.nodes[0].requests == 5
    table = format_table(snapshot, "http://r:8000").splitlines()
    assert table[0].endswith("0 queued, 5 in flight on 3 routers")
    assert table[-3:] == [
        "router r1: 1 in flight",
        "router r2: 4 in flight",
        "router r3: 0 in flight",
    ]


def test_with_a_shared_state_slots_are_the_fleets_and_this_routers_share_is_said() -> None:
    """The header said 'decode slots 1/2 in use' while both were: only the asked router's."""
    shared = NodeRow(1, "decode", "http://d0:8200", "serving", 2, 1, 0, {}, 2, models=["m"])
    other = NodeRow(2, "decode", "http://d1:8200", "serving", 4, 0, 0, {}, 1, models=[])
    prefill = NodeRow(0, "prefill", "http://p0:8100", "serving", 1, 0, 0, {}, 1, models=["m"])
    many = [f"m{i}" for i in range(5)]
    wide = NodeRow(3, "decode", "http://d2:8200", "serving", 1, 0, 0, {}, 0, models=many)
    snapshot = Snapshot([prefill, shared, other, wide], routers={"r1": 2, "r2": 1})
    assert format_table(snapshot, "http://r").splitlines()[:7] == [
        "pd-router http://r: 4 of 4 nodes serving, decode slots 3/7 in use (1 by this router), "
        "0 queued, 3 in flight on 2 routers",
        "",
        "ID  ROLE     STATE    SLOTS  FAILURES  REQUESTS  URL             MODELS",
        "0   prefill  serving  0/1    0         1         http://p0:8100  m",
        "1   decode   serving  2/2    0         2         http://d0:8200  m",
        "2   decode   serving  1/4    0         1         http://d1:8200  ?",
        "3   decode   serving  0/1    0         0         http://d2:8200  m0,m1,m2,+2",
    ]


def test_status_of_routers_sharing_a_state_counts_every_routers_slots(
    fleet: SimFleet, redis_server: RedisServer
) -> None:
    prefill, decode = [fleet.prefill[0].url], [fleet.decode[1].url + ",slots=2"]
    args = ("--state", redis_server.url, "--admin-token", TOKEN, "--health-interval", "0.2")
    flush_state(redis_server.url)
    fleet.decode[1].configure(itl=0.2)
    body = {"model": "sim-model", "prompt": "slow stream", "max_tokens": 50, "stream": True}
    streams: list[RawClient] = []
    try:
        with (
            RouterProcess(prefill, decode, *args) as one,
            RouterProcess(prefill, decode, *args) as two,
        ):
            for router in (one, two):  # one stream through each
                streams.append(RawClient(router.url, "/v1/completions", body))
                streams[-1].read_until(b"data: ")
            wait_for(
                lambda: "decode slots 2/2 in use (1 by this router)"
                in status("--url", one.url, token=TOKEN).stdout,
                what="both routers' slots in the header",
            )
            done = status("--url", one.url, token=TOKEN)
            for stream in streams:
                stream.hang_up()
            wait_for(lambda: slots_in_use(redis_server.url) == 0, what="Redis's count")
    finally:
        fleet.decode[1].configure(itl=0)
    assert done.returncode == 0, done.stderr
    assert "2 in flight on 2 routers" in done.stdout
    header = done.stdout.splitlines()[2].split()
    row = rows(done.stdout)[fleet.decode[1].url]
    assert header[:6] == ["ID", "ROLE", "STATE", "SLOTS", "FAILURES", "REQUESTS"]
    assert header[-1] == "MODELS" and row[-1] == "sim-model"
    assert row[1:6] == ["decode", "serving", "2/2", "0", "2"]


def test_status_says_when_the_router_refuses_every_request(fleet: SimFleet) -> None:
    """Its Redis gone, a router with ``--state`` answers 503 to every request and to
    ``/health`` while its nodes look well: the header says so (before, "2 of 2 nodes
    serving", and nothing else)."""
    prefill, decode = [fleet.prefill[0].url], [fleet.decode[0].url]
    with RedisServer() as redis:
        args = ("--state", redis.url, "--admin-token", TOKEN)
        with RouterProcess(prefill, decode, *args) as router:
            assert "NOT READY" not in status("--url", router.url).stdout
            redis.kill()
            wait_for(
                lambda: httpx.get(f"{router.url}/health", timeout=10).status_code == 503,
                what="/health 503",
            )
            for token in (None, TOKEN):
                done = status("--url", router.url, token=token)
                assert done.returncode == 0, done.stderr
                header = done.stdout.splitlines()[0]
                assert header.endswith("NOT READY: shared state (--state) unavailable"), header
                assert "2 of 2 nodes serving" in header


def test_a_redirect_is_an_error_and_the_token_goes_nowhere_else() -> None:
    """A router URL that answers with a redirect (a proxy's, a misconfigured ingress'): the
    status command says so and fails; the admin token is never sent where the redirect
    points. Before, urllib followed it with the Authorization header, to any host."""
    heard: list[str | None] = []

    class Elsewhere(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            heard.append(self.headers.get("authorization"))
            self.send_response(200)
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    elsewhere = http.server.HTTPServer(("127.0.0.1", 0), Elsewhere)
    target = f"http://127.0.0.1:{elsewhere.server_port}/admin/nodes"

    class Redirecting(Elsewhere):
        def do_GET(self) -> None:
            self.send_response(302)
            self.send_header("location", target)
            self.end_headers()

    redirecting = http.server.HTTPServer(("127.0.0.1", 0), Redirecting)
    for server in (elsewhere, redirecting):
        threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{redirecting.server_port}"
        done = status("--url", url, "--admin-token", "s3cret")
        assert done.returncode == 1 and "302" in done.stderr, done.stderr
        assert heard == [] and "s3cret" not in done.stderr
    finally:
        for server in (elsewhere, redirecting):
            server.shutdown()
            server.server_close()


@pytest.mark.parametrize(
    "url",
    [
        "http://",
        "https:///metrics",
        "ftp://127.0.0.1:8000",
        "127.0.0.1",
        # What urllib would fail on later, with a traceback and exit code 1.
        "http://127.0.0.1:80x",
        "http://[::1",
        "http://a b:80",
    ],
)
def test_a_url_that_names_no_router_is_refused_in_one_line(url: str) -> None:
    done = status("--url", url)
    assert (done.returncode, done.stdout) == (2, "")
    assert done.stderr == (
        f"pd-router status: error: --url: expected http(s)://host:port, got {url!r}\n"
    )


def test_a_token_for_a_router_without_the_admin_api_falls_back_to_metrics() -> None:
    """``PD_ROUTER_ADMIN_TOKEN`` exported for another router: this one's /admin/nodes is 404
    (--admin-token unset), and the table comes from /metrics, with a note, not an error."""
    labels = 'node="0",url="http://d0:8200",role="decode"'
    answers = {
        "/admin/nodes": (404, b'{"error": {"code": "admin_disabled"}}'),
        "/metrics": (200, EMPTY_METRICS + f"pd_router_node_slots{{{labels}}} 2.0\n".encode()),
        "/health": (200, b'{"status": "ok"}'),
    }
    done, asked, _ = status_of_stub(answers, token="s3cret")
    assert done.returncode == 0, done.stderr
    assert done.stderr == (
        "pd-router status: the router has no admin API (--admin-token unset): showing /metrics\n"
    )
    assert rows(done.stdout)["http://d0:8200"][:4] == ["0", "decode", "?", "0/2"]
    # The token went to the admin API alone.
    assert ("/admin/nodes", "Bearer s3cret") in asked and ("/metrics", None) in asked


def test_a_health_that_fails_otherwise_than_503_is_an_error() -> None:
    """Only 503 is /health's "not ready": any other error status is no router's answer
    (a proxy's 500, a path that is not there), and status fails naming it."""
    answers = {"/metrics": (200, EMPTY_METRICS), "/health": (500, b'{"status": "unavailable"}')}
    done, _, url = status_of_stub(answers)
    assert (done.returncode, done.stdout) == (1, ""), done.stderr
    assert done.stderr.startswith(f"pd-router status: router at {url}: {url}/health answered 500")

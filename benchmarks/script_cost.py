"""Redis's own time per shared-pool script call, against the number of decode nodes.

With ``--state``, every request's reservation is one ``ACQUIRE`` script (carrying the
releases queued since the last one), and Redis runs one script at a time for every router
sharing it: the time a script holds Redis is what each request waits for at one client,
and what bounds the requests per second of all the routers together.

Starts a redis-server on 127.0.0.1 (``tests/redis_server.py``, no persistence), registers
one router whose nodes each have more slots than the run takes, then per node count calls
``ACQUIRE`` as a router at one client does: one request for a model every node serves,
carrying the release of the previous request's slot. Prints, per node count, Redis's time
per call (``INFO commandstats``: ``usec_per_call`` of ``EVALSHA``, Redis's own clock), the
commands a call runs inside Redis (the other commands' calls / the script's calls) and the
round trip this client saw (p50). It asserts nothing.

    python benchmarks/script_cost.py [--calls N] [--nodes 2 8 32 128]
"""

from __future__ import annotations

import argparse
import socket
import statistics
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from pd_router.shared import resp, scripts  # noqa: E402
from tests.redis_server import RedisServer  # noqa: E402

ROUTER = "bench-router"
MODEL = "m"


class Client:
    """One blocking connection, one command at a time: nothing of it runs inside Redis."""

    def __init__(self, port: int) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port))
        self.parser = resp.Parser()

    def call(self, *args: str) -> resp.Reply:
        self.sock.sendall(resp.encode(*args))
        while (reply := self.parser.next_reply()) is resp.NEED_DATA:
            self.parser.feed(self.sock.recv(65536))
        if isinstance(reply, resp.ReplyError):
            raise RuntimeError(f"{args[0]}: {reply}")
        return reply

    def stats(self) -> dict[str, tuple[int, float]]:
        """Per command: (calls, usec_per_call), since the last ``CONFIG RESETSTAT``."""
        text = self.call("INFO", "commandstats")
        assert isinstance(text, bytes)  # nosec B101: INFO answers a bulk string
        out: dict[str, tuple[int, float]] = {}
        for line in text.decode().splitlines():
            if line.startswith("cmdstat_"):
                name, _, fields = line[len("cmdstat_") :].partition(":")
                values = dict(item.split("=") for item in fields.split(","))
                out[name] = (int(values["calls"]), float(values["usec_per_call"]))
        return out


def node_list(urls: list[str]) -> list[str]:
    """The scripts' "list of nodes": each takes the waiters of MODEL."""
    out = [str(len(urls))]
    for url in urls:
        out += [url, "+", "1", MODEL]
    return out


def measure(client: Client, nodes: int, calls: int) -> dict[str, float]:
    urls = [f"http://10.0.{i // 250}.{i % 250}:8200" for i in range(nodes)]
    client.call("FLUSHALL")
    register = client.call("SCRIPT", "LOAD", scripts.REGISTER)
    acquire = client.call("SCRIPT", "LOAD", scripts.ACQUIRE)
    assert isinstance(register, bytes) and isinstance(acquire, bytes)  # nosec B101
    slots = [item for url in urls for item in (url, str(calls + 1))]
    client.call("EVALSHA", register.decode(), "0", ROUTER, "60000", "1", str(nodes), *slots, "0")
    offer = node_list(urls)
    client.call("CONFIG", "RESETSTAT")
    held: tuple[str, str] | None = None
    trips = []
    for resid in range(1, calls + 1):
        release = [*node_list([held[1]]), held[0]] if held else ["0"]
        args = [ROUTER, "1", str(resid), "0", MODEL, *offer, *release]
        started = time.perf_counter()
        reply = client.call("EVALSHA", acquire.decode(), "0", *args)
        trips.append(time.perf_counter() - started)
        assert isinstance(reply, list) and isinstance(reply[0], list)  # nosec B101
        answer = reply[0][0]
        assert isinstance(answer, list) and answer[0] == b"ok", answer  # nosec B101
        url = answer[1]
        assert isinstance(url, bytes)  # nosec B101
        held = (str(resid), url.decode())
    stats = client.stats()
    script_calls, usec = stats.pop("evalsha")
    stats.pop("config", None)
    inside = sum(count for count, _ in stats.values())
    return {
        "usec_per_call": usec,
        "commands_per_call": inside / script_calls,
        "round_trip_p50_us": 1e6 * statistics.median(trips),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=3000, help="ACQUIRE calls per node count")
    parser.add_argument("--nodes", type=int, nargs="+", default=[2, 8, 32, 128])
    args = parser.parse_args()
    with RedisServer() as server:
        client = Client(server.port)
        print(f"redis-server {server.port}, {args.calls} ACQUIRE calls per node count")
        print(f"{'nodes':>6} {'Redis us/call':>14} {'commands/call':>14} {'round trip p50 us':>18}")
        for nodes in args.nodes:
            row = measure(client, nodes, args.calls)
            print(
                f"{nodes:>6} {row['usec_per_call']:>14.1f} {row['commands_per_call']:>14.1f}"
                f" {row['round_trip_p50_us']:>18.1f}",
                flush=True,
            )


if __name__ == "__main__":
    main()

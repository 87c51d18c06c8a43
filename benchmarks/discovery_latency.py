"""How long from a DNS change to the first request on a new engine (issue 13).

    python benchmarks/discovery_latency.py                    # --discovery-interval 5
    python benchmarks/discovery_latency.py --interval 0.5 --rounds 10

Starts, on 127.0.0.1, the tests' DNS server (``tests/dns_server.py``), one simulated
prefill engine, two simulated decode engines and the router with nothing but
``--prefill-dns`` and ``--decode-dns`` (SRV, so that engines on one IP differ by port),
``--health-interval`` at its default. Four clients send short requests all along. Each
round waits a random part of an interval, adds the second decode engine to the SRV
records and times the change to the first request that engine receives (polled every
10 ms), then takes it out again and waits
until the router has removed it. Prints each round and min / median / max. The expected
value is about half an interval (where in its sleep the loop was) plus a probe and the next
request; the worst case about one interval. Every process is stopped by its PID.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

import httpx  # noqa: E402

from pd_router.sim.fleet import EngineProcess, ServerProcess  # noqa: E402
from tests.dns_server import DnsServer  # noqa: E402

SRV = "_http._tcp.decode.test"
TOKEN = "bench"


class Router(ServerProcess):
    name = "router"

    def command(self) -> list[str]:
        argv = [sys.executable, "-m", "pd_router", "--host", "127.0.0.1", "--port"]
        return [*argv, str(self.port), *self.extra_args]


def zone(prefill: EngineProcess, decode: list[EngineProcess]) -> dict[str, Any]:
    return {
        "prefill.test.": {"A": ["127.0.0.1"]},
        "engines.test.": {"A": ["127.0.0.1"]},
        f"{SRV}.": {"SRV": [[0, 0, engine.port, "engines.test."] for engine in decode]},
    }


def load(router: Router, stopping: threading.Event, failures: list[str]) -> None:
    body = {"model": "sim-model", "prompt": "timing", "max_tokens": 4}
    with httpx.Client(timeout=30) as client:
        while not stopping.is_set():
            answer = client.post(f"{router.url}/v1/completions", json=body)
            if answer.status_code != 200:
                failures.append(answer.text[:200])


def decode_urls(router: Router) -> set[str]:
    nodes = httpx.get(
        f"{router.url}/admin/nodes", headers={"Authorization": f"Bearer {TOKEN}"}, timeout=5
    ).json()["nodes"]
    return {node["url"] for node in nodes if node["role"] == "decode"}


def wait(check: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out waiting for {what}")
        time.sleep(0.01)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--interval", type=float, default=5.0, help="--discovery-interval")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    prefill = EngineProcess("prefill")
    base, joiner = EngineProcess("decode"), EngineProcess("decode")
    stopping = threading.Event()
    failures: list[str] = []
    with DnsServer(zone(prefill, [base])) as dns, prefill, base, joiner:
        router = Router(
            [
                "--prefill-dns", f"prefill.test:{prefill.port}",
                "--decode-dns", f"{SRV},slots=8",
                "--dns-server", dns.address,
                "--discovery-interval", str(args.interval),
                "--admin-token", TOKEN,
                "--log-level", "warning",
            ]  # fmt: skip
        )
        with router:
            clients = [
                threading.Thread(target=load, args=(router, stopping, failures)) for _ in range(4)
            ]
            for client in clients:
                client.start()
            times = []
            try:
                for round_ in range(1, args.rounds + 1):
                    # A removal is seen by a round of the loop: start at any phase of it.
                    time.sleep(random.uniform(0, args.interval))  # nosec B311
                    before = joiner.stats()["requests"]
                    dns.set(zone(prefill, [base, joiner]))
                    changed = time.monotonic()
                    wait(
                        lambda: joiner.stats()["requests"] > before,
                        4 * args.interval + 5,
                        "a request",
                    )
                    times.append(time.monotonic() - changed)
                    print(f"round {round_}: {times[-1] * 1000:.0f} ms", flush=True)
                    dns.set(zone(prefill, [base]))
                    wait(
                        lambda: joiner.url not in decode_urls(router),
                        4 * args.interval + 5,
                        "removal",
                    )
            finally:
                stopping.set()
                for client in clients:
                    client.join(10)
    print(
        f"--discovery-interval {args.interval:g} s, {len(times)} rounds: DNS change to the "
        f"first request on the new engine min {min(times) * 1000:.0f} ms, median "
        f"{statistics.median(times) * 1000:.0f} ms, max {max(times) * 1000:.0f} ms; "
        f"{len(failures)} failed requests"
    )


if __name__ == "__main__":
    main()

"""A small authoritative DNS server for tests, on dnspython: UDP on 127.0.0.1, one process.

Its records are a JSON file that it reads again for every query, so a test changes them by
writing the file (``DnsServer.set``, atomically: a query never sees half a file):

    {"decode.test.": {"A": ["127.0.0.1"], "AAAA": ["::1"]},
     "_http._tcp.decode.test.": {"SRV": [[0, 0, 8200, "d0.test."]]},
     "broken.test.": {"rcode": "SERVFAIL"},
     "v4only.test.": {"A": ["127.0.0.1"], "rcode AAAA": "REFUSED"},
     "mute.test.": {"A": ["127.0.0.1"], "drop": ["AAAA"]}}

A name not in the file is NXDOMAIN; a name without the type asked for has an empty
answer (NODATA); ``"rcode TYPE"`` answers that type's queries with that code, and
``"drop"`` leaves those types' queries unanswered (as resolvers that refuse or drop AAAA
queries do). ``DnsServer`` starts it with ``python tests/dns_server.py PORT FILE``,
stops it by its own PID, and can start it again on the same port.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess  # nosec B404
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from pd_router.sim.fleet import listens

TTL = 0  # nothing on the way may cache what the tests change


def serve(port: int, zone: Path) -> None:
    import dns.flags
    import dns.message
    import dns.rcode
    import dns.rdatatype
    import dns.rrset

    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.bind(("127.0.0.1", port))
    while True:
        wire, peer = sock.recvfrom(4096)
        try:
            query = dns.message.from_wire(wire)
        except Exception:  # nosec B112: not DNS, nothing to answer
            continue
        reply = dns.message.make_response(query)
        reply.flags |= dns.flags.AA
        question = query.question[0]
        name = question.name.to_text().lower()
        records = json.loads(zone.read_text()).get(name)
        kind = dns.rdatatype.to_text(question.rdtype)
        if records is not None and kind in records.get("drop", []):
            continue
        if records is None:
            reply.set_rcode(dns.rcode.NXDOMAIN)
        elif "rcode" in records or f"rcode {kind}" in records:
            reply.set_rcode(dns.rcode.from_text(records.get(f"rcode {kind}", records.get("rcode"))))
        else:
            values = [
                " ".join(map(str, v)) if isinstance(v, list) else v for v in records.get(kind, [])
            ]
            if values:
                reply.answer.append(dns.rrset.from_text_list(name, TTL, "IN", kind, values))
        sock.sendto(reply.to_wire(), peer)


def free_udp_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class DnsServer:
    def __init__(self, records: dict[str, Any] | None = None) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="pd-router-dns-"))
        self.zone = self.dir / "zone.json"
        self.set(records or {})
        self.port = free_udp_port()
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def address(self) -> str:
        """For ``--dns-server``."""
        return f"127.0.0.1:{self.port}"

    def set(self, records: dict[str, Any]) -> None:
        """Replace every record; the next query sees the new ones."""
        temporary = self.dir / "zone.json.new"
        temporary.write_text(json.dumps(records))
        os.replace(temporary, self.zone)

    def start(self) -> DnsServer:
        assert self.process is None, "already running"
        with open(self.dir / "log", "ab") as log:
            self.process = subprocess.Popen(  # nosec B603
                [sys.executable, __file__, str(self.port), str(self.zone)],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        self._wait_until_it_answers()
        return self

    def stop(self) -> None:
        process, self.process = self.process, None
        if process is not None:
            os.kill(process.pid, signal.SIGTERM)
            process.wait(5)

    def log(self) -> str:
        return (self.dir / "log").read_text(errors="replace")

    def _wait_until_it_answers(self) -> None:
        import dns.exception
        import dns.message
        import dns.query

        assert self.process is not None
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                break
            try:
                dns.query.udp(dns.message.make_query("ready.", "A"), "127.0.0.1", 0.2, self.port)
                if listens(self.process.pid, self.port, "udp"):
                    return
            except (OSError, dns.exception.Timeout):
                time.sleep(0.02)
        self.stop()
        raise RuntimeError(f"the test DNS server did not answer on {self.address}:\n{self.log()}")

    def __enter__(self) -> DnsServer:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()
        for path in self.dir.iterdir():
            path.unlink()
        self.dir.rmdir()


if __name__ == "__main__":
    serve(int(sys.argv[1]), Path(sys.argv[2]))

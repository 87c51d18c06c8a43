"""TLS, end to end, with certificates from a private CA made by ``trustme``: the router
serving HTTPS (``--ssl-certfile``) to the openai SDK, with ``--workers`` too, and the
router as the client of an engine that requires a client certificate (``--engine-ca``,
``--engine-cert``, ``--engine-key``)."""

from __future__ import annotations

import socket
import ssl
import subprocess  # nosec B404
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest
import trustme
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.serialization import load_pem_private_key

from pd_router.sim.fleet import EngineProcess, SimFleet
from tests.helpers import RouterProcess, assert_sdk_served, flush_state, wait_for
from tests.redis_server import RedisServer

TOKEN = "admin-token"


@dataclass
class Pki:
    ca: trustme.CA
    ca_file: Path
    server_cert: Path  # key and chain in one file
    client_cert: Path
    client_key: Path
    other_ca_file: Path  # a CA that signed none of these

    def client_context(self) -> ssl.SSLContext:
        return ssl.create_default_context(cafile=str(self.ca_file))


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    where = tmp_path_factory.mktemp("pki")
    ca = trustme.CA()
    ca.cert_pem.write_to_path(str(where / "ca.pem"))
    ca.issue_cert("127.0.0.1", "localhost").private_key_and_cert_chain_pem.write_to_path(
        str(where / "server.pem")
    )
    client = ca.issue_cert("pd-router.example")
    client.cert_chain_pems[0].write_to_path(str(where / "client.pem"))
    client.private_key_pem.write_to_path(str(where / "client.key"))
    trustme.CA().cert_pem.write_to_path(str(where / "other-ca.pem"))
    return Pki(
        ca,
        where / "ca.pem",
        where / "server.pem",
        where / "client.pem",
        where / "client.key",
        where / "other-ca.pem",
    )


class TlsRouter(RouterProcess):
    def __init__(self, pki: Pki, prefill: list[str], decode: list[str], *args: str) -> None:
        server = str(pki.server_cert)
        super().__init__(prefill, decode, "--ssl-certfile", server, "--ssl-keyfile", server, *args)
        self.tls = pki.client_context()


@pytest.fixture(scope="module")
def fleet() -> Iterator[SimFleet]:
    with SimFleet(1, 1) as sims:
        yield sims


def sdk(router: RouterProcess, pki: Pki) -> openai.OpenAI:
    http = httpx.Client(verify=pki.client_context())
    return openai.OpenAI(base_url=f"{router.url}/v1", api_key="x", http_client=http, max_retries=0)


def test_the_router_serves_https_to_the_openai_sdk(fleet: SimFleet, pki: Pki) -> None:
    with TlsRouter(pki, [e.url for e in fleet.prefill], [e.url for e in fleet.decode]) as router:
        assert router.url.startswith("https://")
        client = sdk(router, pki)
        assert_sdk_served(client, "over tls", "secret words")
        assert f"listening on https://127.0.0.1:{router.port}" in router.log()
        # A client that does not trust the CA is refused by its own TLS stack.
        with pytest.raises(httpx.ConnectError):
            httpx.get(f"{router.url}/health")
        # The client limits hold over TLS: a head too large gets its JSON answer.
        with socket.create_connection(("127.0.0.1", router.port), timeout=10) as raw:
            with pki.client_context().wrap_socket(raw, server_hostname="127.0.0.1") as tls:
                tls.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * (70 << 10))
                received = b""
                while b"request_header_fields_too_large" not in received:
                    data = tls.recv(65536)
                    if not data:
                        break
                    received += data
        assert received.startswith(b"HTTP/1.1 431 ")
        assert b"request_header_fields_too_large" in received
        router.assert_idle()
        # Over TLS there is no half-close to send: nothing may have failed trying.
        assert "Traceback" not in router.log(), router.log()


def test_a_tls_handshake_that_never_ends_is_closed_after_the_header_timeout(
    fleet: SimFleet, pki: Pki
) -> None:
    """A connection exists for the router's client limits once its handshake is done: one
    that never sends its ClientHello was held 60 s (the loop's default), past
    --header-timeout, however many there were."""
    args = ["--header-timeout", "1"]
    with TlsRouter(
        pki, [e.url for e in fleet.prefill], [e.url for e in fleet.decode], *args
    ) as router:
        # Closed by the router, well before the loop's 60 s (a socket timeout fails it).
        with socket.create_connection(("127.0.0.1", router.port), timeout=45) as silent:
            try:
                assert silent.recv(1) == b""
            except ConnectionResetError:
                pass
        assert sdk(router, pki).models.list().data
    # --header-timeout 0 (no limit) is the loop's own handshake bound, not a handshake
    # that may take no time at all (every connection then failed).
    args = ["--header-timeout", "0"]
    with TlsRouter(
        pki, [e.url for e in fleet.prefill], [e.url for e in fleet.decode], *args
    ) as router:
        assert sdk(router, pki).models.list().data


def test_an_encrypted_private_key_is_refused_at_start_naming_why(pki: Pki, tmp_path: Path) -> None:
    """OpenSSL would ask for its pass phrase on the terminal and wait there (or, with none,
    fail with "Invalid argument")."""
    key = load_pem_private_key(pki.client_key.read_bytes(), None)
    encrypted = tmp_path / "encrypted.key"
    encrypted.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.BestAvailableEncryption(b"pass phrase"),
        )
    )
    for flags in (
        ["--ssl-certfile", str(pki.client_cert), "--ssl-keyfile", str(encrypted)],
        ["--engine-cert", str(pki.client_cert), "--engine-key", str(encrypted)],
    ):
        done = subprocess.run(  # nosec B603
            [sys.executable, "-m", "pd_router", "--prefill", "http://p:1", "--decode", "http://d:1"]
            + flags,
            capture_output=True,
            text=True,
            timeout=60,
            stdin=subprocess.DEVNULL,
        )
        assert done.returncode == 2, done.stderr
        assert "the private key is encrypted" in done.stderr.splitlines()[-1]


def test_https_with_workers(fleet: SimFleet, pki: Pki, redis_server: RedisServer) -> None:
    flush_state(redis_server.url)
    prefill, decode = [e.url for e in fleet.prefill], [e.url for e in fleet.decode]
    shared = ("--workers", "2", "--state", redis_server.url, "--queue-timeout", "10")
    with TlsRouter(pki, prefill, decode, *shared) as router:
        wait_for(lambda: router.log().count("listening on https://") == 2, what="two workers")
        client = sdk(router, pki)
        for i in range(8):
            # A new connection each time, for the kernel to give either worker.
            fresh = sdk(router, pki) if i % 2 else client
            answer = fresh.completions.create(model="sim-model", prompt=f"w{i}", max_tokens=1)
            assert answer.choices[0].text == f" w{i}"


class MutualTlsEngine(EngineProcess):
    """A decode engine on HTTPS that requires a client certificate from the CA (as uvicorn,
    and so vLLM, does with ``--ssl-ca-certs`` and ``--ssl-cert-reqs 2``)."""

    def __init__(self, pki: Pki) -> None:
        server = str(pki.server_cert)
        super().__init__(
            "decode",
            [
                "--ssl-certfile",
                server,
                "--ssl-keyfile",
                server,
                "--ssl-ca-certs",
                str(pki.ca_file),
                "--ssl-cert-reqs",
                str(int(ssl.CERT_REQUIRED)),
            ],
        )
        self.tls = pki.client_context()
        self.tls.load_cert_chain(str(pki.client_cert), str(pki.client_key))


@pytest.fixture(scope="module")
def mtls_decode(pki: Pki) -> Iterator[MutualTlsEngine]:
    with MutualTlsEngine(pki) as engine:
        yield engine


def mtls_router(fleet: SimFleet, engine: MutualTlsEngine, *args: str) -> RouterProcess:
    return RouterProcess(
        [e.url for e in fleet.prefill],
        [engine.url],
        "--admin-token",
        TOKEN,
        "--health-interval",
        "0.2",
        "--unhealthy-after",
        "2",
        *args,
    )


def test_an_engine_requiring_a_client_certificate_gets_the_routers(
    fleet: SimFleet, pki: Pki, mtls_decode: MutualTlsEngine
) -> None:
    assert mtls_decode.url.startswith("https://")
    with mtls_router(
        fleet,
        mtls_decode,
        "--engine-ca",
        str(pki.ca_file),
        "--engine-cert",
        str(pki.client_cert),
        "--engine-key",
        str(pki.client_key),
    ) as router:
        client = openai.OpenAI(base_url=f"{router.url}/v1", api_key="x", max_retries=0)
        answer = client.completions.create(model="sim-model", prompt="mutual tls", max_tokens=2)
        assert answer.choices[0].text == " mutual tls"
        stream = client.completions.create(
            model="sim-model", prompt="mutual stream", max_tokens=3, stream=True
        )
        assert "".join(c.choices[0].text for c in stream if c.choices) == " mutual stream mutual"
        # The model read and the probes went over mutual TLS too.
        nodes = httpx.get(
            f"{router.url}/admin/nodes", headers={"Authorization": f"Bearer {TOKEN}"}
        ).json()["nodes"]
        assert [n["models"] for n in nodes if n["role"] == "decode"] == [["sim-model"]]
        router.assert_idle()


@pytest.mark.parametrize(
    "flags, reason",
    [
        (("--engine-ca", "CA"), "requires a client certificate"),  # none given
        (("--engine-ca", "OTHER_CA"), "certificate is not trusted"),  # another CA
    ],
)
def test_without_the_right_certificates_the_error_names_the_engine_and_tls(
    fleet: SimFleet,
    pki: Pki,
    mtls_decode: MutualTlsEngine,
    flags: tuple[str, str],
    reason: str,
) -> None:
    ca = {"CA": str(pki.ca_file), "OTHER_CA": str(pki.other_ca_file)}[flags[1]]
    with mtls_router(fleet, mtls_decode, flags[0], ca) as router:
        client = openai.OpenAI(base_url=f"{router.url}/v1", api_key="x", max_retries=0)
        for _ in range(3):  # more than --unhealthy-after
            with pytest.raises(openai.APIStatusError) as failed:
                client.completions.create(model="sim-model", prompt="no cert", max_tokens=2)
            error = failed.value
            assert error.status_code == 502
            assert error.type == "upstream_error"
            assert f"decode engine {mtls_decode.url}/v1/completions: TLS handshake failed" in (
                error.message
            )
            assert reason in error.message.lower()

        # Soft evidence: unhealthy (routed around, were there another decode node), never
        # dead, so that with no other node it still takes requests and each client is told
        # what failed rather than "no live node".
        def decode_state() -> str:
            nodes = httpx.get(
                f"{router.url}/admin/nodes", headers={"Authorization": f"Bearer {TOKEN}"}
            ).json()["nodes"]
            return str(next(n["state"] for n in nodes if n["role"] == "decode"))

        wait_for(lambda: decode_state() == "unhealthy", what="the decode node unhealthy")
        with pytest.raises(openai.APIStatusError) as failed:
            client.completions.create(model="sim-model", prompt="still told", max_tokens=2)
        assert "TLS handshake failed" in failed.value.message
        assert decode_state() == "unhealthy"
        assert "is dead" not in router.log()
        router.assert_idle()

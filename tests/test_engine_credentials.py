"""Engine credentials (``--engine-api-key``), end to end: simulated engines that refuse any
/v1/ request without their key (as vLLM's ``--api-key`` does; the sim also refuses a second
``Authorization`` header, so a client's forwarded one would show), a real router."""

from __future__ import annotations

import os
import subprocess  # nosec B404
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from pd_router.sim.fleet import SimFleet
from tests.helpers import RouterProcess, admin_router, assert_sdk_served, wait_for

ENGINE_KEY = "engine-key-5b7f0c1d9e"
WRONG_KEY = "engine-key-wrong-000000"
CLIENT_KEY = "sk-client-4d2a9c"
TOKEN = "admin-token"


@pytest.fixture(scope="module")
def fleet() -> Iterator[SimFleet]:
    engine = ["--api-key", ENGINE_KEY]
    with SimFleet(1, 1, prefill_args=engine, decode_args=engine) as sims:
        yield sims


def router_for(fleet: SimFleet, *args: str) -> RouterProcess:
    return admin_router(fleet, TOKEN, *args)


def admin_nodes(router: RouterProcess) -> httpx.Response:
    headers = {"Authorization": f"Bearer {TOKEN}"}
    return httpx.get(f"{router.url}/admin/nodes", headers=headers, timeout=10)


def test_the_engine_key_goes_on_every_engine_call_and_the_clients_never(
    fleet: SimFleet, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fleet.reset()
    keys = tmp_path / "keys"
    keys.write_text(f"client {CLIENT_KEY}\n")
    # From the environment, as a Secret would be given: not on the command line.
    monkeypatch.setenv("PD_ROUTER_ENGINE_API_KEY", ENGINE_KEY)
    with router_for(fleet, "--api-keys-file", str(keys)) as router:
        # The node's models were read with the key (the engines refuse /v1/models without).
        wait_for(
            lambda: all(n["models"] == ["sim-model"] for n in admin_nodes(router).json()["nodes"]),
            timeout=20,
            what="the nodes' models read",
        )
        client = openai.OpenAI(base_url=f"{router.url}/v1", api_key=CLIENT_KEY, max_retries=0)
        assert_sdk_served(client, "hi there", "streamed")
        assert [m.id for m in client.models.list().data] == ["sim-model"]
        # Every call reached its engine with the router's key, and only with it: the sims
        # refuse a request whose Authorization headers are not all the engine key.
        for engine in fleet.engines:
            stats = engine.stats()
            assert stats["unauthorized"] == 0
            assert stats["requests"] == 2
        nodes = admin_nodes(router)
        assert ENGINE_KEY not in nodes.text
        wait_for(lambda: "request_id=" in router.log(), what="the request lines")
        assert ENGINE_KEY not in router.log()
    help_text = subprocess.run(  # nosec B603
        [sys.executable, "-m", "pd_router", "--help"],
        capture_output=True,
        text=True,
        env={**os.environ, "PD_ROUTER_ENGINE_API_KEY": ENGINE_KEY},
        check=True,
    ).stdout
    assert "--engine-api-key" in help_text and ENGINE_KEY not in help_text


def test_a_wrong_engine_key_is_the_engines_401_and_kills_no_node(fleet: SimFleet) -> None:
    fleet.reset()
    with router_for(fleet, "--engine-api-key", WRONG_KEY) as router:
        client = openai.OpenAI(base_url=f"{router.url}/v1", api_key="unused", max_retries=0)
        for _ in range(4):  # more than --unhealthy-after
            with pytest.raises(openai.AuthenticationError) as refused:
                client.completions.create(model="sim-model", prompt="hi", max_tokens=2)
            error = refused.value
            assert error.status_code == 401
            assert error.type == "upstream_error"
            assert error.code == "engine_unauthorized"
            engine = f"prefill engine {fleet.prefill[0].url}/v1/completions: Unauthorized"
            assert engine in error.message and "--engine-api-key" in error.message
        # The requests, and the reads of its models.
        assert fleet.prefill[0].stats()["unauthorized"] >= 4
        # Past --unhealthy-after refused requests, and five probe intervals: no node is
        # held to blame.
        time.sleep(1.0)
        nodes = admin_nodes(router).json()["nodes"]
        assert {n["state"] for n in nodes} == {"serving"}
        assert {n["consecutive_failures"] for n in nodes} == {0}
        router.assert_idle()
        assert WRONG_KEY not in router.log() and WRONG_KEY not in admin_nodes(router).text
        # vLLM asks no key for /health: the refused model reads say what is wrong, once
        # per engine (before, only at DEBUG, and /v1/models answered "not read yet").
        for engine in fleet.engines:
            warning = f"{engine.url}/v1/models: the engine refuses the router's credentials"
            assert router.log().count(warning) == 1, router.log()


def test_a_probe_refused_for_credentials_is_no_verdict_on_the_node(fleet: SimFleet) -> None:
    """A proxy in front of an engine that wants credentials for /health too: its 401 says
    the router's settings are wrong, not that the engine is unwell."""
    fleet.reset()
    decode = fleet.decode[0]
    with router_for(fleet, "--engine-api-key", ENGINE_KEY) as router:
        try:
            decode.configure(health_status=401)
            wait_for(lambda: "refuses the router's credentials" in router.log(), what="warning")
            # Ten probe intervals: enough to make it unhealthy five times over, were the
            # refusals counted against it.
            time.sleep(2.0)
            assert _states(router)["decode"] == "serving"
            assert router.log().count("refuses the router's credentials") == 1
            client = openai.OpenAI(base_url=f"{router.url}/v1", api_key="unused", max_retries=0)
            assert client.completions.create(model="sim-model", prompt="ok", max_tokens=1)
            # The same probes answering 503 do make it unhealthy: the rule, not deafness.
            decode.configure(health_status=503)
            wait_for(lambda: _states(router)["decode"] == "unhealthy", what="unhealthy")
        finally:
            decode.configure(health_status=None)


def _states(router: RouterProcess) -> dict[str, str]:
    return {n["role"]: n["state"] for n in admin_nodes(router).json()["nodes"]}

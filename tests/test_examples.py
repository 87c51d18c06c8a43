"""The deployment examples under ``examples/``: every file parses, the pieces agree with each
other and with the router's real CLI, and the Grafana dashboard queries only metrics that the
router exports (read from its Prometheus registry, not from a list kept here).

Needs PyYAML (the ``test`` extra). Nothing here starts a server or needs Docker / a cluster.
"""

from __future__ import annotations

import argparse
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from pd_router.serve import build_router, parse_router_args, router_parser
from pd_router.shared.redis import parse_url

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
KUBERNETES = EXAMPLES / "kubernetes"
COMPOSE = EXAMPLES / "docker-compose.yml"
DASHBOARD = EXAMPLES / "grafana" / "pd-router-dashboard.json"

YAML_FILES = sorted(p for p in EXAMPLES.rglob("*") if p.suffix in (".yaml", ".yml"))
JSON_FILES = sorted(EXAMPLES.rglob("*.json"))


def _rel(path: Path) -> str:
    return str(path.relative_to(EXAMPLES))


def _yaml_docs(path: Path) -> list[Any]:
    with path.open(encoding="utf-8") as f:
        return [doc for doc in yaml.safe_load_all(f) if doc is not None]


def _parse_router_args(
    argv: list[str], environ: dict[str, str] | None = None
) -> argparse.Namespace:
    """``argv`` and ``environ`` as the real ``pd-router`` parses them; unknown ones fail."""
    parser, actions = router_parser()
    try:
        return parse_router_args(parser, actions, argv, environ or {})
    except SystemExit:
        pytest.fail(f"pd-router rejects these settings (see stderr): {argv} {environ}")


# --- every file parses --------------------------------------------------------------------


def test_examples_exist() -> None:
    assert KUBERNETES.is_dir() and COMPOSE.is_file() and DASHBOARD.is_file()
    assert YAML_FILES and JSON_FILES


@pytest.mark.parametrize("path", YAML_FILES, ids=_rel)
def test_yaml_parses(path: Path) -> None:
    docs = _yaml_docs(path)
    assert docs, f"{_rel(path)} has no YAML document"
    assert all(isinstance(doc, dict) for doc in docs), f"{_rel(path)}: a document is not a map"


@pytest.mark.parametrize("path", JSON_FILES, ids=_rel)
def test_json_parses(path: Path) -> None:
    with path.open(encoding="utf-8") as f:
        assert isinstance(json.load(f), dict)


# --- Kubernetes ---------------------------------------------------------------------------


def _k8s_docs() -> list[tuple[Path, dict[str, Any]]]:
    return [(path, doc) for path in sorted(KUBERNETES.glob("*.yaml")) for doc in _yaml_docs(path)]


def _find(kind: str, name: str) -> dict[str, Any]:
    found = [
        doc for _, doc in _k8s_docs() if doc["kind"] == kind and doc["metadata"]["name"] == name
    ]
    assert (
        len(found) == 1
    ), f"expected one {kind}/{name} under examples/kubernetes, got {len(found)}"
    return found[0]


def _container(workload: dict[str, Any]) -> dict[str, Any]:
    containers = workload["spec"]["template"]["spec"]["containers"]
    assert len(containers) == 1
    container: dict[str, Any] = containers[0]
    return container


def _flag(args: list[str], flag: str) -> str:
    assert flag in args, f"{flag} missing from {args}"
    return args[args.index(flag) + 1]


def test_every_kubernetes_doc_has_api_version_kind_and_name() -> None:
    docs = _k8s_docs()
    assert docs
    for path, doc in docs:
        where = f"{_rel(path)}: {doc.get('kind')}"
        assert isinstance(doc.get("apiVersion"), str) and doc["apiVersion"], where
        assert isinstance(doc.get("kind"), str) and doc["kind"], where
        assert isinstance(doc.get("metadata", {}).get("name"), str), where
    names = [(doc["kind"], doc["metadata"]["name"]) for _, doc in docs]
    assert len(names) == len(set(names)), "a kind/name pair is defined twice"


def _router_args() -> tuple[dict[str, Any], argparse.Namespace]:
    deployment = _find("Deployment", "pd-router")
    container = _container(deployment)
    env = {e["name"]: e for e in container.get("env", [])}
    # Settings may come from PD_ROUTER_* variables; the secret ones from a Secret.

    def expanded(text: str) -> str:
        # The kubelet expands $(VAR) from the container's env; here only secrets are used.
        for var in re.findall(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", text):
            assert var in env, f"$({var}) used by the router but not in its env"
            assert "secretKeyRef" in env[var].get("valueFrom", {}), f"{var} is not from a Secret"
            text = text.replace(f"$({var})", "token-from-secret")
        return text

    environ = {}
    for name, entry in env.items():
        if "secretKeyRef" in entry.get("valueFrom", {}):
            environ[name] = "token-from-secret"
        elif "value" in entry:
            environ[name] = expanded(str(entry["value"]))
    args = [expanded(arg) for arg in container["args"]]
    return deployment, _parse_router_args(args, environ)


def test_router_deployment() -> None:
    deployment, args = _router_args()
    pod = deployment["spec"]["template"]
    container = _container(deployment)
    annotations = pod["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true"
    assert annotations["prometheus.io/port"] == str(args.port) == "8000"
    assert annotations["prometheus.io/path"] == "/metrics"

    assert args.host == "0.0.0.0"
    assert args.admin_token == "token-from-secret"
    # The replicas share one pool: its Redis is the example's, its password a secret.
    state = parse_url(args.state)
    assert (state.host, state.port, state.password) == (
        "pd-router-state",
        6379,
        "token-from-secret",
    )
    service = _find("Service", "pd-router-state")
    assert service["spec"]["ports"][0]["port"] == state.port
    redis = _container(_find("StatefulSet", "pd-router-state"))
    assert "--requirepass" in " ".join(redis["args"])
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert args.port in ports.values()

    readiness = container["readinessProbe"]["httpGet"]
    assert readiness["path"] == "/health"
    assert ports.get(readiness["port"], readiness["port"]) == args.port
    liveness = container["livenessProbe"]
    assert liveness["httpGet"]["path"] in ("/health", "/metrics")

    # SIGTERM -> in-flight requests get --shutdown-timeout -> exit 0: the pod must not be
    # SIGKILLed before that, counting the preStop sleep that runs first.
    grace = pod["spec"]["terminationGracePeriodSeconds"]
    pre_stop = container.get("lifecycle", {}).get("preStop", {})
    sleep = float(pre_stop["exec"]["command"][-1]) if "exec" in pre_stop else 0.0
    assert grace > sleep + args.shutdown_timeout
    # Liveness must not be able to kill a router that is draining.
    assert liveness["periodSeconds"] * liveness["failureThreshold"] >= grace

    service = _find("Service", "pd-router")
    assert service["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
    assert any(p["port"] == 8000 for p in service["spec"]["ports"])


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_router_discovers_every_engine_through_its_headless_service(role: str) -> None:
    """The router lists no engine: it follows each role's headless Service by DNS, on the
    port the engine serves, and the pods behind it play the matching NixlConnector role.
    Only ready pods are published, so a terminating pod leaves the answers at once."""
    _, args = _router_args()
    assert not getattr(args, role), f"--{role} lists engines: scaling would mean editing it"
    specs = getattr(args, f"{role}_dns")
    assert specs, f"no --{role}-dns"
    for spec in specs:
        assert spec.role == role and spec.port is not None and not spec.srv
        service = _find("Service", spec.name)
        assert service["spec"]["clusterIP"] == "None", "only a headless Service lists pod IPs"
        assert not service["spec"].get("publishNotReadyAddresses", False)
        assert spec.port in {p["port"] for p in service["spec"]["ports"]}
        (sts,) = (
            doc
            for _, doc in _k8s_docs()
            if doc["kind"] == "StatefulSet" and doc["spec"]["serviceName"] == spec.name
        )
        assert service["spec"]["selector"].items() <= (
            sts["spec"]["template"]["metadata"]["labels"].items()
        )
        _check_vllm_engine(_container(sts), role, spec.port)


def test_no_example_tells_the_operator_to_edit_lists_or_call_every_router() -> None:
    for path in [*KUBERNETES.glob("*.yaml"), EXAMPLES / "README.md"]:
        text = " ".join(path.read_text(encoding="utf-8").split()).lower()
        for stale in ("keep in step with the router", "on every router pod", "update these lists"):
            assert stale not in text, f"{_rel(path)}: {stale!r}"


def _check_vllm_engine(container: dict[str, Any], role: str, port: int) -> None:
    assert container["image"].startswith("vllm/vllm-openai:")
    argv = [*container.get("command", []), *container["args"]]
    assert int(_flag(argv, "--port")) == port
    assert "--enable-request-id-headers" in argv
    config = json.loads(_flag(argv, "--kv-transfer-config"))
    assert config["kv_connector"] == "NixlConnector"
    assert config["kv_role"] == {"prefill": "kv_producer", "decode": "kv_consumer"}[role]
    env = {e["name"]: e for e in container["env"]}
    host = env["VLLM_NIXL_SIDE_CHANNEL_HOST"]["valueFrom"]["fieldRef"]["fieldPath"]
    assert host == "status.podIP"
    assert int(env["VLLM_NIXL_SIDE_CHANNEL_PORT"]["value"]) > 0
    assert int(container["resources"]["limits"]["nvidia.com/gpu"]) >= 1
    assert container["readinessProbe"]["httpGet"]["path"] == "/health"


# --- docker compose -----------------------------------------------------------------------


def _interpolate(text: str) -> str:
    """Compose's ${VAR}, ${VAR:-default}, ${VAR:?error}: the default, else a placeholder."""

    def value(match: re.Match[str]) -> str:
        return match.group(2) if match.group(1) == ":-" else "placeholder"

    return re.sub(r"\$\{[A-Za-z_][A-Za-z0-9_]*(?:(:[-?])([^}]*))?\}", value, text)


def _compose() -> dict[str, Any]:
    (doc,) = _yaml_docs(COMPOSE)
    return doc  # type: ignore[no-any-return]


def test_compose_structure() -> None:
    services = _compose()["services"]
    assert isinstance(services, dict) and services
    for name, service in services.items():
        assert "image" in service or "build" in service, name
    assert {"vllm-prefill", "vllm-decode", "pd-router"} <= services.keys()

    engines: dict[int, str] = {}  # port -> kv_role
    for name in ("vllm-prefill", "vllm-decode"):
        argv = [_interpolate(str(a)) for a in services[name]["command"]]
        config = json.loads(_flag(argv, "--kv-transfer-config"))
        assert config["kv_connector"] == "NixlConnector"
        engines[int(_flag(argv, "--port"))] = config["kv_role"]
        assert services[name]["environment"]["VLLM_NIXL_SIDE_CHANNEL_PORT"]
    sides = [
        s["environment"]["VLLM_NIXL_SIDE_CHANNEL_PORT"]
        for s in services.values()
        if "VLLM_NIXL_SIDE_CHANNEL_PORT" in s.get("environment", {})
    ]
    assert len(set(sides)) == len(sides), "engines on one host need distinct side-channel ports"

    router = services["pd-router"]
    args = _parse_router_args([_interpolate(str(a)) for a in router["command"]])
    for role, kv_role in (("prefill", "kv_producer"), ("decode", "kv_consumer")):
        for url in (spec.url for spec in getattr(args, role)):
            port = int(url.rsplit(":", 1)[1])
            assert engines.get(port) == kv_role, f"router {role} {url}: no {kv_role} there"
    grace = router["stop_grace_period"]
    assert re.fullmatch(r"\d+s", grace) and int(grace[:-1]) > args.shutdown_timeout


def test_compose_bind_mounts_exist() -> None:
    for name, service in _compose()["services"].items():
        for volume in service.get("volumes", []):
            source = volume.split(":")[0]
            if source.startswith("."):
                assert (EXAMPLES / source).exists(), f"{name}: {source} not in examples/"
        build = service.get("build")
        if build:
            context = EXAMPLES / build["context"]
            dockerfile = context / build["dockerfile"]
            assert dockerfile.is_file(), f"{name}: {dockerfile}"
            # Everything the Dockerfile copies must exist in the build context.
            for line in dockerfile.read_text(encoding="utf-8").splitlines():
                if line.startswith("COPY "):
                    for source in line.split()[1:-1]:
                        assert (context / source).exists(), f"{dockerfile.name}: {source}"


# --- Grafana dashboard --------------------------------------------------------------------

_SUFFIXES = {
    "counter": ("_total",),
    "histogram": ("_bucket", "_sum", "_count"),
    "gaugehistogram": ("_bucket", "_gsum", "_gcount"),
    "summary": ("", "_sum", "_count"),
    "info": ("_info",),
}


def _router_registry() -> Any:
    args = _parse_router_args(
        ["--prefill", "http://127.0.0.1:1", "--decode", "http://127.0.0.1:2"]
        # With a name to discover by, so that the discovery families are exported too.
        + ["--decode-dns", "decode.example:2", "--dns-server", "127.0.0.1:53"]
    )
    # The registry that /metrics serves.
    return build_router(args).telemetry.registry


def exported_metric_names() -> dict[str, str]:
    """Series names a scrape of the router can show, each mapped to its family's name.

    A family declares its type: counter ``x`` is exposed as ``x_total``, histogram ``x`` as
    ``x_bucket``/``x_sum``/``x_count``, whether or not it has samples yet.
    """
    names: dict[str, str] = {}
    for family in _router_registry().collect():
        for suffix in _SUFFIXES.get(family.type, ("",)):
            names[family.name + suffix] = family.name
        for sample in family.samples:
            names[sample.name] = family.name
    return names


def _dashboard() -> dict[str, Any]:
    with DASHBOARD.open(encoding="utf-8") as f:
        document: dict[str, Any] = json.load(f)
    return document


def _panels(container: dict[str, Any]) -> Iterator[dict[str, Any]]:
    for panel in container.get("panels", []):
        yield panel
        yield from _panels(panel)  # collapsed rows hold their panels


def _queries(dashboard: dict[str, Any]) -> Iterator[tuple[str, str]]:
    """(where, PromQL) for every panel target and every query variable."""
    for panel in _panels(dashboard):
        for target in panel.get("targets", []):
            if "expr" in target:
                yield f"panel {panel.get('title')!r}", target["expr"]
    for variable in dashboard.get("templating", {}).get("list", []):
        if variable.get("type") == "query":
            query = variable.get("query")
            query = query.get("query", "") if isinstance(query, dict) else query
            yield f"variable {variable['name']!r}", str(query or variable.get("definition", ""))


def _metric_names(promql: str) -> set[str]:
    # Drop string literals (label values, regexes) first, then take whole identifiers.
    code = re.sub(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`', '""', promql)
    return {name for name in re.findall(r"[A-Za-z_:][A-Za-z0-9_:]*", code)
            if re.fullmatch(r"pd_router_[a-z_]+", name)}  # fmt: skip


def test_metric_name_extraction() -> None:
    expr = (
        'histogram_quantile(0.99, sum by (le) (rate(pd_router_x_seconds_bucket{job="pd_router_y",'
        ' url=~"http://a:1"}[5m]))) / ignoring(state) pd_router_z'
    )
    assert _metric_names(expr) == {"pd_router_x_seconds_bucket", "pd_router_z"}


def test_dashboard_structure() -> None:
    dashboard = _dashboard()
    assert dashboard["title"] and dashboard["uid"]
    assert 36 <= dashboard["schemaVersion"] <= 42
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    panels = list(_panels(dashboard))
    ids = [panel["id"] for panel in panels]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    for panel in panels:
        assert {"h", "w", "x", "y"} <= panel["gridPos"].keys(), panel["title"]
        assert panel["gridPos"]["x"] + panel["gridPos"]["w"] <= 24, panel["title"]
        if panel["type"] == "row":
            continue
        # Every query goes to the data source the viewer picked, so the dashboard imports
        # into any Grafana and works with the provisioned one in docker-compose.yml.
        assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            assert target["expr"].strip(), panel["title"]
            assert target["expr"].count("(") == target["expr"].count(")"), target["expr"]


def test_dashboard_queries_only_exported_metrics() -> None:
    exported = exported_metric_names()
    used: dict[str, list[str]] = {}
    for where, promql in _queries(_dashboard()):
        for name in _metric_names(promql):
            used.setdefault(name, []).append(where)
    assert used, "no pd_router_* metric found in the dashboard"
    missing = {name: sorted(set(wheres)) for name, wheres in used.items() if name not in exported}
    assert not missing, (
        f"the dashboard queries metrics the router does not export: {missing}; "
        f"exported: {sorted(exported)}"
    )


def test_dashboard_shows_every_exported_family() -> None:
    """A metric added to the router without a panel shows up here."""
    exported = exported_metric_names()
    shown = {
        exported[name]
        for _, promql in _queries(_dashboard())
        for name in _metric_names(promql)
        if name in exported
    }
    missing = set(exported.values()) - shown
    assert not missing, f"exported but not on the dashboard: {sorted(missing)}"

"""Where the router subscribes to an engine's KV events (``engines/kvevents.py``)."""

from __future__ import annotations

from pd_router.engines.kvevents import endpoint_of
from pd_router.fleet.nodes import make_nodes


def test_the_event_endpoint_is_the_kv_events_port_on_the_host_of_the_engines_url() -> None:
    four, six, none = make_nodes(
        [
            "http://10.0.0.7:8100,kv_events=5557",
            "http://[fd00::7]:8100,kv_events=5558",
            "http://p:8100",
        ],
        1,
        role="prefill",
    )
    assert endpoint_of(four) == "tcp://10.0.0.7:5557"
    assert endpoint_of(six) == "tcp://[fd00::7]:5558"
    assert endpoint_of(none) is None
    # A label set by hand (the admin API) that is not a port is no endpoint.
    none.labels["kv_events"] = "soon"
    assert endpoint_of(none) is None

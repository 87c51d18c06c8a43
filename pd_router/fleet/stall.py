"""The stall watch: progress is evidence. No I/O.

The router sees every byte a decode engine streams. A started stream (the engine has the
KV and sent its first bytes) whose bytes stop while the relay waits for them is silent; a
node whose started streams are all silent for ``--stall-timeout`` is hung, whatever its
``/health`` says (vLLM's answers 200 while its scheduler hangs). A stream still waiting
for its KV is not started, so it is not watched; a stream held up by its own client (the
relay is busy sending, so the engine's bytes wait) is neither silent nor flowing; and a
node with some stream flowing is not hung.

Silence is counted in the watch's own ticks, each worth at most ``2 * tick`` seconds: a
tick that came late because the router's loop stalled adds no more than that, so the
router's own stall never reads as the engine's.
"""

from __future__ import annotations

from collections.abc import Iterable

from pd_router.fleet.nodes import Node
from pd_router.fleet.registry import Binding


def hung(bindings: Iterable[Binding], elapsed: float, timeout: float) -> dict[Node, list[Binding]]:
    """One tick, ``elapsed`` seconds after the previous one: the hung nodes, each with its
    silent streams (those silent ``timeout`` s or more)."""
    silent: dict[Node, list[Binding]] = {}
    flowing: set[Node] = set()
    for binding in bindings:
        stream = binding.stream
        if stream is None:
            continue
        node = binding.decode
        received = stream.received
        if received != binding.seen or not stream.awaiting:
            if stream.awaiting:
                flowing.add(node)
            binding.seen = received
            binding.silent = 0.0
            continue
        binding.silent += elapsed
        if binding.silent >= timeout:
            silent.setdefault(node, []).append(binding)
        else:
            flowing.add(node)
    return {node: streams for node, streams in silent.items() if node not in flowing}

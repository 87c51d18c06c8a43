"""The simulated fleet the prefix-cache benchmarks (routing_bench, conversations_bench) run
on: prefill engines computing one prefill at a time, with or without a bounded prefix
cache, behind routers that never queue a request for lack of decode slots.
"""

from __future__ import annotations

BLOCK = 16  # tokens per prefix-cache block, the engines' --block-size
# Enough decode slots that nothing queues: the prefill side is what is measured.
ROUTER_ARGS = ["--decode-slots", "256", "--queue-timeout", "60", "--log-level", "warning"]


def prefill_args(per_token: float, cache_blocks: int) -> tuple[list[str], list[str]]:
    """A prefill engine's arguments: (unbounded cache, ``cache_blocks`` blocks of cache)."""
    unbounded = [
        *("--block-size", str(BLOCK), "--prefill-per-token", str(per_token)),
        *("--prefill-concurrency", "1"),
    ]
    return unbounded, [*unbounded, "--prefix-cache-blocks", str(cache_blocks)]

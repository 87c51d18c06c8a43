"""What picking a prefill node costs the router per request, in this process (no server):
describing the prompt, choosing a node and recording the placement, against prompt length
and the number of distinct conversations the router has seen.

    python benchmarks/pick_cost.py            # ~20 s
    python benchmarks/pick_cost.py --nodes 8 --tokens 500 2000 8000 --conversations 100 10000

Each request is a chat turn: a shared system prompt, then a conversation's own messages up
to ``--tokens`` tokens (~4 characters each). Before measuring, the router is filled with
``conversations`` distinct conversations (each placed once), with an engine cache large
enough to hold them all: the search must not slow down with what is held. Printed: the
best of 3 passes, microseconds per request, for ``cost``, ``prefix`` and ``round_robin``.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from pd_router.fleet.holdings import KvView, describe  # noqa: E402
from pd_router.fleet.nodes import make_nodes  # noqa: E402
from pd_router.fleet.prefill import POLICIES, prefix_key  # noqa: E402

SYSTEM = "You are a helpful assistant who answers with care. " * 20


def body(conversation: int, tokens: int) -> dict[str, object]:
    own = max(tokens * 4 - len(SYSTEM), 40)
    text = f"conversation {conversation}: " + "a question with some words " * (own // 27 + 1)
    return {
        "model": "m",
        "messages": [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": text[: own // 2]},
            {"role": "assistant", "content": text[own // 2 : own]},
            {"role": "user", "content": "and then?"},
        ],
    }


def cost_per_request(policy_name: str, nodes: int, tokens: int, conversations: int) -> float:
    urls = [f"http://prefill-{index}:8100" for index in range(nodes)]
    # Big enough to hold every conversation: the worst case for the search.
    view = KvView(cache_tokens=conversations * tokens * 2)
    policy = POLICIES[policy_name](make_nodes(urls, 1, role="prefill"), view)
    bodies = [body(index, tokens) for index in range(conversations)]
    measured = bodies[: min(conversations, 2000)]

    def one(request: dict[str, object]) -> None:
        key = prefix_key(request)
        prompt = describe(request, view.ratio) if policy.reads_prompt else None
        node = policy.pick(key, prompt=prompt)
        assert node is not None  # nosec B101
        policy.release(policy.place(node, key, prompt))

    for request in bodies:
        one(request)
    best = float("inf")
    for _ in range(3):
        started = time.perf_counter()
        for request in measured:
            one(request)
        best = min(best, time.perf_counter() - started)
    return best / len(measured) * 1e6


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, default=8)
    parser.add_argument("--tokens", type=int, nargs="+", default=[500, 2000, 8000])
    parser.add_argument("--conversations", type=int, nargs="+", default=[100, 10_000])
    args = parser.parse_args(argv)
    print(f"us per request over {args.nodes} prefill nodes (describe + pick + place + release)")
    print(f"{'tokens':>7} {'conversations':>13} {'cost':>8} {'prefix':>8} {'round_robin':>11}")
    for tokens in args.tokens:
        for conversations in args.conversations:
            costs = [
                cost_per_request(name, args.nodes, tokens, conversations)
                for name in ("cost", "prefix", "round_robin")
            ]
            print(
                f"{tokens:>7} {conversations:>13,} {costs[0]:>8.1f} {costs[1]:>8.1f} "
                f"{costs[2]:>11.1f}",
                flush=True,
            )


if __name__ == "__main__":
    main()

"""What picking a prefill node costs the router per request, in this process (no server):
describing the prompt, choosing a node and recording the placement, against prompt length
and the number of distinct conversations the router has seen.

    python benchmarks/pick_cost.py            # ~20 s
    python benchmarks/pick_cost.py --nodes 8 --tokens 500 2000 8000 --conversations 100 10000

Each request is a chat turn: a shared system prompt, then a conversation's own messages up
to ``--tokens`` tokens (~4 characters each). Before measuring, the router is filled with
``conversations`` distinct conversations (each placed once), with an engine cache large
enough to hold them all: the search must not slow down with what is held. Printed: the
best of 3 passes, microseconds per request, for ``cost``, ``prefix`` and ``round_robin``,
and ``cost`` with every node's KV event stream live (``cost+events``: each conversation's
prompt learned from its answer's token ids and held, by its events, in blocks of 16 on the
node it went to; the pick reads the events) and what that costs on the answer's path
(``learn``: the answer's token ids keyed and linked, and the engine's BlockStored applied).
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

from pd_router.fleet.holdings import KvView, Prompt, describe  # noqa: E402
from pd_router.fleet.kvindex import BlockIndex  # noqa: E402
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


BLOCK = 16


def cost_per_request(
    policy_name: str, nodes: int, tokens: int, conversations: int, events: bool = False
) -> tuple[float, float]:
    """Microseconds per request: the pick, and (with ``events``) the learning."""
    urls = [f"http://prefill-{index}:8100" for index in range(nodes)]
    # Big enough to hold every conversation: the worst case for the search.
    view = KvView(cache_tokens=conversations * tokens * 2)
    policy = POLICIES[policy_name](make_nodes(urls, 1, role="prefill"), view)
    if events:
        for node in policy.nodes:
            view.indexes[node.id] = view.live[node.id] = BlockIndex()
    bodies = [body(index, tokens) for index in range(conversations)]
    measured = bodies[: min(conversations, 2000)]
    placed: list[tuple[int, Prompt, list[int], list[bytes]]] = []
    # The answers' token ids (~4 bytes of text each) and the engine's block hashes.
    answers = {}
    if events:
        for index, request in enumerate(measured):
            ids = [(index * 7919 + i) & 0xFFFF for i in range(tokens)]
            hashes = [(index << 20 | block).to_bytes(32, "big") for block in range(tokens // BLOCK)]
            answers[id(request)] = ids, hashes

    def one(request: dict[str, object]) -> None:
        key = prefix_key(request)
        prompt = describe(request, view.ratio) if policy.reads_prompt else None
        node = policy.pick(key, prompt=prompt)
        assert node is not None  # nosec B101
        policy.release(policy.place(node, key, prompt))
        if id(request) in answers and prompt is not None:
            placed.append((node.id, prompt, *answers[id(request)]))

    def learn() -> None:
        for node_id, prompt, ids, hashes in placed:
            view.indexes[node_id].stored(hashes, None, ids[: len(hashes) * BLOCK], BLOCK)
            view.learn(node_id, prompt, ids)

    for request in bodies:
        one(request)
    learn()
    best = float("inf")
    for _ in range(3):
        placed.clear()
        started = time.perf_counter()
        for request in measured:
            one(request)
        best = min(best, time.perf_counter() - started)
    learned = float("inf")
    if events:
        for index in view.indexes.values():
            index.clear()
        started = time.perf_counter()
        learn()
        learned = time.perf_counter() - started
    return best / len(measured) * 1e6, learned / max(len(placed), 1) * 1e6


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, default=8)
    parser.add_argument("--tokens", type=int, nargs="+", default=[500, 2000, 8000])
    parser.add_argument("--conversations", type=int, nargs="+", default=[100, 10_000])
    args = parser.parse_args(argv)
    print(f"us per request over {args.nodes} prefill nodes (describe + pick + place + release)")
    print(
        f"{'tokens':>7} {'conversations':>13} {'cost':>8} {'cost+events':>11} {'learn':>7} "
        f"{'prefix':>8} {'round_robin':>11}"
    )
    for tokens in args.tokens:
        for conversations in args.conversations:
            costs = [
                cost_per_request(name, args.nodes, tokens, conversations)[0]
                for name in ("cost", "prefix", "round_robin")
            ]
            events, learn = cost_per_request("cost", args.nodes, tokens, conversations, True)
            print(
                f"{tokens:>7} {conversations:>13,} {costs[0]:>8.1f} {events:>11.1f} "
                f"{learn:>7.1f} {costs[1]:>8.1f} {costs[2]:>11.1f}",
                flush=True,
            )


if __name__ == "__main__":
    main()

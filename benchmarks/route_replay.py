"""routing_bench.py's shapes through a prefill policy in virtual time, in this process: what
each decision was and why, without servers or a loaded machine's noise.

    python benchmarks/route_replay.py                       # every shape, cost policy
    python benchmarks/route_replay.py --shapes rag --trace  # every decision of one shape

The engines are modelled as routing_bench.py starts them (``pd_router/sim``'s own prefix
cache: 16-token blocks, ``--cache-blocks`` of LRU, one prefill at a time at ``--per-token``
s per uncached token; answers are the prompt's first words, as the simulated decode engine
gives them); the router is the policy itself (``fleet/prefill.py``) with its view of the
engines' holdings (``fleet/holdings.py``), calibrated from the engines' token counts as
the relay calibrates it. ``--routers 2``: every step of a session through the other one,
each hearing the other's placements ``--hear-delay`` later (``--state``); ``--rtt``: a
prefill stays in flight at the router that long after the engine computed it, as its answer
comes back (on routing_bench's loaded machine, ~8 ms), which the in-flight bounds see;
``--prefill-delay``: what each prefill takes besides its tokens.
Time is virtual: a run takes a second or two and gives the same numbers every time.
Printed per shape: the share of prompt tokens from cache against one unbounded engine's,
prefills per engine, and with ``--trace`` each prefill (the costs the policy saw, where it
went, what it found).
"""

from __future__ import annotations

import argparse
import heapq
import random
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from benchmarks.report import percentile  # noqa: E402
from benchmarks.workloads.shapes import SHAPES, Shape  # noqa: E402
from pd_router.fleet.holdings import KvView, describe  # noqa: E402
from pd_router.fleet.nodes import make_nodes  # noqa: E402
from pd_router.fleet.prefill import POLICIES, PrefillPolicy, prefix_key  # noqa: E402
from pd_router.sim.kvcache import PrefixCache  # noqa: E402
from pd_router.sim.tokens import chat_tokens, completion_tokens  # noqa: E402

BLOCK = 16


class Clock:
    def __init__(self) -> None:
        self.now = 0.0
        self._events: list[tuple[float, int, Callable[[], None]]] = []
        self._seq = 0

    def at(self, delay: float, action: Callable[[], None]) -> None:
        self._seq += 1
        heapq.heappush(self._events, (self.now + delay, self._seq, action))

    def run(self) -> None:
        while self._events:
            self.now, _, action = heapq.heappop(self._events)
            action()


@dataclass
class Engine:
    cache: PrefixCache
    per_token: float
    busy: bool = False
    queue: list[Callable[[], None]] = field(default_factory=list)
    prompt_tokens: int = 0
    cached_tokens: int = 0
    prefills: int = 0


@dataclass
class Result:
    prompt_tokens: int = 0
    cached_tokens: int = 0
    prefills: list[int] = field(default_factory=list)
    ttfts: list[float] = field(default_factory=list)
    # (TTFT, sent at, session, step, node) of each request, for --trace.
    slow: list[tuple[float, float, int, int, int]] = field(default_factory=list)

    @property
    def share(self) -> float:
        return self.cached_tokens / max(self.prompt_tokens, 1)


def replay(
    shape: Shape,
    policy_name: str,
    engines: int,
    cache_blocks: int,
    per_token: float,
    routers: int = 1,
    hear_delay: float = 0.005,
    trace: bool = False,
    trace_all: bool = False,
    overhead: float = 0.002,
    clients: int = 8,
    rtt: float = 0.0,
    delay: float = 0.0,
    seed: int = 0,
    policies: list[PrefillPolicy] | None = None,
) -> Result:
    clock = Clock()
    if policies is None:
        policies = routers_for(policy_name, engines, cache_blocks, routers)
    views = [policy.view for policy in policies]
    routers = len(policies)
    sims = [Engine(PrefixCache(BLOCK, cache_blocks), per_token) for _ in range(engines)]
    result = Result()
    # The benchmark's routers serve every shape and round in turn: their estimate of the
    # engines' tokens is calibrated after the first answers.
    path, body = shape.sessions[0].step(0, [])
    body = {**body, "model": "sim-model"}
    words = chat_tokens(body) if path.endswith("chat/completions") else completion_tokens(body)
    for view in views:
        view.calibrate(describe(body), len(words))
    pending = list(enumerate(shape.sessions))
    pending.reverse()

    def start_next() -> None:
        if not pending:
            return
        number, session = pending.pop()
        rng = random.Random(f"think-{number}" if not seed else f"think-{seed}-{number}")
        answers: list[str] = []

        def step(index: int) -> None:
            if index == session.steps:
                start_next()
                return
            path, body = session.step(index, answers)
            body = {**body, "model": "sim-model"}
            which = index % routers
            policy, view = policies[which], views[which]
            prompt = describe(body, view.ratio)
            key = prefix_key(body)
            sent = clock.now

            def route() -> None:
                seen = _seen(policy, prompt) if trace else None
                chat = path.endswith("chat/completions")
                tokens = chat_tokens(body) if chat else completion_tokens(body)
                # What each engine holds of it now (the truth the policy predicts).
                truth = [sim.cache.lookup(tokens)[0] for sim in sims]
                node = policy.pick(key, prompt=prompt)
                assert node is not None  # nosec B101
                placement = policy.place(node, key, prompt)
                for other in range(routers):
                    if other != which:
                        target = policies[other]
                        twin = target.nodes[node.id]
                        clock.at(hear_delay, lambda t=target, n=twin: t.heard(n, prompt))
                engine = sims[node.id]

                # The engine looks its cache up when the prefill starts, one at a time.
                def compute() -> None:
                    engine.busy = True
                    cached, hashes = engine.cache.lookup(tokens)
                    work = delay + engine.per_token * (len(tokens) - cached)

                    def done() -> None:
                        engine.cache.insert(hashes)
                        engine.prompt_tokens += len(tokens)
                        engine.cached_tokens += cached
                        engine.prefills += 1
                        engine.busy = False
                        if engine.queue:
                            engine.queue.pop(0)()
                        # The router hears the prefill ended one round trip later.
                        clock.at(rtt, lambda: policy.release(placement))
                        view.calibrate(prompt, len(tokens))
                        if trace and (trace_all or max(truth) > truth[node.id]):
                            # [the first chunk's key, mod 997]: which opening or document.
                            opening = prompt.chunks[0] % 997 if prompt.chunks else "-"
                            print(
                                f"  t={sent:7.3f} s{number:<3} step {index} [{opening:>3}] "
                                f"-> p{node.id} tokens {len(tokens):>5} cached {cached:>5} "
                                f"predicted {placement.cached} held {truth} {seen or ''}"
                            )

                        def first_token() -> None:
                            result.ttfts.append(clock.now - sent)
                            result.slow.append((clock.now - sent, sent, number, index, node.id))
                            answers.append(" " + " ".join(tokens[: shape.answer_tokens]))
                            clock.at(rng.uniform(0, 0.05), lambda: step(index + 1))

                        clock.at(overhead + rtt, first_token)

                    clock.at(work, done)

                if engine.busy:
                    engine.queue.append(compute)
                else:
                    compute()

            clock.at(overhead, route)

        clock.at(rng.uniform(0, 0.05), lambda: step(0))

    for _ in range(clients):
        start_next()
    clock.run()
    if trace:
        for ttft, at, number, index, node_id in sorted(result.slow, reverse=True)[:4]:
            print(f"  slowest: {ttft * 1e3:.1f} ms at t={at:.3f} s{number} step {index} p{node_id}")
    result.prompt_tokens = sum(engine.prompt_tokens for engine in sims)
    result.cached_tokens = sum(engine.cached_tokens for engine in sims)
    result.prefills = [engine.prefills for engine in sims]
    return result


def routers_for(
    policy_name: str, engines: int, cache_blocks: int, routers: int
) -> list[PrefillPolicy]:
    """``routers`` policies, each with its own view of ``engines`` engines."""
    urls = [f"http://p{index}:8100" for index in range(engines)]
    return [
        POLICIES[policy_name](
            make_nodes(urls, 1, role="prefill"), KvView(cache_tokens=cache_blocks * BLOCK)
        )
        for _ in range(routers)
    ]


def _seen(policy: PrefillPolicy, prompt: Any) -> str:
    """Each node as the policy sees it before the pick: held/waiting/recent picks."""
    waiting = getattr(policy, "waiting", {})
    counts = getattr(policy, "_counts", {})
    parts = []
    for node in policy.nodes:
        held = prompt.cached(policy.view.of(node.id).held(prompt.chunks))
        parts.append(f"p{node.id}:{held}/{waiting.get(node.id, 0)}/{counts.get(node.id, 0)}")
    return " ".join(parts)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", nargs="+", choices=list(SHAPES), default=list(SHAPES))
    parser.add_argument("--policies", nargs="+", default=["cost"])
    parser.add_argument("--cache-blocks", type=int, default=400)
    parser.add_argument("--per-token", type=float, default=0.0001)
    parser.add_argument("--routers", type=int, default=1)
    parser.add_argument("--hear-delay", type=float, default=0.005)
    parser.add_argument(
        "--overhead",
        type=float,
        default=0.002,
        help="s from a request's send to its pick, and from its prefill's end to its first token",
    )
    parser.add_argument(
        "--rtt",
        type=float,
        default=0.0,
        help="s a prefill stays in flight at the router after the engine computed it (its "
        "answer's way back; routing_bench's loaded machine: ~0.008)",
    )
    parser.add_argument(
        "--prefill-delay",
        type=float,
        default=0.0,
        help="s each prefill takes besides its uncached tokens (the sim's --prefill-delay; "
        "what handling a request costs a loaded engine)",
    )
    parser.add_argument("--seeds", type=int, default=1, help="runs, each with other think times")
    parser.add_argument(
        "--fresh",
        action="store_true",
        help="a new router for each run (default: one router for every shape and round, "
        "as routing_bench.py runs them)",
    )
    parser.add_argument("--trace", action="store_true", help="print each prefill that missed")
    parser.add_argument("--trace-all", action="store_true", help="print every prefill")
    args = parser.parse_args(argv)
    kept = {
        policy: routers_for(policy, 4, args.cache_blocks, args.routers) for policy in args.policies
    }
    for name in args.shapes:
        for policy, seed in [(p, s) for p in args.policies for s in range(args.seeds)]:
            shape = SHAPES[name](variant=seed)
            best = replay(
                shape,
                "round_robin",
                1,
                1 << 30,
                args.per_token,
                overhead=args.overhead,
                rtt=args.rtt,
                delay=args.prefill_delay,
            )
            run: Any = replay(
                shape,
                policy,
                4,
                args.cache_blocks,
                args.per_token,
                args.routers,
                args.hear_delay,
                args.trace or args.trace_all,
                args.trace_all,
                args.overhead,
                seed=seed,
                policies=None if args.fresh else kept[policy],
                rtt=args.rtt,
                delay=args.prefill_delay,
            )
            counts = run.prefills
            ratio = max(counts) / max(min(counts), 1) if min(counts) else float("inf")
            print(
                f"{name:<12} {policy:<12} routers {args.routers} cached {run.share:6.1%} "
                f"of best {run.share / best.share:6.1%} prefills {counts} max/min {ratio:.2f} "
                f"TTFT p50 {percentile(run.ttfts, 50) * 1e3:.1f} "
                f"p99 {percentile(run.ttfts, 99) * 1e3:.1f} ms",
                flush=True,
            )


if __name__ == "__main__":
    main()

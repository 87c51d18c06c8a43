"""Multi-turn conversations through pd-router: what each --prefill-policy gets from the
prefill engines' prefix caches, in one run.

    python benchmarks/conversations_bench.py            # 64 conversations x 6 turns
    python benchmarks/conversations_bench.py --quick    # 64 x 4: < 60 s

Simulated engines on 127.0.0.1: 4 prefill engines, each with a prefix cache smaller than
the conversations' working set (LRU over 16-token blocks), computing one prefill at a time
at --per-token seconds per uncached token; 2 decode engines. Every conversation shares one
system prompt, and its turns run one after another (all conversations at once, each user
thinking 0-100 ms before a turn); each turn appends the last answer and a new user
message. Per configuration, with every cache emptied first: the share of prompt tokens
served from cache (``cached_tokens`` of the answers), prefill requests per node (max/min),
TTFT p50/p99 as the client sees it.

Configurations, one after the other against the same engines: round_robin (the old
behaviour, the baseline), least_loaded, prefix (the default), prefix through two router
processes that share nothing (turn t goes to router t % 2, so every turn changes router),
and one prefill engine with an unbounded cache (the best hit share any policy can reach).

Then, in this process, the cost of picking a prefill node at 100 and 10,000 distinct
conversations: prefix key + choice + hit bookkeeping per request, against round robin's.
Every process started is stopped by its PID on every exit path, SIGTERM and Ctrl-C
included.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from collections.abc import Sequence
from contextlib import ExitStack
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from benchmarks.processes import raise_on_sigterm, running  # noqa: E402
from benchmarks.workloads.cache_fleet import BLOCK, ROUTER_ARGS, prefill_args  # noqa: E402
from benchmarks.workloads.conversations import Workload, converse  # noqa: E402
from benchmarks.workloads.requests import MODEL  # noqa: E402
from benchmarks.workloads.shapes import Run  # noqa: E402
from pd_router.fleet.nodes import make_nodes  # noqa: E402
from pd_router.fleet.prefill import POLICIES, prefix_key  # noqa: E402
from pd_router.sim.fleet import EngineProcess, RouterProcess  # noqa: E402


def measure(
    name: str, routers: Sequence[RouterProcess], prefill: Sequence[EngineProcess], w: Workload
) -> Run:
    for engine in prefill:
        engine.reset()  # counters and the prefix cache
    run = Run(name)
    asyncio.run(converse([router.url for router in routers], w, run))
    run.prefills = [engine.stats()["requests"] for engine in prefill]
    return run


def pick_cost(conversations: int, nodes: int) -> dict[str, float]:
    """Microseconds per request to key and pick, over ``conversations`` distinct chats."""
    system = "You are a helpful assistant. " * 40
    bodies = [
        {
            "model": MODEL,
            "messages": [
                {"role": "system", "content": system},
                {"role": "user", "content": f"conversation {index}: " + "question " * 40},
                {"role": "assistant", "content": "answer " * 60},
                {"role": "user", "content": "and then? " * 10},
            ],
        }
        for index in range(conversations)
    ]
    urls = [f"http://prefill-{index}:8100" for index in range(nodes)]
    result = {}
    for name in ("round_robin", "prefix"):
        policy = POLICIES[name](make_nodes(urls, 1, role="prefill"))
        best = float("inf")
        for _ in range(3):
            started = time.perf_counter()
            for body in bodies:
                key = prefix_key(body)
                node = policy.pick(key)
                assert node is not None
                policy.recent.record(key, node)
            best = min(best, time.perf_counter() - started)
        result[name] = best / conversations * 1e6
    return result


def targets(runs: list[Run]) -> list[tuple[str, bool]]:
    """What the prefix policy is meant to reach, each with whether this run did. Numbers
    of a shared machine's timing (prefills spill when a node is busy), so reported, not
    enforced: tests/test_conversations_bench.py checks the benchmark's correctness only."""
    by_name = {run.name: run for run in runs}
    best = by_name["1 node, unbounded cache"].cached_share
    prefix, two = by_name["prefix"], by_name["prefix, 2 routers"]
    spread = max(prefix.prefills) / max(min(prefix.prefills), 1)
    return [
        (f"prefix within 90% of the best share: {prefix.cached_share / max(best, 1e-9):.1%}",
         prefix.cached_share >= 0.9 * best),
        (f"2 routers within 5 points of one: {(two.cached_share - prefix.cached_share) * 100:+.1f}",
         two.cached_share >= prefix.cached_share - 0.05),
        (f"prefix 10 points above round_robin: "
         f"{(prefix.cached_share - by_name['round_robin'].cached_share) * 100:+.1f}",
         prefix.cached_share > by_name["round_robin"].cached_share + 0.1),
        (f"prefix prefills per node max/min at most 1.5: {spread:.2f}", spread <= 1.5),
    ]  # fmt: skip


def report(runs: list[Run], best: Run, costs: dict[str, dict[str, float]]) -> None:
    header = (
        f"{'configuration':<28} {'cached':>7} {'of best':>8} {'prefills/node':>17} "
        f"{'max/min':>7} {'TTFT p50':>9} {'p99':>8} {'errors':>6} {'seconds':>7}"
    )
    print(header)
    print("-" * len(header))
    for run in runs:
        counts = run.prefills
        spread = f"{max(counts)}/{min(counts)}" if len(counts) > 1 else f"{counts[0]}"
        ratio = f"{max(counts) / max(min(counts), 1):.2f}" if len(counts) > 1 else "-"
        print(
            f"{run.name:<28} {run.cached_share:>7.1%} "
            f"{run.cached_share / max(best.cached_share, 1e-9):>8.1%} {spread:>17} {ratio:>7} "
            f"{run.ttft(50) * 1e3:>7.1f}ms {run.ttft(99) * 1e3:>6.1f}ms "
            f"{run.errors:>6} {run.seconds:>7.1f}"
        )
    print()
    for where, cost in costs.items():
        print(
            f"pick cost, {where}: prefix {cost['prefix']:.1f} us per request "
            f"(key + choice + hit), round_robin {cost['round_robin']:.1f} us"
        )
    print()
    for target, met in targets(runs):
        print(f"{'met' if met else 'MISSED'}: {target}")


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="4 turns per conversation")
    parser.add_argument("--conversations", type=int, default=64)
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument(
        "--cache-blocks",
        type=int,
        default=1200,
        help="each prefill engine's prefix cache, in 16-token blocks",
    )
    parser.add_argument("--per-token", type=float, default=0.0001, help="prefill s per token")
    parser.add_argument("--json", metavar="PATH", help="also write the numbers as JSON")
    args = parser.parse_args(argv)
    if args.quick:
        args.turns = 4
    workload = Workload(
        args.conversations, args.turns, system_words=200, user_words=60, answer_tokens=60
    )
    engine_args, bounded = prefill_args(args.per_token, args.cache_blocks)
    decode_args = ["--slots", "512", "--ttft", "0", "--itl", "0"]
    with ExitStack() as stack:
        # SIGTERM unwinds like Ctrl-C does, through this stack that stops every process.
        stack.callback(raise_on_sigterm())
        prefill = [EngineProcess("prefill", bounded) for _ in range(4)]
        single = EngineProcess("prefill", engine_args)
        decode = [EngineProcess("decode", decode_args) for _ in range(2)]
        engines = [*prefill, single, *decode]
        urls = [engine.url for engine in prefill]
        decode_urls = [engine.url for engine in decode]

        def router(prefill_urls: list[str], policy: str) -> RouterProcess:
            process = RouterProcess(prefill_urls, decode_urls, "--prefill-policy", policy)
            process.extra_args += ROUTER_ARGS
            return process

        routers = {
            policy: router(urls, policy) for policy in ("round_robin", "least_loaded", "prefix")
        }
        second = router(urls, "prefix")
        unbounded = router([single.url], "round_robin")
        processes = [*engines, *routers.values(), second, unbounded]
        stack.enter_context(running(processes))
        print(
            f"{workload.conversations} conversations x {workload.turns} turns, system prompt "
            f"{workload.system_words} words, {workload.user_words} per user turn, "
            f"{workload.answer_tokens}-token answers; 4 prefill engines, "
            f"{args.cache_blocks} blocks of {BLOCK} tokens of cache each, "
            f"{args.per_token * 1e6:.0f} us per uncached token, one prefill at a time",
            flush=True,
        )
        runs = [
            measure(policy, [process], prefill, workload) for policy, process in routers.items()
        ]
        runs.append(measure("prefix, 2 routers", [routers["prefix"], second], prefill, workload))
        best = measure("1 node, unbounded cache", [unbounded], [single], workload)
        runs.append(best)
    # The same cost at 100 and 10,000 conversations: nothing is searched per conversation.
    costs = {
        f"{conversations:,} conversations, {nodes} nodes": pick_cost(conversations, nodes)
        for conversations, nodes in ((100, 4), (10_000, 4), (10_000, 32))
    }
    print()
    report(runs, best, costs)
    if args.json:
        document = {
            "workload": vars(workload),
            "cache_blocks": args.cache_blocks,
            "runs": [
                {
                    "name": run.name,
                    "cached_share": run.cached_share,
                    "prefills": run.prefills,
                    "ttft_p50": run.ttft(50),
                    "ttft_p99": run.ttft(99),
                    "errors": run.errors,
                    "failures": dict(run.failures),
                    "seconds": run.seconds,
                }
                for run in runs
            ],
            "pick_cost_us": costs,
            "targets": [{"target": target, "met": met} for target, met in targets(runs)],
        }
        Path(args.json).write_text(json.dumps(document, indent=2))


if __name__ == "__main__":
    main()

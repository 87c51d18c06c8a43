"""Where prefills go, measured: four workload shapes through each prefill policy, beside
round_robin and vllm-router's cache_aware on the same engines, in one run.

    python benchmarks/routing_bench.py                       # ~4 minutes
    python benchmarks/routing_bench.py --shapes chat rag     # some shapes only
    python benchmarks/routing_bench.py --configs cost round_robin pair --rounds 5
    python benchmarks/routing_bench.py --install-vllm-router # once: gets vllm-router 0.1.17

Simulated engines on 127.0.0.1: 4 prefill engines with ``--cache-blocks`` 16-token blocks of
LRU prefix cache each, computing one prefill at a time at ``--per-token`` seconds per
uncached token; 2 decode engines. The ceiling is one prefill engine with an unbounded
cache: every prompt token any earlier request computed is a hit there. Per shape
(``benchmarks/workloads/shapes.py``) and configuration, every cache emptied first, 8
sessions at a time: the prompt tokens the prefill engines served from cache as a share of
the ceiling's share, prefills per engine (max/min), TTFT p50/p99 as the client sees it.

Configurations (``--configs``): pd-router with ``--prefill-policy cost`` (told each engine's
cache size), the same with ``--max-local-prefill``, ``prefix`` and ``round_robin``;
vllm-router ``--policy cache_aware`` (if installed, see benchmarks/README.md); and ``cost``
through two routers sharing ``--state`` (a redis-server of the benchmark's own,
``tests/redis_server.py``), every step of a session through the other one. Each shape runs
``--rounds`` times per configuration, interleaved, each round with other words; the table
gives medians over rounds and each TTFT against round_robin's, then whether ``cost`` met
issue 20's targets (on chat, completions, rag and agent; under ``short``, the TTFT with
``--max-local-prefill`` against without). Every process started is stopped by its PID on
every exit path.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
from collections import Counter
from collections.abc import Sequence
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from benchmarks.processes import (  # noqa: E402
    VllmRouterProcess,
    find_vllm_router,
    install_vllm_router,
    raise_on_sigterm,
    running,
)
from benchmarks.workloads.cache_fleet import BLOCK, ROUTER_ARGS, prefill_args  # noqa: E402
from benchmarks.workloads.shapes import SHAPES, Run, Shape, play  # noqa: E402
from pd_router.sim.fleet import EngineProcess, RouterProcess, ServerProcess  # noqa: E402
from tests.redis_server import RedisServer  # noqa: E402


def measure(
    name: str,
    routers: Sequence[ServerProcess],
    prefill: Sequence[EngineProcess],
    others: Sequence[EngineProcess],
    shape: Shape,
) -> Run:
    for engine in [*prefill, *others]:
        engine.reset()  # counters and the prefix cache
    run = Run(name)
    asyncio.run(play([router.url for router in routers], shape, run))
    stats = [engine.stats() for engine in prefill]
    run.prefills = [stat["requests"] for stat in stats]
    # Decode engines count only the prompts they computed themselves (local prefills).
    every = [*stats, *(engine.stats() for engine in others)]
    run.prompt_tokens = sum(stat["prompt_tokens"] for stat in every)
    run.cached_tokens = sum(stat["cached_tokens"] for stat in every)
    return run


# The configurations, by the short name ``--configs`` takes, and their labels.
COST, LOCAL, PREFIX, ROUND_ROBIN, CACHE_AWARE, PAIR, CEILING = (
    "cost",
    "local",
    "prefix",
    "round_robin",
    "cache_aware",
    "pair",
    "ceiling",
)
CONFIGS = (COST, LOCAL, PREFIX, ROUND_ROBIN, CACHE_AWARE, PAIR, CEILING)
# Issue 20's targets for ``cost``, per shape, in one run, on the issue's four workloads
# (``short`` is what ``--max-local-prefill`` is for: its TTFT with and without is printed).
TARGET_SHAPES = ("chat", "completions", "rag", "agent")
TARGET_OF_BEST = 0.95
TARGET_MAX_MIN = 1.5
TARGET_PAIR_POINTS = 3.0


@dataclass
class Rounds:
    """One configuration's runs of one shape, a run per round."""

    label: str
    runs: list[Run] = field(default_factory=list)

    def share(self) -> float:
        return statistics.median(run.cached_share for run in self.runs)

    def ttft(self, q: float) -> float:
        """The median over rounds of each round's percentile: one slow round (another
        job's burst on this shared machine) moves it no more than one fast one."""
        return statistics.median(run.ttft(q) for run in self.runs)

    def spread(self) -> float:
        """Prefills per engine, max over min (inf: an engine unused), the median round's."""
        return statistics.median(_spread(run.prefills) for run in self.runs)

    def worst_spread(self) -> float:
        return max(_spread(run.prefills) for run in self.runs)

    def errors(self) -> int:
        return sum(run.errors for run in self.runs)


def _spread(counts: list[int]) -> float:
    if len(counts) < 2:
        return 1.0
    return max(counts) / min(counts) if min(counts) else float("inf")


def report(shape: str, results: dict[str, Rounds]) -> dict[str, bool]:
    """Print one shape's table and cost's targets (``short``: local prefill's TTFT
    against cost's); the targets, met or not."""
    best = results[CEILING].share()
    rr = results.get(ROUND_ROBIN)
    print(f"\n{shape} (medians over {len(results[CEILING].runs)} rounds)")
    print(
        f"  {'configuration':<30} {'cached':>7} {'of best':>8} {'prefills/node':>19} "
        f"{'max/min (worst)':>15} {'TTFT p50':>9} {'p99':>8} {'p50/rr':>7} {'p99/rr':>7} "
        f"{'errors':>6}"
    )
    for name, rounds in results.items():
        last = rounds.runs[-1].prefills
        spread = rounds.spread()
        vs = ["-", "-"]
        if rr is not None:
            vs = [f"{rounds.ttft(q) / rr.ttft(q):.2f}" for q in (50, 99)]
        print(
            f"  {rounds.label:<30} {rounds.share():>7.1%} {rounds.share() / best:>8.1%} "
            f"{'/'.join(map(str, last)):>19} "
            f"{'-' if len(last) < 2 else f'{spread:.2f} ({rounds.worst_spread():.2f})':>15} "
            f"{rounds.ttft(50) * 1e3:>7.1f}ms {rounds.ttft(99) * 1e3:>6.1f}ms "
            f"{vs[0]:>7} {vs[1]:>7} {rounds.errors():>6}",
            flush=True,
        )
    cost = results.get(COST)
    if cost is None:
        return {}
    if shape not in TARGET_SHAPES:
        local = results.get(LOCAL)
        if local is not None:
            print(
                f"  local prefill: TTFT p50 {local.ttft(50) * 1e3:.1f} against "
                f"{cost.ttft(50) * 1e3:.1f} ms without, p99 {local.ttft(99) * 1e3:.1f} "
                f"against {cost.ttft(99) * 1e3:.1f} ms"
            )
        return {}
    met: dict[str, bool] = {}
    share = cost.share() / best
    met["share"] = share >= TARGET_OF_BEST
    lines = [f"of best {share:.1%} >= {TARGET_OF_BEST:.0%}"]
    met["spread"] = cost.spread() <= TARGET_MAX_MIN
    lines.append(
        f"max/min {cost.spread():.2f} <= {TARGET_MAX_MIN} (worst round {cost.worst_spread():.2f})"
    )
    if rr is not None:
        for q in (50, 99):
            met[f"p{q}"] = cost.ttft(q) <= rr.ttft(q)
            lines.append(
                f"TTFT p{q} {cost.ttft(q) * 1e3:.1f} <= round_robin's {rr.ttft(q) * 1e3:.1f} ms"
            )
    pair = results.get(PAIR)
    if pair is not None:
        points = (pair.share() - cost.share()) / best * 100
        met["pair"] = abs(points) <= TARGET_PAIR_POINTS
        lines.append(f"2 routers {points:+.1f} points of best, within {TARGET_PAIR_POINTS:.0f}")
    for line, ok in zip(lines, met.values(), strict=True):
        print(f"  target {'met ' if ok else 'MISSED'}  cost: {line}")
    return met


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", nargs="+", choices=list(SHAPES), default=list(SHAPES))
    parser.add_argument(
        "--configs",
        nargs="+",
        choices=CONFIGS,
        default=list(CONFIGS),
        help="configurations to run (the ceiling always runs)",
    )
    parser.add_argument("--rounds", type=int, default=3, help="runs of each, interleaved")
    parser.add_argument("--cache-blocks", type=int, default=400)
    parser.add_argument("--per-token", type=float, default=0.0001, help="prefill s per token")
    parser.add_argument(
        "--local", type=int, default=64, help="--max-local-prefill of the local-prefill row"
    )
    parser.add_argument("--vllm-router", metavar="PATH", help="the vllm-router executable")
    parser.add_argument("--install-vllm-router", action="store_true")
    parser.add_argument("--no-vllm-router", action="store_true")
    parser.add_argument("--json", metavar="PATH", help="also write the numbers as JSON")
    parser.add_argument(
        "--logs",
        metavar="DIR",
        help="keep each pd-router's log in DIR (CONFIG.log, a request's line each, JSON)",
    )
    args = parser.parse_args(argv)
    if args.logs is not None:
        Path(args.logs).mkdir(parents=True, exist_ok=True)
    configs = set(args.configs) | {CEILING}
    executable = None
    if CACHE_AWARE in configs and not args.no_vllm_router:
        executable = args.vllm_router or find_vllm_router()
        if executable is None and args.install_vllm_router:
            executable = install_vllm_router(300)
        if executable is None:
            print("vllm-router not found: its rows are skipped (--install-vllm-router)")
    if executable is None:
        configs.discard(CACHE_AWARE)
    engine_args, bounded = prefill_args(args.per_token, args.cache_blocks)
    # --standalone: a request without kv_transfer_params is computed there (a local
    # prefill), at the prefill engines' speed, with a prefix cache of its own.
    decode_args = [
        *("--block-size", str(BLOCK), "--prefill-per-token", str(args.per_token)),
        *("--standalone", "--slots", "512", "--ttft", "0", "--itl", "0"),
    ]
    document: dict[str, Any] = {
        "cache_blocks": args.cache_blocks,
        "rounds": args.rounds,
        "shapes": {},
    }
    with ExitStack() as stack:
        stack.callback(raise_on_sigterm())
        prefill = [EngineProcess("prefill", bounded) for _ in range(4)]
        single = EngineProcess("prefill", engine_args)
        decode = [EngineProcess("decode", decode_args) for _ in range(2)]
        urls = [engine.url for engine in prefill]
        decode_urls = [engine.url for engine in decode]

        def router(name: str, prefill_urls: list[str], *extra: str) -> RouterProcess:
            if args.logs is None:
                return RouterProcess(prefill_urls, decode_urls, *extra, *ROUTER_ARGS)
            logged = [*ROUTER_ARGS, "--log-level", "info", "--log-format", "json"]
            log = Path(args.logs) / f"{name}.log"
            return RouterProcess(prefill_urls, decode_urls, *extra, *logged, log_path=log)

        cache_tokens = str(args.cache_blocks * BLOCK)
        cost = ["--prefill-policy", "cost", "--engine-cache-tokens", cache_tokens]
        # name: (label, its routers, the prefill engines it sends to)
        setups: dict[str, tuple[str, list[ServerProcess], list[EngineProcess]]] = {}
        if COST in configs:
            setups[COST] = ("cost", [router(COST, urls, *cost)], prefill)
        if LOCAL in configs:
            local = [router(LOCAL, urls, *cost, "--max-local-prefill", str(args.local))]
            setups[LOCAL] = (f"cost, --max-local-prefill {args.local}", local, prefill)
        if PREFIX in configs:
            setups[PREFIX] = (
                "prefix",
                [router(PREFIX, urls, "--prefill-policy", "prefix")],
                prefill,
            )
        if ROUND_ROBIN in configs:
            setups[ROUND_ROBIN] = (
                "round_robin",
                [router(ROUND_ROBIN, urls, "--prefill-policy", "round_robin")],
                prefill,
            )
        if executable is not None:
            vllm_router = VllmRouterProcess(executable, urls, decode_urls, policy="cache_aware")
            setups[CACHE_AWARE] = ("vllm-router cache_aware", [vllm_router], prefill)
        if PAIR in configs:
            redis = stack.enter_context(RedisServer())
            pair: list[ServerProcess] = [
                router(f"{PAIR}-{index}", urls, *cost, "--state", redis.url) for index in range(2)
            ]
            setups[PAIR] = ("cost, 2 routers, --state", pair, prefill)
        ceiling = router(CEILING, [single.url], "--prefill-policy", "round_robin")
        setups[CEILING] = ("1 node, unbounded cache", [ceiling], [single])
        processes: list[ServerProcess] = [*prefill, single, *decode]
        processes += [process for _, routers, _ in setups.values() for process in routers]
        stack.enter_context(running(processes))
        print(
            f"4 prefill engines, {args.cache_blocks} blocks of {BLOCK} tokens of cache each, "
            f"{args.per_token * 1e6:.0f} us per uncached token, one prefill at a time; "
            f"2 decode engines; 8 sessions at a time; {args.rounds} rounds, the "
            "configurations interleaved (each round in another order)",
            flush=True,
        )
        names = list(setups)
        missed: list[str] = []
        for shape_name in args.shapes:
            results = {name: Rounds(setups[name][0]) for name in names}
            for number in range(args.rounds):
                # Each round the shape with other words: no router (nor engine, though
                # each run empties their caches) has seen its prompts before.
                shape = SHAPES[shape_name](variant=number)
                # Rotated each round: no configuration always runs first, or after the
                # heaviest one.
                turn = number % len(names)
                for name in names[turn:] + names[:turn]:
                    label, routers, engines = setups[name]
                    others = [*decode, *(engine for engine in prefill if engine not in engines)]
                    results[name].runs.append(measure(label, routers, engines, others, shape))
            met = report(shape_name, results)
            missed += [f"{shape_name}: {target}" for target, ok in met.items() if not ok]
            document["shapes"][shape_name] = {
                "targets": met,
                "configurations": [
                    {
                        "name": rounds.label,
                        "cached_share": rounds.share(),
                        "of_best": rounds.share() / results[CEILING].share(),
                        "prefills": [run.prefills for run in rounds.runs],
                        "max_min": rounds.spread(),
                        "max_min_worst": rounds.worst_spread(),
                        "ttft_p50": rounds.ttft(50),
                        "ttft_p99": rounds.ttft(99),
                        "errors": rounds.errors(),
                        "failures": dict(sum((run.failures for run in rounds.runs), Counter())),
                    }
                    for rounds in results.values()
                ],
            }
        if COST in configs:
            print(f"\ncost's targets: {'all met' if not missed else 'missed ' + ', '.join(missed)}")
    if args.json:
        Path(args.json).write_text(json.dumps(document, indent=2))


if __name__ == "__main__":
    main()

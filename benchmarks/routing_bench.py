"""Where prefills go, measured: four workload shapes through each prefill policy, beside
round_robin and vllm-router's cache_aware on the same engines, in one run.

    python benchmarks/routing_bench.py                       # ~5 minutes
    python benchmarks/routing_bench.py --shapes chat rag     # some shapes only
    python benchmarks/routing_bench.py --install-vllm-router # once: gets vllm-router 0.1.17

Simulated engines on 127.0.0.1: 4 prefill engines with ``--cache-blocks`` 16-token blocks of
LRU prefix cache each, computing one prefill at a time at ``--per-token`` seconds per
uncached token; 2 decode engines. The ceiling is one prefill engine with an unbounded
cache: every prompt token any earlier request computed is a hit there. Per shape
(``benchmarks/workloads/shapes.py``) and configuration, every cache emptied first, 8
sessions at a time: the prompt tokens the prefill engines served from cache as a share of
the ceiling's share, prefills per engine (max/min), TTFT p50/p99 as the client sees it.

Configurations: pd-router with ``--prefill-policy cost`` (told each engine's cache size),
the same with ``--max-local-prefill``, ``prefix`` and ``round_robin``; vllm-router
``--policy cache_aware`` (if installed, see benchmarks/README.md); and ``cost`` through two
routers sharing ``--state`` (a redis-server of the benchmark's own,
``tests/redis_server.py``), every step of a session through the other one.
Every process started is stopped by its PID on every exit path.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from collections.abc import Sequence
from contextlib import ExitStack
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from benchmarks.processes import (  # noqa: E402
    VllmRouterProcess,
    find_vllm_router,
    install_vllm_router,
    raise_on_sigterm,
)
from benchmarks.workloads.shapes import SHAPES, Run, Shape, play  # noqa: E402
from pd_router.sim.fleet import EngineProcess, RouterProcess, ServerProcess  # noqa: E402
from tests.redis_server import RedisServer  # noqa: E402

BLOCK = 16


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


def report(shape: str, runs: list[Run], best: Run) -> None:
    print(f"\n{shape}")
    header = (
        f"  {'configuration':<30} {'cached':>7} {'of best':>8} {'prefills/node':>19} "
        f"{'max/min':>7} {'TTFT p50':>9} {'p99':>8} {'errors':>6}"
    )
    print(header)
    for run in [*runs, best]:
        counts = run.prefills
        spread = "/".join(str(count) for count in counts)
        ratio = f"{max(counts) / max(min(counts), 1):.2f}" if len(counts) > 1 else "-"
        if len(counts) > 1 and min(counts) == 0:
            ratio = "inf"
        print(
            f"  {run.name:<30} {run.cached_share:>7.1%} "
            f"{run.cached_share / max(best.cached_share, 1e-9):>8.1%} {spread:>19} {ratio:>7} "
            f"{run.ttft(50) * 1e3:>7.1f}ms {run.ttft(99) * 1e3:>6.1f}ms {run.errors:>6}",
            flush=True,
        )


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", nargs="+", choices=list(SHAPES), default=list(SHAPES))
    parser.add_argument("--cache-blocks", type=int, default=400)
    parser.add_argument("--per-token", type=float, default=0.0001, help="prefill s per token")
    parser.add_argument(
        "--local", type=int, default=64, help="--max-local-prefill of the local-prefill row"
    )
    parser.add_argument("--vllm-router", metavar="PATH", help="the vllm-router executable")
    parser.add_argument("--install-vllm-router", action="store_true")
    parser.add_argument("--no-vllm-router", action="store_true")
    parser.add_argument("--json", metavar="PATH", help="also write the numbers as JSON")
    args = parser.parse_args(argv)
    executable = None
    if not args.no_vllm_router:
        executable = args.vllm_router or find_vllm_router()
        if executable is None and args.install_vllm_router:
            executable = install_vllm_router(300)
        if executable is None:
            print("vllm-router not found: its rows are skipped (--install-vllm-router)")
    engine_args = [
        "--block-size",
        str(BLOCK),
        "--prefill-per-token",
        str(args.per_token),
        "--prefill-concurrency",
        "1",
    ]
    bounded = [*engine_args, "--prefix-cache-blocks", str(args.cache_blocks)]
    # --standalone: a request without kv_transfer_params is computed there (a local
    # prefill), at the prefill engines' speed, with a prefix cache of its own.
    decode_args = [
        *("--block-size", str(BLOCK), "--prefill-per-token", str(args.per_token)),
        *("--standalone", "--slots", "512", "--ttft", "0", "--itl", "0"),
    ]
    router_args = ["--decode-slots", "256", "--queue-timeout", "60", "--log-level", "warning"]
    document: dict[str, object] = {"cache_blocks": args.cache_blocks, "shapes": {}}
    with ExitStack() as stack:
        stack.callback(raise_on_sigterm())
        prefill = [EngineProcess("prefill", bounded) for _ in range(4)]
        single = EngineProcess("prefill", engine_args)
        decode = [EngineProcess("decode", decode_args) for _ in range(2)]
        urls = [engine.url for engine in prefill]
        decode_urls = [engine.url for engine in decode]

        def router(prefill_urls: list[str], *extra: str) -> RouterProcess:
            process = RouterProcess(prefill_urls, decode_urls, *extra)
            process.extra_args += router_args
            return process

        cache_tokens = str(args.cache_blocks * BLOCK)
        routers: dict[str, ServerProcess] = {
            "cost": router(urls, "--prefill-policy", "cost", "--engine-cache-tokens", cache_tokens),
            f"cost, --max-local-prefill {args.local}": router(
                urls,
                "--prefill-policy",
                "cost",
                "--engine-cache-tokens",
                cache_tokens,
                "--max-local-prefill",
                str(args.local),
            ),
            "prefix": router(urls, "--prefill-policy", "prefix"),
            "round_robin": router(urls, "--prefill-policy", "round_robin"),
        }
        if executable is not None:
            routers["vllm-router cache_aware"] = VllmRouterProcess(
                executable, urls, decode_urls, policy="cache_aware"
            )
        ceiling = router([single.url], "--prefill-policy", "round_robin")
        redis = stack.enter_context(RedisServer())
        shared = ["--prefill-policy", "cost", "--engine-cache-tokens", cache_tokens]
        pair = [router(urls, *shared, "--state", redis.url) for _ in range(2)]
        processes: list[ServerProcess] = [
            *prefill,
            single,
            *decode,
            *routers.values(),
            *pair,
            ceiling,
        ]
        for process in processes:
            stack.callback(process.stop)
            process.start()
        for process in processes:
            process.wait_healthy(60)
        print(
            f"4 prefill engines, {args.cache_blocks} blocks of {BLOCK} tokens of cache each, "
            f"{args.per_token * 1e6:.0f} us per uncached token, one prefill at a time; "
            "2 decode engines; 8 sessions at a time",
            flush=True,
        )
        for name in args.shapes:
            shape = SHAPES[name]()
            runs = [
                measure(label, [process], prefill, decode, shape)
                for label, process in routers.items()
            ]
            runs.append(measure("cost, 2 routers, --state", pair, prefill, decode, shape))
            best = measure("1 node, unbounded cache", [ceiling], [single], decode, shape)
            report(name, runs, best)
            document["shapes"][name] = [  # type: ignore[index]
                {
                    "name": run.name,
                    "cached_share": run.cached_share,
                    "of_best": run.cached_share / max(best.cached_share, 1e-9),
                    "prefills": run.prefills,
                    "ttft_p50": run.ttft(50),
                    "ttft_p99": run.ttft(99),
                    "errors": run.errors,
                }
                for run in [*runs, best]
            ]
    if args.json:
        Path(args.json).write_text(json.dumps(document, indent=2))


if __name__ == "__main__":
    main()

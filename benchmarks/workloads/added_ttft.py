"""Workload B, added TTFT: one client, one request at a time, every mode interleaved."""

from __future__ import annotations

import statistics
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from benchmarks.report import percentile
from benchmarks.workloads.requests import (
    FILLER,
    PATH,
    completion_body,
    manual_pd,
    new_session,
    stream_completion,
)


@dataclass
class LatencySummary:
    mode: str
    samples: int
    errors: dict[str, int]
    p50_ms: float
    p90_ms: float
    p99_ms: float
    mean_ms: float


def summarize(mode: str, seconds: Sequence[float], errors: Counter[str]) -> LatencySummary:
    ms = [s * 1000.0 for s in seconds] or [float("nan")]
    return LatencySummary(
        mode=mode,
        samples=len(seconds),
        errors=dict(errors),
        p50_ms=percentile(ms, 50),
        p90_ms=percentile(ms, 90),
        p99_ms=percentile(ms, 99),
        mean_ms=statistics.fmean(ms),
    )


async def added_ttft(
    routers: dict[str, str],
    prefill_url: str,
    decode_urls: Sequence[str],
    *,
    requests: int,
    tokens: int,
    warmup: int,
) -> dict[str, LatencySummary]:
    """One client, one request at a time, every mode interleaved in rotating order.

    ``routers`` maps a mode name to a router's base URL; ``direct`` and ``manual_pd`` are
    always there.
    """
    samples: dict[str, list[float]] = {"direct": [], "manual_pd": []}
    samples.update({mode: [] for mode in routers})
    errors: dict[str, Counter[str]] = {mode: Counter() for mode in samples}
    prefill_times: list[float] = []
    modes = list(samples)
    async with new_session() as session:
        for i in range(warmup + requests):
            measured = i >= warmup
            decode_url = decode_urls[i % len(decode_urls)]
            for j in range(len(modes)):
                mode = modes[(i + j) % len(modes)]
                body = completion_body(f"ttft-{mode}-{i} {FILLER}", tokens)
                if mode == "direct":
                    result = await stream_completion(
                        session, decode_url + PATH, body, want_ttft=True
                    )
                elif mode == "manual_pd":
                    result, prefill_time = await manual_pd(session, prefill_url, decode_url, body)
                    if measured and result.ok:
                        prefill_times.append(prefill_time)
                else:
                    result = await stream_completion(
                        session, routers[mode] + PATH, body, want_ttft=True
                    )
                if not measured:
                    continue
                if result.ok and result.ttft is not None:
                    samples[mode].append(result.ttft)
                else:
                    errors[mode][result.error or "no_text"] += 1
    summary = {mode: summarize(mode, samples[mode], errors[mode]) for mode in modes}
    summary["prefill_hop"] = summarize("prefill_hop", prefill_times, Counter())
    return summary

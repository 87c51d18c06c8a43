"""/metrics with ``--workers N``: every worker's series, whichever worker is asked.

The kernel hands each connection to one worker, so a scrape reaches one of them at
random. Were it to answer for itself alone, counters would jump between scrapes (8, 2, 8:
a reset to Prometheus each time) and gauges would say one worker's share. So each worker
writes what its registry holds to a file of its own in a directory the parent made, once
a second (``SNAPSHOT_EVERY``), and the worker asked answers with its own series as they
are now and the others' as last written, every series labelled ``worker``: Prometheus
sums them (``sum without (worker) (rate(pd_router_requests_total[5m]))``), and a worker
started again is a counter reset of its own series only. A file not rewritten for
``STALE_AFTER`` seconds (a worker that died and was not started again) is left out.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import orjson
from prometheus_client import generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector, CollectorRegistry
from prometheus_client.samples import Sample

SNAPSHOT_EVERY = 1.0
# Several missed rewrites: a worker whose loop is that late is not serving either.
STALE_AFTER = 10.0
LABEL = "worker"


class GatheredMetrics:
    """One worker's part: its snapshots written, and the answer that gathers them all."""

    def __init__(self, registry: CollectorRegistry, worker: int, directory: Path) -> None:
        self.registry = registry
        self.directory = directory
        self.worker = worker
        self._path = directory / f"{worker}.json"

    async def run(self) -> None:
        while True:
            self.write()
            await anyio.sleep(SNAPSHOT_EVERY)

    def write(self) -> None:
        """This worker's series, replacing its last file at once (a reader never sees half).
        Nothing when the directory is gone: the workers are ending without their parent."""
        data = orjson.dumps([_dumped(family) for family in self.registry.collect()])
        partial = self._path.with_suffix(".tmp")
        try:
            partial.write_bytes(data)
            os.replace(partial, self._path)
        except FileNotFoundError:
            pass

    def exposition(self) -> bytes:
        return generate_latest(_Gathered(self))

    def families(self) -> Iterator[Metric]:
        """Every worker's families, merged by name, each sample labelled by its worker."""
        merged: dict[str, Metric] = {}
        for worker, families in self._all():
            for name, documentation, kind, unit, samples in families:
                family = merged.get(name)
                if family is None:
                    family = merged[name] = Metric(name, documentation, kind, unit)
                family.samples += [
                    # JSON has no NaN or infinities: orjson writes them as null.
                    Sample(sample, {**labels, LABEL: worker}, math.nan if value is None else value)
                    for sample, labels, value in samples
                ]
        return iter(merged.values())

    def _all(self) -> Iterator[tuple[str, list[Any]]]:
        yield str(self.worker), [_dumped(family) for family in self.registry.collect()]
        now = time.time()
        for path in sorted(self.directory.glob("*.json")):
            if path == self._path:
                continue
            try:
                if now - path.stat().st_mtime > STALE_AFTER:
                    continue
                yield path.stem, orjson.loads(path.read_bytes())
            except (OSError, orjson.JSONDecodeError):
                continue  # gone meanwhile: that worker is left out of this answer


class _Gathered(Collector):
    def __init__(self, gathered: GatheredMetrics) -> None:
        self.gathered = gathered

    def collect(self) -> Iterator[Metric]:
        return self.gathered.families()


def _dumped(family: Metric) -> list[Any]:
    samples = [[s.name, s.labels, s.value] for s in family.samples]
    return [family.name, family.documentation, family.type, family.unit, samples]

"""The prefill engine's KV blocks: pinned under a lease until a decode engine pulls them."""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass


@dataclass
class _Pinned:
    tokens: list[str]
    block_ids: list[int]
    deadline: float


class PinnedBlocks:
    """Blocks held for remote decode, like vLLM's producer-side ``kv_lease``.

    Every pin uses the same lease, so insertion order is deadline order and expiry only has
    to look at the oldest entries.
    """

    def __init__(
        self, block_size: int, lease: float, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.block_size = block_size
        self.lease = lease
        self._clock = clock
        self._next_block = itertools.count()
        self._entries: dict[str, _Pinned] = {}
        self._pinned = 0

    @property
    def blocks_pinned(self) -> int:
        return self._pinned

    def pin(self, request_id: str, tokens: list[str]) -> list[int]:
        """Allocate and pin the blocks that hold ``tokens``; returns their ids."""
        # A reused request id replaces its earlier, never-pulled entry.
        self._free(request_id)
        count = -(-len(tokens) // self.block_size)
        block_ids = [next(self._next_block) for _ in range(count)]
        self._entries[request_id] = _Pinned(tokens, block_ids, self._clock() + self.lease)
        self._pinned += count
        return block_ids

    def pull(self, request_id: str, block_ids: list[int]) -> list[str] | None:
        """The tokens behind the blocks, freeing them; None if not pinned (any more)."""
        entry = self._entries.get(request_id)
        if entry is None or entry.block_ids != block_ids:
            return None
        self._free(request_id)
        return entry.tokens

    def expire(self) -> int:
        """Free every entry whose lease has run out; returns how many blocks were freed."""
        now = self._clock()
        freed = 0
        while self._entries:
            request_id, entry = next(iter(self._entries.items()))
            if entry.deadline > now:
                break
            freed += len(entry.block_ids)
            self._free(request_id)
        return freed

    def _free(self, request_id: str) -> None:
        entry = self._entries.pop(request_id, None)
        if entry is not None:
            self._pinned -= len(entry.block_ids)


class PrefixCache:
    """Which full-block prefixes this engine has computed, for ``cached_tokens``: an LRU of
    ``capacity`` blocks, as vLLM's prefix caching evicts the least recently used free block.
    """

    def __init__(self, block_size: int, capacity: int = 1 << 20) -> None:
        self.block_size = block_size
        self.capacity = capacity
        # A dict is an insertion-ordered set: re-inserting a hash on use makes it an LRU.
        self._seen: dict[int, None] = {}

    @property
    def blocks(self) -> int:
        return len(self._seen)

    def clear(self) -> None:
        self._seen.clear()

    def _prefix_hashes(self, tokens: list[str]) -> list[int]:
        # Chained like vLLM's block hashes: block k's hash covers tokens[0:(k+1)*block_size]
        # without rehashing the whole prefix each time.
        hashes: list[int] = []
        parent = 0
        size = self.block_size
        for start in range(0, len(tokens) - size + 1, size):
            parent = hash((parent, tuple(tokens[start : start + size])))
            hashes.append(parent)
        return hashes

    def lookup(self, tokens: list[str]) -> tuple[int, list[int]]:
        """Tokens served from cache (the leading full blocks it holds), and the prompt's
        block hashes, for ``insert`` once they are computed."""
        hashes = self._prefix_hashes(tokens)
        hits = 0
        for block_hash in hashes:
            if block_hash not in self._seen:
                break
            hits += 1
        return hits * self.block_size, hashes

    def insert(self, hashes: list[int]) -> tuple[list[int], list[int]]:
        """The blocks were used (computed or read): most recent now, the oldest evicted.
        Returns the hashes newly stored, in prompt order, and those evicted (for KV events).

        vLLM frees a finished request's blocks last to first
        (``free_blocks(reversed(...))`` in ``single_type_kv_cache_manager.py``), so a
        prompt's tail is evicted before its opening; touching them in that order here does
        the same."""
        stored = []
        for block_hash in reversed(hashes):
            if block_hash in self._seen:
                del self._seen[block_hash]
            else:
                stored.append(block_hash)
            self._seen[block_hash] = None
        stored.reverse()
        removed = []
        while len(self._seen) > self.capacity:
            oldest = next(iter(self._seen))
            del self._seen[oldest]
            removed.append(oldest)
        return stored, removed

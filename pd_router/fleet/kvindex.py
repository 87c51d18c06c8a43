"""What an engine holds, block by block, as its KV events say, in token space. No I/O.

vLLM's block hashes chain from a seed the router does not know (``PYTHONHASHSEED``, the hash
algorithm), but a ``BlockStored`` event carries each block's token ids and its parent's hash.
So the router gives every block a key of its own: ``hash((parent's key, token ids))``, the
first block's parent key 0; a prompt's token ids, cut into blocks of the engine's size, chain
to the same keys. An engine's ``BlockIndex`` is then the exact set of blocks it holds
(``BlockStored`` adds, ``BlockRemoved`` takes out, ``AllBlocksCleared`` empties), and how
many leading blocks of a prompt it holds is a lookup per block (a binary search: vLLM frees a
request's blocks last first and a child block is only reachable through its parent, so what
it holds is prefix-closed).

The router sees text, not tokens, when it picks: it learns a prompt's token ids from the
prefill engine's answer (``return_token_ids``) and ``Links`` remembers them under the
prompt's text: the key of its last whole chunk (``holdings.chunk_keys``), with a checksum of
the bytes after it. A conversation's next turn starts with the whole previous turn: its
chunks find that link, and its bytes after the chunk match the checksum, so every block of
the previous turn is a block of this one; the engines' indexes tell how many of them each
holds. A prompt that shares only the link's chunks (not the bytes after them) is given the
blocks the shared bytes surely cover (their share of the tokens, less a block). Links are an
LRU bounded by the block keys they hold; a prompt with no link is predicted
(``holdings.py``).
"""

from __future__ import annotations

import zlib
from array import array
from collections.abc import Container, Hashable, Sequence
from dataclasses import dataclass

# Block keys all links hold together (8 bytes each): 8 MB, what ~8,000 conversations of
# 2,000 tokens in blocks of 16 need.
LINK_BLOCKS = 1 << 20
# Links at most, whatever their size.
LINKS = 16384
# Keys an index remembers as evicted (8 bytes and a dict slot each: ~5 MB): what it knows
# the engine no longer holds, as against what it never heard of.
GONE = 1 << 16


def block_keys(ids: Sequence[int], block_size: int) -> list[int]:
    """The key of each whole block of ``ids`` (a partial last block is never cached)."""
    keys = []
    parent = 0
    ids = tuple(ids)  # sliced into tuples at once
    for start in range(0, len(ids) - block_size + 1, block_size):
        parent = hash((parent, ids[start : start + block_size]))
        keys.append(parent)
    return keys


def cached_tokens(blocks_held: int, block_size: int, tokens: int) -> int:
    """Prompt tokens an engine serves from cache when it holds ``blocks_held`` leading blocks:
    vLLM computes at least the last prompt token itself."""
    return min(blocks_held, max(tokens - 1, 0) // block_size) * block_size


def leading_held(keys: Sequence[int], count: int, held: Container[int]) -> int:
    """How many of the first ``count`` of ``keys`` are in ``held``, which holds a prefix of
    every sequence it holds part of: a binary search, O(log count) lookups."""
    low, high = 0, count
    while low < high:
        middle = (low + high + 1) // 2
        if keys[middle - 1] in held:
            low = middle
        else:
            high = middle - 1
    return low


class BlockIndex:
    """One engine's blocks, by its events: engine hash -> the router's key for it.

    Every block the engine stored since the router listened is followed, keyed or not: a
    block whose chain began before (its parent unknown) is held all the same, but cannot be
    compared with a prompt (no key). vLLM does not de-duplicate its cache (two requests
    computing one prefix at once each cache a copy, and evict each on its own), so a hash
    stored again is another copy, held until each copy was removed. (A request with
    ``kv_cache_report_mode: "full"`` restates the blocks it reused: each restatement
    counts as a copy, and the block outlives its eviction in the index until a clear.)"""

    __slots__ = (
        "block_size", "blocks", "whole", "_names", "_held", "_copies", "_unkeyed", "_gone"
    )  # fmt: skip

    def __init__(self) -> None:
        # The engine's block size (0 until a full block was stored).
        self.block_size = 0
        # Blocks held now, copies included: what the engine's cache holds of what the
        # router heard stored (``fleet/kvevents.py`` learns its capacity from it).
        self.blocks = 0
        self._names: dict[Hashable, int | None] = {}
        # Keys held, with how many engine blocks have that key (blocks with the same tokens
        # but other extra keys, a LoRA or a cache salt, are other keys: see ``stored``).
        self._held: dict[int, int] = {}
        # Hashes held in more than one copy, and how many.
        self._copies: dict[Hashable, int] = {}
        self._unkeyed = 0
        # Keys the engine held and evicted since (the last ``GONE``): an LRU.
        self._gone: dict[int, None] = {}
        # Followed since the engine's cache was empty (``fleet/kvevents.py`` says when):
        # what it never heard of, the engine does not hold.
        self.whole = False

    def __len__(self) -> int:
        """Hashes followed, keyed or not."""
        return len(self._names)

    @property
    def keyed(self) -> int:
        """Hashes followed that a prompt can be compared with."""
        return len(self._names) - self._unkeyed

    def stored(
        self,
        hashes: Sequence[Hashable],
        parent: Hashable | None,
        ids: Sequence[int],
        block_size: int,
        extra: Sequence[object] | None = None,
    ) -> bool:
        """A BlockStored event; False if it could not be keyed (its parent is unknown or
        unkeyed: the router joined after it was stored, or missed it). Token ids that are
        not these blocks' are no blocks, and are not followed."""
        if len(ids) != len(hashes) * block_size:
            return False
        key = 0 if parent is None else self._names.get(parent)
        if key is None:
            self._follow(hashes)
            return False
        if len(hashes) > 1 or self.block_size == 0:
            # A single block may be a partial one (vLLM's fine-grained hits): the engine's
            # block size is what a run of blocks says.
            self.block_size = max(self.block_size, block_size)
        names, held, copies = self._names, self._held, self._copies
        ids = tuple(ids)  # sliced into tuples at once
        for index, block_hash in enumerate(hashes):
            start = index * block_size
            tokens = ids[start : start + block_size]
            salt = extra[index] if extra is not None and index < len(extra) else None
            try:
                key = hash((key, tokens)) if salt is None else hash((key, tokens, repr(salt)))
            except (TypeError, RecursionError):
                # Token ids that are not numbers, or extra keys nested past what ``repr``
                # reads: no block a prompt can be, nor those chained to it.
                self.blocks += index
                self._follow(hashes[index:])
                return False
            if block_hash in names:
                copies[block_hash] = copies.get(block_hash, 1) + 1
            else:
                names[block_hash] = key
                held[key] = held.get(key, 0) + 1
                if self._gone:
                    self._gone.pop(key, None)
        self.blocks += len(hashes)
        return True

    def _follow(self, hashes: Sequence[Hashable]) -> None:
        """Blocks held that no prompt can be compared with."""
        names, copies = self._names, self._copies
        for block_hash in hashes:
            if block_hash in names:
                copies[block_hash] = copies.get(block_hash, 1) + 1
            else:
                names[block_hash] = None
                self._unkeyed += 1
        self.blocks += len(hashes)

    def removed(self, hashes: Sequence[Hashable]) -> int:
        """A BlockRemoved event; how many of the blocks were followed (removals of others,
        stored before the router listened, say nothing of what it holds now)."""
        names, held, copies = self._names, self._held, self._copies
        known = 0
        for block_hash in hashes:
            if block_hash not in names:
                continue
            known += 1
            self.blocks -= 1
            left = copies.get(block_hash)
            if left is not None:
                if left > 2:
                    copies[block_hash] = left - 1
                else:
                    del copies[block_hash]
                continue
            key = names.pop(block_hash)
            if key is None:
                self._unkeyed -= 1
                continue
            count = held[key] - 1
            if count:
                held[key] = count
            else:
                del held[key]
                gone = self._gone
                gone[key] = None
                if len(gone) > GONE:
                    del gone[next(iter(gone))]
        return known

    def clear(self, empty: bool = False) -> None:
        """Forget every block: the engine's cache is ``empty`` now (a clear, a restart
        followed from its start), else it holds what the index missed."""
        self._names.clear()
        self._held.clear()
        self._copies.clear()
        self._unkeyed = 0
        self._gone.clear()
        self.blocks = 0
        self.whole = empty

    def held(self, keys: Sequence[int], count: int) -> int:
        """How many of the first ``count`` blocks of ``keys`` the engine holds."""
        return leading_held(keys, count, self._held)

    def knows(self, keys: Sequence[int], count: int) -> tuple[int, bool]:
        """``held``, and whether the index knows the block after those: held and then
        evicted, or nothing to know (all ``count`` held). Not known: stored before the
        router heard, or chained to a block that was (a router started, a gap in the
        events), so the index cannot say the engine does not hold it."""
        held = leading_held(keys, count, self._held)
        return held, held >= count or self.whole or keys[held] in self._gone


@dataclass(slots=True)
class Link:
    """A prompt the router learned the tokens of, under the key of its last whole chunk."""

    # Its block keys, in blocks of ``block_size`` tokens.
    blocks: array[int]
    block_size: int
    tokens: int
    # Its text's bytes in whole chunks, and the length and CRC-32 of the bytes after them.
    chunked: int
    tail: int
    tail_crc: int


@dataclass(slots=True)
class Match:
    """What a prompt is known to share with a learned one: its first ``count`` blocks."""

    blocks: array[int]
    count: int
    block_size: int
    # The prompt's tokens (the learned prompt's, until ``KvView.match`` counts this one).
    tokens: int
    # The prompt starts with all of the learned prompt's text, and has this many bytes
    # more; None if it shares only the learned prompt's whole chunks.
    extends: int | None


class Links:
    """The learned prompts, by the key of their last whole chunk: an LRU bounded by the
    block keys held (``LINK_BLOCKS``) and the links (``LINKS``)."""

    def __init__(self, max_blocks: int = LINK_BLOCKS, max_links: int = LINKS) -> None:
        self.max_blocks = max_blocks
        self.max_links = max_links
        self.blocks = 0
        # A dict is an insertion-ordered map: re-inserting on use makes it an LRU.
        self._links: dict[int, Link] = {}

    def __len__(self) -> int:
        return len(self._links)

    def learn(
        self, key: int, chunked: int, data: bytes, ids: Sequence[int], block_size: int
    ) -> None:
        """The prompt whose text is ``data``, its last whole chunk (ending at byte
        ``chunked``) keyed ``key``, is the tokens ``ids``."""
        if block_size < 1 or not 0 < chunked <= len(data):
            return
        blocks = array("q", block_keys(ids, block_size))
        tail = zlib.crc32(memoryview(data)[chunked:])
        link = Link(blocks, block_size, len(ids), chunked, len(data) - chunked, tail)
        links = self._links
        old = links.pop(key, None)
        if old is not None:
            self.blocks -= len(old.blocks)
        links[key] = link
        self.blocks += len(blocks)
        while self.blocks > self.max_blocks or len(links) > self.max_links:
            gone = links.pop(next(iter(links)))
            self.blocks -= len(gone.blocks)

    def match(self, chunks: Sequence[int], data: bytes) -> Match | None:
        """The learned prompt that shares the most of this prompt's text, and how many of
        its blocks this prompt surely starts with; None if none shares a whole chunk."""
        links = self._links
        for index in range(len(chunks) - 1, -1, -1):
            link = links.get(chunks[index])
            if link is None:
                continue
            end = link.chunked + link.tail
            if (
                len(data) >= end
                and zlib.crc32(memoryview(data)[link.chunked : end]) == link.tail_crc
            ):
                # This prompt starts with all of that one's text, so with all its blocks
                # (a template's last tokens aside, which a whole block rarely ends in).
                return Match(
                    link.blocks, len(link.blocks), link.block_size, link.tokens, len(data) - end
                )
            # Only the link's whole chunks are shared: the blocks they surely cover.
            shared = link.tokens * link.chunked // max(end, 1)
            count = max(shared // link.block_size - 1, 0)
            return Match(link.blocks, count, link.block_size, link.tokens, None)
        return None

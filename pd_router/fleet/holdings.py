"""What each engine is predicted to hold in its prefix cache. No I/O.

The router has no tokenizer. It renders a request as the bytes its prompt is made of (the
model, the chat tools and messages as the client sent them, or the completion prompt), cuts
them into chunks of ``CHUNK_BYTES`` and gives chunk k the CRC-32 of bytes ``[0,
(k+1)*CHUNK_BYTES)`` (computed incrementally, so a prompt costs one pass) with k in the high
bits: two prompts share chunk k's key exactly when they share those leading bytes (up to a
2**-32 collision at that depth, which only misleads one prediction). A chunk stands for
``CHUNK_TOKENS`` tokens of text at first (~4 bytes a token, English BPE); the ratio is then
learned from the ``prompt_tokens`` the prefill engines report for text prompts
(``KvView.calibrate``), so that the cost, the engines' capacity and ``--max-local-prefill``
are in the engine's tokens. Token ids are packed 4 bytes each: for them the count is exact.

An engine's ``Holdings`` is an LRU of chunk keys bounded by its cache (in tokens), as vLLM
evicts the least recently used free block. A prompt's chunks are touched last to first, so a
chunk is always at least as recent as every chunk after it: eviction takes the tails of
prompts first, what is held stays prefix-closed, and the longest held prefix is found by
binary search: O(log chunks) dict lookups per engine, whatever the number of conversations.

Like llm-d's approximate prefix scorer (characters as tokens, a rolling hash chain over
fixed blocks, an LRU index per pod) and Dynamo's ``ApproxKvIndexer`` (the router's own
routing decisions, no events), this predicts from where this router sent prompts. Where an
engine's KV events are live and the prompt's text was learned, ``KvView.cached`` answers
from them instead (``fleet/kvindex.py``).
"""

from __future__ import annotations

import zlib
from array import array
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import orjson

from pd_router.fleet.kvindex import BlockIndex, Links, Match, cached_tokens, leading_held

CHUNK_BYTES = 256
BYTES_PER_TOKEN = 4
CHUNK_TOKENS = CHUNK_BYTES // BYTES_PER_TOKEN
# A GPU's KV cache for an 8B model holds a few hundred thousand tokens.
DEFAULT_CACHE_TOKENS = 262_144
# The most an engine's events may say its cache holds (an 80 GB GPU holds ~10 M tokens of a
# 0.5B model's KV): the prediction of what it holds is bounded by it, ~26 MB a node.
MAX_CACHE_TOKENS = 1 << 24
# Engine tokens per estimated token (4 bytes of text) one answer may teach: a tokenizer
# gives 0.5-2 for text in any script. Beyond is no text (a base64 image: 1,200 tokens for
# 1 MB) and, taken as the ratio, would make every text prompt "short" (``--max-local-
# prefill``) and the predicted caches as large.
RATIOS = (0.25, 4.0)


@dataclass(slots=True)
class Prompt:
    """A request's prompt as the router sees it: its chunk keys and its tokens (estimated
    for text, counted for token ids)."""

    chunks: list[int] = field(default_factory=list)
    tokens: int = 0
    # Tokens a chunk stands for.
    chunk_tokens: float = CHUNK_TOKENS
    # Whether ``tokens`` was counted (token ids) rather than estimated from text.
    exact: bool = False
    # The estimate before calibration, in CHUNK_TOKENS per chunk (text only).
    estimate: int = 0
    # The bytes the chunks were cut from, and what a learned prompt says they start with
    # (``KvView.match``: ``linked`` once looked up).
    data: bytes = b""
    match: Match | None = None
    linked: bool = False

    def cached(self, chunks_held: int) -> int:
        """Tokens of this prompt that ``chunks_held`` leading chunks cover."""
        return min(int(chunks_held * self.chunk_tokens), self.tokens)


def describe(body: Mapping[str, Any], ratio: float = 1.0) -> Prompt:
    """The prompt of a chat or completions body (the first prompt of a batch); ``ratio`` is
    the engines' tokens per estimated token of text (``KvView.ratio``)."""
    prompt = _describe(body)
    if not prompt.exact and ratio != 1.0:
        prompt.tokens = round(prompt.estimate * ratio)
        prompt.chunk_tokens = CHUNK_TOKENS * ratio
    return prompt


def _describe(body: Mapping[str, Any]) -> Prompt:
    # The model seeds the chain: another model's cache is another cache.
    seed = zlib.crc32(str(body.get("model")).encode("utf-8", "surrogatepass"))
    messages = body.get("messages")
    if isinstance(messages, list):
        tools = body.get("tools")
        # The messages as serialised, less the closing bracket: a later turn only appends.
        data = (orjson.dumps(tools) if tools else b"") + orjson.dumps(messages)[:-1]
        return _text(data, seed)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return _text(prompt.encode("utf-8", "surrogatepass"), seed)
    packed = _packed_ids(prompt)
    if packed is not None:
        return Prompt(chunk_keys(packed, seed), len(packed) // 4, exact=True, data=packed)
    return _text(orjson.dumps(prompt), seed)


def _text(data: bytes, seed: int) -> Prompt:
    tokens = -(-len(data) // BYTES_PER_TOKEN)
    return Prompt(chunk_keys(data, seed), tokens, estimate=tokens, data=data)


def _packed_ids(prompt: object) -> bytes | None:
    if not isinstance(prompt, list) or not prompt:
        return None
    try:
        return array("I", prompt).tobytes()
    except (TypeError, OverflowError):
        return None


def chunk_keys(data: bytes, seed: int = 0) -> list[int]:
    """The key of each whole leading chunk of ``data`` (a partial tail is never cached)."""
    view = memoryview(data)
    crc = seed
    keys = []
    for index in range(len(data) // CHUNK_BYTES):
        start = index * CHUNK_BYTES
        crc = zlib.crc32(view[start : start + CHUNK_BYTES], crc)
        keys.append(crc | index << 32)
    return keys


class Holdings:
    """One engine's predicted prefix cache: an LRU of chunk keys, ``capacity`` chunks."""

    __slots__ = ("capacity", "_keys")

    def __init__(self, capacity_tokens: int = DEFAULT_CACHE_TOKENS, ratio: float = 1.0) -> None:
        self.capacity = 1
        self.resize(capacity_tokens, ratio)
        # A dict is an insertion-ordered set: re-inserting a key on use makes it an LRU.
        self._keys: dict[int, None] = {}

    def __len__(self) -> int:
        return len(self._keys)

    def resize(self, capacity_tokens: int, ratio: float) -> None:
        """Hold ``capacity_tokens`` engine tokens, at ``ratio`` engine tokens per estimated
        token; what is beyond goes at the next ``insert``."""
        chunks = int(capacity_tokens / (CHUNK_TOKENS * ratio))
        self.capacity = min(max(chunks, 1), MAX_CACHE_TOKENS // CHUNK_TOKENS)

    def held(self, chunks: Sequence[int]) -> int:
        """How many leading chunks of a prompt this engine holds (what is held is
        prefix-closed, see the module docstring)."""
        return leading_held(chunks, len(chunks), self._keys)

    def insert(self, chunks: Sequence[int]) -> None:
        """The engine computed (or read) the prompt: its chunks are the most recent now,
        the first one most of all, and the least recently used beyond capacity are gone."""
        keys = self._keys
        for key in reversed(chunks):
            keys.pop(key, None)
            keys[key] = None
        excess = len(keys) - self.capacity
        if excess > 0:
            for key in list(_first(keys, excess)):
                del keys[key]

    def clear(self) -> None:
        self._keys.clear()


def _first(keys: dict[int, None], count: int) -> list[int]:
    taken: list[int] = []
    for key in keys:
        if len(taken) == count:
            break
        taken.append(key)
    return taken


# How fast the learned tokens-per-estimate ratio follows the engines' counts.
CALIBRATION_WEIGHT = 0.05


class KvView:
    """The predicted holdings of every engine this router sends to, by node id."""

    def __init__(self, cache_tokens: int = DEFAULT_CACHE_TOKENS) -> None:
        self.cache_tokens = cache_tokens
        # Engine tokens per estimated token of text (1 until an engine has told).
        self.ratio = 1.0
        self._calibrated = False
        self._by_node: dict[int, Holdings] = {}
        # An engine's cache as its KV events showed it (``fleet/kvevents.py``), by node id.
        self._capacity: dict[int, int] = {}
        # With ``--state``: what this router placed, for the routers sharing it
        # (``shared/placements.py``): (role, url, chunks, tokens), the oldest dropped when
        # full.
        self.outbox: deque[tuple[str, str, list[int], int]] | None = None
        # What the engines that publish KV events hold, by their events
        # (``fleet/kvevents.py``): every watched stream's index, and those of the streams
        # live now, whose word replaces the prediction (``cached``).
        self.indexes: dict[int, BlockIndex] = {}
        self.live: dict[int, BlockIndex] = {}
        # The prompts whose tokens the engines told (``learn``).
        self.links = Links()

    def of(self, node_id: int) -> Holdings:
        holdings = self._by_node.get(node_id)
        if holdings is None:
            capacity = self._capacity.get(node_id, self.cache_tokens)
            holdings = self._by_node[node_id] = Holdings(capacity, self.ratio)
        return holdings

    def placed(self, node_id: int, role: str, url: str, prompt: Prompt) -> None:
        """This router sent the prompt there: the engine holds it from now on."""
        self.of(node_id).insert(prompt.chunks)
        if self.outbox is not None and prompt.chunks:
            self.outbox.append((role, url, prompt.chunks, prompt.tokens))

    def cached(self, node_id: int, prompt: Prompt, chunks_held: int) -> int:
        """Tokens of ``prompt`` cached on the node: what its events say it holds of the
        blocks the prompt is known to start with (``kvindex.py``) where its stream is live
        and the prompt's text was learned, else ``chunks_held`` as predicted. Where the
        events end at a block the index never heard of (stored before the router listened,
        or before a gap in the events), the prediction, if it says more."""
        held, known = self._events(node_id, prompt)
        if held is None:
            return prompt.cached(chunks_held)
        match = prompt.match
        assert match is not None  # nosec B101: events answer for a learned prompt only
        tokens = cached_tokens(held, match.block_size, match.tokens)
        return tokens if known else max(tokens, prompt.cached(chunks_held))

    def source(self, node_id: int, prompt: Prompt) -> str:
        """Where ``cached`` took its answer from: "events" or "prediction"."""
        held, known = self._events(node_id, prompt)
        return "events" if held is not None and known else "prediction"

    def _events(self, node_id: int, prompt: Prompt) -> tuple[int | None, bool]:
        """What the node's live event stream says it holds of the prompt's learned blocks,
        and whether it knows the block after them (``BlockIndex.knows``); None: nothing."""
        index = self.live.get(node_id)
        if index is None:
            return None, False
        match = self.match(prompt)
        if match is None or match.block_size != index.block_size:
            return None, False
        return index.knows(match.blocks, match.count)

    def match(self, prompt: Prompt) -> Match | None:
        """What the learned prompts say this one starts with (looked up once a request);
        a prompt that extends a learned one is counted as its tokens and the rest's
        estimate."""
        if not prompt.linked:
            prompt.linked = True
            match = prompt.match = self.links.match(prompt.chunks, prompt.data)
            if match is not None and match.extends is not None and not prompt.exact:
                rest = match.extends * self.ratio / BYTES_PER_TOKEN
                prompt.tokens = match.tokens + round(rest)
            if match is not None:
                match.tokens = prompt.tokens
        return prompt.match

    def learn(self, node_id: int, prompt: Prompt, ids: object) -> None:
        """The node's answer said the prompt is the token ids ``ids``."""
        index = self.indexes.get(node_id)
        if index is None or not index.block_size or not prompt.chunks:
            return
        if not isinstance(ids, list) or len(ids) < index.block_size:
            return
        try:
            # Checked in C (the list itself is keyed: its ints exist already): anything but
            # 64-bit integers is the engine's lie, not tokens.
            array("q", ids)
        except (TypeError, OverflowError):
            return
        chunked = len(prompt.chunks) * CHUNK_BYTES
        self.links.learn(prompt.chunks[-1], chunked, prompt.data, ids, index.block_size)

    def lost(self, node_id: int) -> None:
        """The node was found dead: its engine most likely restarts with an empty cache."""
        holdings = self._by_node.get(node_id)
        if holdings is not None:
            holdings.clear()

    def set_capacity(self, node_id: int, tokens: int) -> None:
        """The engine's cache holds ``tokens`` of its tokens (its events said so)."""
        tokens = min(tokens, MAX_CACHE_TOKENS)
        self._capacity[node_id] = tokens
        self.of(node_id).resize(tokens, self.ratio)

    def calibrate(self, prompt: Prompt, engine_tokens: object) -> None:
        """An engine counted ``engine_tokens`` for a text prompt the router estimated."""
        if prompt.exact or prompt.estimate <= 0:
            return
        if isinstance(engine_tokens, bool) or not isinstance(engine_tokens, int):
            return
        if engine_tokens <= 0:
            return
        seen = engine_tokens / prompt.estimate
        if not RATIOS[0] <= seen <= RATIOS[1]:
            return
        if self._calibrated:
            self.ratio += CALIBRATION_WEIGHT * (seen - self.ratio)
        else:
            self.ratio, self._calibrated = seen, True
        for node_id, holdings in self._by_node.items():
            holdings.resize(self._capacity.get(node_id, self.cache_tokens), self.ratio)

    def forget(self, keep: set[int]) -> None:
        """Nodes removed from the fleet: what they held goes with them."""
        for node_id in [node_id for node_id in self._by_node if node_id not in keep]:
            del self._by_node[node_id]
            self._capacity.pop(node_id, None)

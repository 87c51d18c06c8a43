"""Which prefill node prefills a request. No I/O.

A prefill engine keeps the KV of the prompts it computed (vLLM's prefix caching) and
computes only what it has not seen: a chat turn repeats the whole conversation so far, so
the node that prefilled the last turn does the next one for the cost of the new tokens.
Round robin over N nodes finds that node one time in N.

``prefix`` (the default) sends each request to the node its *prefix key* hashes to, by
rendezvous (highest-random-weight) hashing over the usable nodes. The key depends on the
request only, and the ranking on the key and the node URLs only: routers that never talk
to each other send a conversation's turns to the same node, and adding or removing a node
moves only the keys it wins or held (about 1/N of them). The cost is O(nodes) per request,
whatever the number of conversations: the routers keep no table of prefixes to search.

Load bounds it, as in consistent hashing with bounded loads (Mirrokni, Thorup, Zadimoghaddam
2018; HAProxy's ``hash-balance-factor``): a node that already carries more than
``LOAD_FACTOR`` x the mean outstanding prefills + 1 is passed over for the next node in the
key's ranking. One hot prefix thus spills to the same second node from every router
instead of piling up, and the node carrying the least always qualifies (least <= mean).
Outstanding prefills are the requests bound to the node (``Node.bound``, which the fleet
keeps from the prefill request's start to its end on every path).

``cost`` weighs, for each node, what sending the prefill there costs: twice the prompt's
tokens that node does not hold (``fleet/holdings.py``: the longest prefix of the prompt this
router sent there and the node has not evicted since), plus the uncached tokens of the
prefills this router has waiting or running there (and ``PREFILL_TOKENS`` for each).
Computing a token again costs twice what waiting for one does: the request waits for it,
and so does whatever queues behind it on that engine, while a wait delays this request
only. So a conversation's later turn
stays where its history is until the work waiting there exceeds twice what moving would
recompute, and a hot document or preamble is computed on another node when load requires
it. A share term levels the request counts: a node given more of the last few prefills
than the mean plus a band costs the mean prompt's tokens more per prefill beyond it, one
given fewer that less.

A prompt that continues the one earlier prompt a node holds (a conversation's next turn,
not a new conversation behind a shared opening) is bounded as ``prefix`` bounds load (a
node with more of this router's prefills in flight than ``LOAD_FACTOR`` x the mean + 1 is
passed over), and the share term only pushes it, beyond a wider band, and never pulls
it: moving it recomputes its history, and new conversations level the counts at the
price of an opening at most. A new session (anything else) starts where its later turns
will go, so sessions are levelled as they start, by how hot their opening (the prompt's
first chunk) is. While the opening is held by fewer nodes than it had prefills among the
last ``len(nodes)`` placements (a burst of new conversations, an agent preamble's first
sessions, a hot document's questions), a session goes only to a node with at most
``BURST_SLACK`` more prefills in flight than the least busy one (on the nodes holding
the most of its prompt only those behind its opening count), not behind the opening's
computation if that takes ``HOT_WAIT`` longer than computing the whole prompt on the
node with the least work waiting among those, and the share term copies the opening to
more nodes as the counts require. Once it is not hot, its holders take its sessions,
the work waiting there in the cost, and the share term may level the counts among them
but not copy it elsewhere (a rarely asked document is computed once).
Ties go to the node given the fewest recent prefills, then to the node the prompt's first
chunk beyond the tied nodes' shared holdings ranks first by rendezvous hashing, which
spreads new conversations alike on every router.

``least_loaded`` picks the node with the fewest outstanding prefills (ties in turn);
``round_robin`` takes the nodes in turn.
"""

from __future__ import annotations

import hashlib
from collections import deque
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import orjson

from pd_router.fleet.holdings import KvView, Prompt
from pd_router.fleet.nodes import Node, State, usable, usable_for

# Leading characters of a prompt (and of each message) that make its key. A conversation's
# every turn starts with its first turn, so turns share the key whenever that first turn is
# at least this long; 1024 characters are ~250 tokens, less than any prompt worth caching.
# Two prompts sharing these characters share as many cacheable tokens, so when unrelated
# conversations collide on a key, sending them to one node still pays (and the load bound
# spreads them when they are many).
KEY_CHARS = 1024
# A token id counts as ~4 characters of text.
KEY_IDS = KEY_CHARS // 4
# The load a node may carry over the mean before its keys spill (the c of bounded loads):
# 1.25 keeps the busiest node within 25% (+1) of the mean and most keys at home.
LOAD_FACTOR = 1.25
# The cost policy. A prompt token a node would compute costs MISS_WEIGHT x a token of work
# already waiting there: recomputing delays this request and whatever queues behind it on
# that engine, waiting delays this request only. Others weigh the same two terms: Dynamo's
# KV router costs a worker ``overlap_score_weight x prefill blocks + decode blocks``
# (prefill blocks: the prompt's uncached blocks plus those already queued; softmax over
# the costs with ``--router-temperature``, 0 by default: the cheapest), llm-d's default
# scheduler profile weighs its prefix-cache scorer 3 to its queue scorer's 2, SGLang's
# cache_aware follows the longest match unless the loads differ by more than
# ``balance_abs_threshold`` (64) and ``balance_rel_threshold`` (1.5x). At 1 (finish first)
# a conversation's later turn left its engine for one idle token of difference and
# recomputed its history elsewhere (``benchmarks/route_replay.py --trace``: 20-30 turns of
# the chat and agent shapes each run).
MISS_WEIGHT = 2.0
# What a prefill costs an engine besides its uncached tokens (a pass over the model at
# least, the KV transfer's setup, the answer), counted as this many tokens for each of
# this router's prefills waiting or running on a node: the work waiting there is more
# than its tokens when they are few (a node computing three 20-token questions is not as
# free as one computing one). Without it the short shape's p99 in ``route_replay.py``
# was 1.12 x round_robin's (new questions queued behind cached ones), with it 1.00.
PREFILL_TOKENS = 32
# The share term: of the last RECENT_PER_NODE x nodes prefills, each one a node was given
# over the mean plus a band (SHARE_SLACK x the mean + SHARE_BAND) costs SHARE_WEIGHT x the
# recent prompts' mean size more (each one under it, that less). A prefill engine's work
# per request is not only what it computes: it sends the whole prompt's KV to a decode
# engine, cached or not. Without the term a hot document or a shared opening makes the
# node that holds it the cheapest for every request while prefills are too quick to
# queue (one engine busy, the others idle). The window is short (a few prefills per node)
# so that what a router did for one workload does not steer the next one.
RECENT_PER_NODE = 8
SHARE_WEIGHT = 1.0
SHARE_SLACK = 0.1
SHARE_BAND = 0.5
# A conversation's next turn (a prompt continuing the one prompt a node holds, see
# ``Cost._continues``) is pushed by the share term only beyond a wider band, and never
# pulled: moving it recomputes its history, which nothing amortises (moving a new
# conversation gives up at most a shared opening, once per node), and a node given few
# prefills that pulled turns in recomputed one history after another there, each queued
# behind the last (``benchmarks/route_replay.py --trace``: the agent shape's slowest
# requests). New conversations level the counts instead.
CONT_SLACK = 0.25
CONT_BAND = 2.0
# A new session goes only to a node with at most this many more of this router's
# prefills in flight than the least busy one (on the nodes holding the most of its
# prompt, only those behind its opening count) while its opening is hot (``Cost._hot``):
# each session brings its later turns to the node it starts on, so a burst of sessions
# is spread as they start (eight at once behind a new opening: two per node of four,
# not three on each of two and none on a fourth, which no later session made up for).
BURST_SLACK = 1
# Nor, while its opening is hot, to queue behind the opening's computation (``_soon``)
# where its prefill would be done later than (1 + HOT_WAIT) x computing the whole
# prompt on the node with the least work waiting (of those the burst bound leaves), in
# tokens of work: a session placed a moment after another behind it waits for all of
# it, then its own part. That saves a copy of the opening, worth it for a document's
# question (``route_replay.py``'s shapes, a word a token: 1,000, then its own 30 and a
# prefill's PREFILL_TOKENS, 6% later than computing them all on an idle node), not for a
# new conversation's first turn (400, then its own 42: 17% later). Each node's
# first session computes the opening alone under any policy that uses every node, round
# robin included, so those pairs were the first wave's slowest requests:
# ``route_replay.py --rtt 0.008`` gave completions a TTFT p99 above round_robin's on 11
# of 16 seeds (up to 1.06 x) and chat on 8, with the bound on none.
HOT_WAIT = 0.1
# Prefix keys whose last node this router remembers (for ``hit`` in logs and metrics):
# ~100 bytes each, so ~1.6 MB at most.
RECENT_KEYS = 16384

_MASK = (1 << 64) - 1


def prefix_key(body: Mapping[str, Any]) -> int:
    """A 64-bit key for the part of the prompt a conversation's every turn repeats.

    Chat: the model, then the messages up to and including the first user message (the
    system prompt and tools are shared by many conversations; the first user message tells
    them apart, and later turns only append), each message's content cut at ``KEY_CHARS``.
    Completions: the model and the prompt's first ``KEY_CHARS`` characters (or ``KEY_IDS``
    token ids; the first prompt of a batch). The router has no tokenizer: characters of the
    body as sent are what every router sees alike, and a hash over them cannot depend on
    anything a replica knows that another does not.
    """
    digest = hashlib.blake2b(str(body.get("model")).encode(), digest_size=8)
    messages = body.get("messages")
    if isinstance(messages, list):
        for message in messages:
            if not isinstance(message, dict):
                break
            role = message.get("role")
            digest.update(b"\x00" + str(role).encode() + b"\x00")
            digest.update(_leading(message.get("content")))
            if role == "user":
                break
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
            prompt = prompt[0]
        digest.update(_leading(prompt))
    return int.from_bytes(digest.digest(), "little")


def _leading(content: object) -> bytes:
    if isinstance(content, str):
        return content[:KEY_CHARS].encode("utf-8", "surrogatepass")
    if isinstance(content, list) and all(isinstance(item, int) for item in content[:KEY_IDS]):
        return orjson.dumps(content[:KEY_IDS])
    # Content parts (text, images): as the client wrote them, cut like a string.
    return orjson.dumps(content)[: KEY_CHARS * 4]


def _mix(value: int) -> int:
    """splitmix64's finaliser: a key and a node's salt become a uniform 64-bit score."""
    value = (value ^ (value >> 30)) * 0xBF58476D1CE4E5B9 & _MASK
    value = (value ^ (value >> 27)) * 0x94D049BB133111EB & _MASK
    return value ^ (value >> 31)


def node_salt(url: str) -> int:
    """A node's identity in the ranking: its URL, the one name every replica gives it."""
    return int.from_bytes(hashlib.blake2b(url.encode(), digest_size=8).digest(), "little")


class RecentPrefixes:
    """The node each recent prefix key was last prefilled on, by this router: a hit is a
    key sent where it went last time (its prefix is likely still cached there)."""

    def __init__(self, capacity: int = RECENT_KEYS) -> None:
        self.capacity = capacity
        # A dict is an insertion-ordered map: re-inserting on use makes it an LRU.
        self._last: dict[int, int] = {}

    def record(self, key: int, node: Node) -> bool:
        """Remember ``node`` for ``key``; True if the key's last node was ``node``."""
        last = self._last.pop(key, None)
        self._last[key] = node.id
        if len(self._last) > self.capacity:
            del self._last[next(iter(self._last))]
        return last == node.id


class Placement:
    """A prefill sent to ``node``: what was predicted of it, until ``PrefillPolicy.release``."""

    __slots__ = ("node", "hit", "cached", "work", "source", "opening")

    def __init__(
        self,
        node: Node,
        hit: bool,
        cached: int | None = None,
        work: int = 0,
        source: str = "prediction",
        opening: int | None = None,
    ) -> None:
        self.node = node
        # The prefix policy: this router last sent the prefix key here. The cost policy:
        # some of the prompt is predicted cached here.
        self.hit = hit
        # Prompt tokens predicted cached on the node (the cost policy only).
        self.cached = cached
        # Prompt tokens predicted to be computed: the node's waiting work until released.
        self.work = work
        # What ``cached`` came from: "events" (the node's KV events) or "prediction".
        self.source = source
        # The prompt's first chunk key (the cost policy only): what it was placed behind.
        self.opening = opening


class PrefillPolicy:
    """Picks among the usable prefill nodes that serve the request's model (``usable`` over
    the nodes serving it, as the decode pool does), never ``avoid``."""

    name: ClassVar[str]
    # Whether ``pick`` and ``place`` read the prompt (``holdings.describe``): only then is
    # it computed for each request.
    reads_prompt: ClassVar[bool] = False

    def __init__(self, nodes: Sequence[Node], view: KvView | None = None) -> None:
        self.nodes = list(nodes)
        self.usable = usable(self.nodes)
        self._accepts: dict[str, tuple[State, ...]] = {}
        self.recent = RecentPrefixes()
        self.view = view if view is not None else KvView()

    def refresh(self) -> None:
        """A node's state or models changed, or a node came or went."""
        self.usable = usable(self.nodes)
        self._accepts.clear()

    def pick(
        self,
        key: int,
        avoid: Node | None = None,
        model: str | None = None,
        prompt: Prompt | None = None,
    ) -> Node | None:
        accept = self.usable if model is None else usable_for(self.nodes, model, self._accepts)
        live = [
            node
            for node in self.nodes
            if node.state in accept and node is not avoid and node.serves(model)
        ]
        if not live:
            return None
        return self._choose(key, live, prompt or _UNKNOWN)

    def _choose(self, key: int, live: list[Node], prompt: Prompt) -> Node:
        raise NotImplementedError

    def place(self, node: Node, key: int, prompt: Prompt | None = None) -> Placement:
        """The prefill goes to ``node`` now."""
        return Placement(node, self.recent.record(key, node))

    def release(self, placement: Placement) -> None:
        """The prefill ``place`` returned ended, however it did."""

    def heard(self, node: Node, prompt: Prompt) -> None:
        """Another router sharing ``--state`` placed ``prompt`` on ``node``."""
        self.view.of(node.id).insert(prompt.chunks)


class RoundRobin(PrefillPolicy):
    name = "round_robin"

    def __init__(self, nodes: Sequence[Node], view: KvView | None = None) -> None:
        super().__init__(nodes, view)
        self._next = 0

    def _choose(self, key: int, live: list[Node], prompt: Prompt) -> Node:
        node = live[self._next % len(live)]
        self._next += 1
        return node


class LeastLoaded(RoundRobin):
    """The fewest outstanding prefills; ties in turn, so an idle fleet is used evenly."""

    name = "least_loaded"

    def _choose(self, key: int, live: list[Node], prompt: Prompt) -> Node:
        start = self._next % len(live)
        self._next += 1
        return min(live[start:] + live[:start], key=_load)


class Prefix(PrefillPolicy):
    """Rendezvous hashing of the prefix key, with bounded load (see the module docstring)."""

    name = "prefix"

    def __init__(self, nodes: Sequence[Node], view: KvView | None = None) -> None:
        super().__init__(nodes, view)
        self._salts = {node.url: node_salt(node.url) for node in self.nodes}

    def refresh(self) -> None:
        super().refresh()
        self._salts = {node.url: node_salt(node.url) for node in self.nodes}

    def _choose(self, key: int, live: list[Node], prompt: Prompt) -> Node:
        salts = self._salts
        scores = [_mix(key ^ salts[node.url]) for node in live]
        limit = LOAD_FACTOR * sum(map(_load, live)) / len(live) + 1
        ranking = sorted(range(len(live)), key=scores.__getitem__, reverse=True)
        return next(live[index] for index in ranking if _load(live[index]) <= limit)


class Cost(Prefix):
    """The node where the prefill is predicted to cost least (see the module docstring)."""

    name = "cost"
    reads_prompt = True

    def __init__(self, nodes: Sequence[Node], view: KvView | None = None) -> None:
        super().__init__(nodes, view)
        # Uncached prompt tokens of this router's prefills placed on each node, by id,
        # and how many there are.
        self.waiting: dict[int, int] = {}
        self._inflight: dict[int, int] = {}
        # Of those, how many by (node id, the prompt's first chunk key).
        self._behind: dict[tuple[int, int], int] = {}
        # The last ``RECENT_PER_NODE`` x nodes placements (node id, prompt chunks), how
        # many each node was given, and their chunks in all: chunks, not tokens, so that
        # those placed before the engines' counts calibrated the router's estimate weigh
        # in the engines' tokens all the same.
        self._recent: deque[tuple[int, int]] = deque()
        self._counts: dict[int, int] = {}
        self._chunks = 0
        # (node id, last chunk) of the prompts placed on each node, the last RECENT_KEYS,
        # and how many ended there (2: more). A prompt whose held prefix there ends where
        # one earlier prompt ended, and goes on, continues it (a conversation's next
        # turn). Where two ended (a document's last whole chunk, the questions' own
        # words in its partial tail), what is held is shared.
        self._ends: dict[tuple[int, int], int] = {}
        # The openings (first chunk keys) of the last ``len(nodes)`` placements, and how
        # many each has among them (``_hot``).
        self._lately: deque[int] = deque()
        self._lately_counts: dict[int, int] = {}

    def refresh(self) -> None:
        super().refresh()
        self._trim()

    def _choose(self, key: int, live: list[Node], prompt: Prompt) -> Node:
        view, waiting, chunks, counts = self.view, self.waiting, prompt.chunks, self._counts
        if view.live:
            view.match(prompt)  # before any cost: it may count the prompt's tokens better
        helds = [view.of(node.id).held(chunks) for node in live]
        weight = SHARE_WEIGHT * self._chunks / max(len(self._recent), 1) * prompt.chunk_tokens
        mean = sum(counts.get(node.id, 0) for node in live) / len(live)
        inflight = self._inflight
        depth = max(helds)
        # Whether the share term may pull the prompt to a node (a continuation: never);
        # for a new session behind an opening that is not hot, the least it may cost a
        # node not holding the most of the prompt: the most it costs a holder, so that
        # it levels the counts among the holders but does not copy the opening elsewhere.
        pull = True
        hot = False
        first = chunks[0] if chunks else 0
        floor: float | None = None
        if any(self._continues(node.id, held, chunks) for node, held in zip(live, helds)):
            band = CONT_SLACK * mean + CONT_BAND
            pull = False
            # Bounded loads on this router's prefills in flight, as ``prefix`` bounds them.
            limit = LOAD_FACTOR * sum(inflight.get(node.id, 0) for node in live) / len(live) + 1
            keep = [i for i, node in enumerate(live) if inflight.get(node.id, 0) <= limit]
        else:
            band = SHARE_SLACK * mean + SHARE_BAND
            if self._hot(chunks, helds, depth):
                hot = True
                least = min(inflight.get(node.id, 0) for node in live)
                keep = self._bounded(live, helds, first, least + BURST_SLACK)
            else:
                keep = list(range(len(live)))
                floor = max(
                    _beyond(counts.get(node.id, 0) - mean, band) * weight
                    for node, held in zip(live, helds)
                    if held == depth
                )
        # What each node left would compute, and the work waiting there: for those only.
        uncached = {
            i: max(prompt.tokens - view.cached(live[i].id, prompt, helds[i]), 0) for i in keep
        }
        queued = {
            i: waiting.get(live[i].id, 0) + PREFILL_TOKENS * inflight.get(live[i].id, 0)
            for i in keep
        }
        if hot:
            keep = self._soon(live, keep, first, uncached, queued, prompt.tokens)
        best: list[Node] = []
        best_cost = 0.0
        deepest = 0
        for i in keep:
            node, held = live[i], helds[i]
            share = _beyond(counts.get(node.id, 0) - mean, band) * weight
            if not pull:
                share = max(share, 0.0)
            elif floor is not None and held < depth:
                share = max(share, floor)
            cost = MISS_WEIGHT * uncached[i] + queued[i] + share
            if not best or cost < best_cost:
                best, best_cost, deepest = [node], cost, held
            elif cost == best_cost:
                best.append(node)
                deepest = max(deepest, held)
        if len(best) > 1:
            # Ties (nothing known, or an opening every node holds, none busy): the node
            # given the fewest recent prefills, which levels them.
            fewest = min(counts.get(node.id, 0) for node in best)
            best = [node for node in best if counts.get(node.id, 0) == fewest]
        if len(best) == 1:
            return best[0]
        # Still tied: by the first chunk none of the tied nodes holds, which names what is
        # new in this prompt (a conversation's latest turn, the question after a shared
        # document): ranking by it spreads conversations, and every router ranks alike.
        if deepest < len(chunks):
            key = chunks[deepest]
        salts = self._salts
        return max(best, key=lambda node: _mix(key ^ salts[node.url]))

    def _hot(self, chunks: list[int], helds: list[int], depth: int) -> bool:
        """Whether a new session's opening is hot: held nowhere, or by fewer nodes (those
        holding the most of the prompt) than it had prefills among the last ``len(nodes)``
        placements. A hot opening is copied to more nodes as its sessions require (the
        in-flight bound spreads a burst of them, the share term levels the counts); a
        cold one's holders take its sessions, the work waiting there in the cost. So a
        document three questions asked at once is computed once, not three times (and
        then on the node given the fewest prefills by the share term, for one question),
        while the first sessions behind a new agent preamble spread over every node."""
        if not depth or not chunks:
            return True
        copies = sum(1 for held in helds if held == depth)
        return copies < self._lately_counts.get(chunks[0], 0)

    def _bounded(self, live: list[Node], helds: list[int], first: int, limit: float) -> list[int]:
        """The nodes within the in-flight bound for a new session behind a hot opening.
        On the nodes holding the most of its prompt, only the prefills in flight behind
        the same opening (its first chunk) count: the bound spreads a burst behind one
        prefix, but prefills of other prompts there do not move the session off the node
        that holds its prefix (their work is in the cost already) to compute it again
        elsewhere."""
        inflight, behind = self._inflight, self._behind
        depth = max(helds)
        return [
            i
            for i, node in enumerate(live)
            if (
                behind.get((node.id, first), 0)
                if depth and helds[i] == depth
                else inflight.get(node.id, 0)
            )
            <= limit
        ]

    def _soon(
        self,
        live: list[Node],
        keep: list[int],
        first: int,
        uncached: dict[int, int],
        queued: dict[int, int],
        tokens: int,
    ) -> list[int]:
        """Of the nodes ``keep`` indexes, those where a new session behind a hot opening
        would not queue behind the opening's computation (prefills behind its first chunk
        in flight there) to have its prefill done more than ``HOT_WAIT`` later than
        computing the whole prompt on the one of them with the least work waiting would
        (what it would compute there, and the work waiting there). A node computing other
        prompts qualifies whatever it has waiting: that work is in the cost, and leaving
        the holder of a hot document for it copies the document (the RAG shape's share of
        the ceiling fell from 96.7% to 93.3-95.0% in ``routing_bench.py`` when they were
        left too). The node with the least work waiting always qualifies: it computes at
        most the whole prompt."""
        behind = self._behind
        fresh = (1 + HOT_WAIT) * (tokens + min(queued[i] for i in keep))
        return [
            i
            for i in keep
            if uncached[i] + queued[i] <= fresh or not behind.get((live[i].id, first), 0)
        ]

    def _continues(self, node_id: int, held: int, chunks: list[int]) -> bool:
        """Whether the prompt continues one earlier prompt the node holds: what it holds
        of it ends where that prompt ended (and only that one), and the prompt goes on."""
        return 0 < held < len(chunks) and self._ends.get((node_id, chunks[held - 1])) == 1

    def place(self, node: Node, key: int, prompt: Prompt | None = None) -> Placement:
        prompt = prompt or _UNKNOWN
        held = self.view.of(node.id).held(prompt.chunks)
        cached = self.view.cached(node.id, prompt, held)
        work = max(prompt.tokens - cached, 0)
        self.waiting[node.id] = self.waiting.get(node.id, 0) + work
        self._inflight[node.id] = self._inflight.get(node.id, 0) + 1
        opening = prompt.chunks[0] if prompt.chunks else None
        if opening is not None:
            self._behind[node.id, opening] = self._behind.get((node.id, opening), 0) + 1
        self._count(node.id, prompt.chunks)
        # Held from now on: a request sharing this prefix that comes before this prefill
        # ends finds it cached, as vLLM computes the shared blocks once.
        self.view.placed(node.id, node.role, node.url, prompt)
        source = self.view.source(node.id, prompt)
        return Placement(node, cached > 0, cached, work, source, opening)

    def heard(self, node: Node, prompt: Prompt) -> None:
        """Another router sharing ``--state`` placed ``prompt`` on ``node``."""
        self._count(node.id, prompt.chunks)
        self.view.of(node.id).insert(prompt.chunks)

    def _count(self, node_id: int, chunks: list[int]) -> None:
        """A prompt placed on the node: it counts towards the node's share (every prefill,
        a conversation's next turn too), and its end is remembered (``_continues``)."""
        if not chunks:
            return
        ends, end = self._ends, (node_id, chunks[-1])
        ends[end] = min(ends.pop(end, 0) + 1, 2)
        if len(ends) > RECENT_KEYS:
            del ends[next(iter(ends))]
        lately, lately_counts = self._lately, self._lately_counts
        lately.append(chunks[0])
        lately_counts[chunks[0]] = lately_counts.get(chunks[0], 0) + 1
        recent, counts = self._recent, self._counts
        recent.append((node_id, len(chunks)))
        counts[node_id] = counts.get(node_id, 0) + 1
        self._chunks += len(chunks)
        self._trim()

    def _trim(self) -> None:
        """The windows back to their sizes, which follow the fleet's (smaller once nodes
        were removed: a loop, as more than one may be over)."""
        nodes = max(len(self.nodes), 1)
        lately, recent, counts = self._lately, self._recent, self._counts
        while len(lately) > nodes:
            _decrement(self._lately_counts, lately.popleft())
        while len(recent) > RECENT_PER_NODE * nodes:
            gone, gone_chunks = recent.popleft()
            _decrement(counts, gone)
            self._chunks -= gone_chunks

    def release(self, placement: Placement) -> None:
        node_id = placement.node.id
        left = self.waiting.get(node_id, 0) - placement.work
        if left > 0:
            self.waiting[node_id] = left
        else:
            self.waiting.pop(node_id, None)
        _decrement(self._inflight, node_id)
        if placement.opening is not None:
            _decrement(self._behind, (node_id, placement.opening))


def _decrement(counts: dict[Any, int], key: Any) -> None:
    left = counts.get(key, 0) - 1
    if left > 0:
        counts[key] = left
    else:
        counts.pop(key, None)


def _beyond(excess: float, band: float) -> float:
    """Prefills over (or under) a node's share beyond the band any node may be off by."""
    return max(excess - band, 0.0) + min(excess + band, 0.0)


def _load(node: Node) -> int:
    return len(node.bound)


_UNKNOWN = Prompt()

POLICIES: dict[str, type[PrefillPolicy]] = {
    policy.name: policy for policy in (Prefix, Cost, LeastLoaded, RoundRobin)
}
DEFAULT_POLICY = Prefix.name

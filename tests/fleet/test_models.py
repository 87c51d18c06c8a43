"""Model pools without a server: what a node's /v1/models says, which requests the fleet
answers 404, and the decode pool's per-model queues (under asyncio and trio)."""

from __future__ import annotations

import anyio
import orjson
import pytest

from pd_router.errors import Busy, Evidence, ModelNotFound, QueueTimeout, Unavailable
from pd_router.fleet import models
from pd_router.fleet.nodes import Failure, Node, State
from pd_router.fleet.pool import DecodePool
from pd_router.fleet.prefill import Prefix
from pd_router.fleet.registry import Fleet
from tests.fleet.test_pool import assert_idle


def node(i: int, *served: str, slots: int = 1) -> Node:
    return Node(id=i, url=f"http://n{i}", slots=slots, models=frozenset(served) or None)


# What an engine lists


def test_an_openai_model_list_gives_its_ids_and_their_objects() -> None:
    answer = {"object": "list", "data": [{"id": "llama"}, {"id": "qwen", "object": "model"}]}
    assert models.parse(answer) == {"llama": {"id": "llama"}, "qwen": answer["data"][1]}


def test_a_model_object_is_kept_whole_up_to_2_kib_else_its_small_openai_fields() -> None:
    whole = {"id": "m", "object": "model", "max_model_len": 4096, "root": "r" * 1900}
    huge = {"id": "big", "created": 7, "owned_by": "vllm", "x": "y" * models.MAX_CARD}
    odd = {"id": "odd", "created": "yesterday", "owned_by": "o" * 10_000, "x": "y" * 3000}
    deep = orjson.loads('{"id": "deep", "x": ' + "[" * 600 + "]" * 600 + "}")  # 1 KiB
    cards = models.parse({"data": [whole, huge, odd, {"id": "m", "second": True}, deep]})
    assert cards == {
        "m": whole,  # the first object of an id
        "big": {"id": "big", "object": "model", "created": 7, "owned_by": "vllm"},
        "odd": {"id": "odd", "object": "model"},
        "deep": {"id": "deep", "object": "model"},  # deeper than the router would write
    }


def test_an_id_that_could_forge_a_log_line_is_not_kept() -> None:
    answer = {"data": [{"id": "a\nb"}, {"id": "evil\u202e"}, {"id": "fine-模型"}]}
    assert list(models.parse(answer)) == ["fine-模型"]


def read(node: Node) -> Node:
    node.cards = {name: {"id": name, "n": node.id} for name in sorted(node.models or ())}
    return node


def test_what_v1_models_lists_is_each_id_once_from_the_nodes_read() -> None:
    first, second, unread = read(node(0, "a", "b")), read(node(1, "b", "c")), node(2)
    assert models.listing([first, unread], [second, unread]) == [
        {"id": "a", "n": 0},
        {"id": "b", "n": 0},
        {"id": "c", "n": 1},
    ]
    assert models.listing([unread], [unread]) is None  # nothing read: the router cannot say
    assert models.listing([], []) is None


def test_v1_models_lists_only_what_a_request_may_ask_for() -> None:
    """A model served by one role only would be listed, then answered 404."""
    prefill, decode = [read(node(0, "a", "b")), read(node(1, "c"))], [read(node(2, "b", "c"))]
    assert [card["id"] for card in models.listing(prefill, decode) or []] == ["b", "c"]
    for model in ("b", "c"):
        models.check(model, models.offer(prefill, decode))
    with pytest.raises(ModelNotFound):
        models.check("a", models.offer(prefill, decode))
    # No prefill node serving: what the decode nodes serve (their requests get 503).
    assert [card["id"] for card in models.listing([], decode) or []] == ["b", "c"]


@pytest.mark.parametrize(
    "answer",
    [None, [], {"data": {}}, {"data": []}, {"data": [{"id": ""}, {"id": 3}, "x"]}],
)
def test_an_answer_that_names_no_model_teaches_nothing(answer: object) -> None:
    # Taken at its word, an empty list would send nothing to the node; unknown lets the
    # engine answer for itself.
    with pytest.raises(ValueError):
        models.parse(answer)


def test_a_lying_engine_cannot_fill_the_router_with_models() -> None:
    answer = {"data": [{"id": f"m{i}"} for i in range(100_000)] + [{"id": "x" * 10_000}]}
    learned = models.parse(answer)
    assert len(learned) == models.MAX_MODELS
    assert all(len(i) <= models.MAX_ID for i in learned)
    answer = {"data": [{"id": f"m{i}", "pad": "x" * 100_000} for i in range(1000)]}
    learned = models.parse(answer)  # 100 MB offered: 256 small objects kept
    assert sum(len(orjson.dumps(card)) for card in learned.values()) < 256 * 64


# Which requests get 404


def test_a_model_served_by_both_roles_passes() -> None:
    models.check("a", models.offer([node(0, "a", "b")], [node(1, "a")]))


def test_a_model_nobody_serves_is_404_naming_what_is_served() -> None:
    with pytest.raises(ModelNotFound) as caught:
        models.check(
            "gpt-5", models.offer([node(0, "a", "b"), node(1, "c")], [node(2, "a"), node(3, "c")])
        )
    error = caught.value
    assert (error.status, error.code, error.param) == (404, "model_not_found", "model")
    assert error.type == "invalid_request_error"
    assert error.message == "The model 'gpt-5' is not served here (served: a, c)"


def test_a_model_only_one_role_serves_is_404_too() -> None:
    with pytest.raises(ModelNotFound, match=r"\(served: a\)"):
        models.check("b", models.offer([node(0, "a", "b")], [node(1, "a")]))


def test_a_node_whose_models_are_unknown_may_serve_anything() -> None:
    models.check("anything", models.offer([node(0, "a"), node(1)], [node(2)]))


def test_a_role_with_no_node_is_left_to_say_503() -> None:
    models.check("a", models.offer([], [node(1, "a")]))
    with pytest.raises(ModelNotFound):
        models.check("b", models.offer([], [node(1, "a")]))


def test_the_404_names_twenty_models_at_most() -> None:
    many = [f"m{i:03}" for i in range(30)]
    with pytest.raises(ModelNotFound) as caught:
        models.check("x", models.offer([node(0, *many)], [node(1, *many)]))
    assert caught.value.message.endswith("m019 and 10 more)")


# The decode pool, per model


@pytest.mark.anyio
async def test_a_burst_on_one_model_queues_nobody_asking_for_another() -> None:
    pool = DecodePool([node(0, "a"), node(1, "b")])
    held = await pool.acquire(0, "a")
    queued = anyio.Event()

    async def wait_for_a() -> None:
        queued.set()
        with pytest.raises(QueueTimeout):
            await pool.acquire(0.3, "a")

    async with anyio.create_task_group() as tg:
        tg.start_soon(wait_for_a)
        await queued.wait()
        await anyio.sleep(0)
        assert pool.queue_depth == 1
        other = await pool.acquire(0, "b")  # at once, not behind the waiter for "a"
        assert other.node.id == 1
        other.release()
    held.release()
    assert_idle(pool)


@pytest.mark.anyio
async def test_a_request_lands_only_on_a_node_serving_its_model() -> None:
    pool = DecodePool([node(0, "a", slots=4), node(1, "b", slots=4), node(2, slots=1)])
    held = [await pool.acquire(0, "a") for _ in range(5)]
    # Four on a's node, one on the node whose models are unknown, none on b's.
    assert sorted(r.node.id for r in held) == [0, 0, 0, 0, 2]
    with pytest.raises(Busy):
        await pool.acquire(0, "a")
    for reservation in held:
        reservation.release()
    assert_idle(pool)


@pytest.mark.anyio
async def test_a_freed_slot_goes_to_the_oldest_waiter_its_node_serves() -> None:
    pool = DecodePool([node(0, "a", "b"), node(1, "b")])
    on_shared = await pool.acquire(0, "a")
    on_b = await pool.acquire(0, "b")
    assert (on_shared.node.id, on_b.node.id) == (0, 1)
    served: list[str] = []
    done = anyio.Event()

    async def wait(name: str, model: str) -> None:
        async with pool.reserve(5, model) as reservation:
            served.append(f"{name}@{reservation.node.id}")
            await done.wait()

    async with anyio.create_task_group() as tg:
        for name, model in [("b1", "b"), ("a1", "a"), ("b2", "b")]:
            tg.start_soon(wait, name, model)
            await anyio.sleep(0.01)
        assert pool.queue_depth == 3
        on_shared.release()  # node 0 serves both: the oldest waiter, b1, gets it
        await anyio.sleep(0.01)
        assert served == ["b1@0"]
        on_b.release()  # node 1 serves only b: b2 gets it, though a1 is older
        await anyio.sleep(0.01)
        assert served == ["b1@0", "b2@1"]
        assert pool.queue_depth == 1
        done.set()
    assert served[2] == "a1@0"
    assert_idle(pool)


@pytest.mark.anyio
async def test_waiters_of_a_model_whose_last_node_dies_are_told_others_wait_on() -> None:
    a, b = node(0, "a"), node(1, "b")
    fleet = Fleet([node(5)], [a, b])
    pool = fleet.pool
    held_a, held_b = await pool.acquire(0, "a"), await pool.acquire(0, "b")
    outcomes: dict[str, str] = {}

    async def wait(model: str) -> None:
        try:
            async with pool.reserve(0.5, model):
                outcomes[model] = "served"
        except (Unavailable, QueueTimeout) as error:
            outcomes[model] = error.message

    async with anyio.create_task_group() as tg:
        tg.start_soon(wait, "a")
        tg.start_soon(wait, "b")
        await anyio.sleep(0.01)
        fleet.failed(a, Failure("refused", "connection refused", Evidence.FATAL))
        await anyio.sleep(0.01)
        assert outcomes == {"a": "no live decode node serves 'a'"}
        held_b.release()
    assert outcomes["b"] == "served"
    held_a.release()
    assert_idle(pool)


@pytest.mark.anyio
async def test_a_busy_model_is_named_when_it_is_why_and_only_then() -> None:
    pool = DecodePool([node(0, "a"), node(1, "b")])
    held = await pool.acquire(0, "a")  # a's only slot; b's is free
    with pytest.raises(Busy) as busy:
        await pool.acquire(0, "a")
    assert busy.value.message == "all decode nodes serving 'a' busy"
    with pytest.raises(QueueTimeout, match=r"^no decode node serving 'a' free after waiting \d"):
        await pool.acquire(0.05, "a")
    held.release()
    one_model = DecodePool([node(0, "a"), node(1, "a")])
    held = [await one_model.acquire(0, "a") for _ in range(2)]
    with pytest.raises(Busy, match="^all decode nodes busy$"):
        await one_model.acquire(0, "a")
    with pytest.raises(QueueTimeout, match="^no decode node free after waiting"):
        await one_model.acquire(0.05, "a")
    for reservation in held:
        reservation.release()
    assert_idle(pool)
    assert_idle(one_model)


@pytest.mark.anyio
async def test_a_models_only_node_gets_its_requests_while_unhealthy() -> None:
    # The slow-engine fallback is per model: b's only node is unhealthy, and the healthy
    # node of another model does not make b's requests fail.
    a, b = node(0, "a"), node(1, "b")
    pool = DecodePool([a, b])
    b.state = State.UNHEALTHY
    pool.refresh()
    reservation = await pool.acquire(0, "b")
    assert reservation.node is b
    reservation.release()
    assert_idle(pool)


@pytest.mark.anyio
async def test_learning_a_nodes_models_fails_the_waiters_it_no_longer_serves() -> None:
    shared = node(0)
    fleet = Fleet([node(5)], [shared])
    held = await fleet.pool.acquire(0, "a")
    with anyio.fail_after(2):
        async with anyio.create_task_group() as tg:

            async def wait() -> None:
                with pytest.raises(Unavailable, match="no live decode node serves 'a'"):
                    await fleet.pool.acquire(5, "a")

            tg.start_soon(wait)
            await anyio.sleep(0.01)
            fleet.learned(shared, {"b": {"id": "b"}})
    held.release()
    assert_idle(fleet.pool)


def test_prefill_picks_only_nodes_serving_the_model() -> None:
    nodes = [node(0, "a"), node(1, "b"), node(2, "b")]
    policy = Prefix(nodes)
    picked = {policy.pick(key, model="b").id for key in range(200)}  # type: ignore[union-attr]
    assert picked == {1, 2}
    assert policy.pick(7, model="c") is None
    assert policy.pick(7, avoid=nodes[0], model="a") is None


def test_prefill_falls_back_to_a_models_unhealthy_node_only_for_that_model() -> None:
    nodes = [node(0, "a"), node(1, "b")]
    nodes[1].state = State.UNHEALTHY
    policy = Prefix(nodes)
    policy.refresh()
    assert policy.pick(1, model="b") is nodes[1]
    assert {policy.pick(key).id for key in range(50)} == {0}  # type: ignore[union-attr]

"""Requests in flight per client key, in-process (``fleet/keys.py``), under asyncio and trio."""

from __future__ import annotations

import pytest

from pd_router.errors import RateLimited
from pd_router.fleet.keys import KeyLimits

pytestmark = pytest.mark.anyio


async def test_past_its_limit_a_key_is_refused_and_no_other_key_is() -> None:
    limits = KeyLimits()
    await limits.enter("carol", 2)
    await limits.enter("carol", 2)
    with pytest.raises(RateLimited) as refused:
        await limits.enter("carol", 2)
    assert refused.value.status == 429 and refused.value.code == "rate_limit_exceeded"
    assert "2 requests in flight" in refused.value.message
    await limits.enter("alice", 1)
    limits.leave("carol")
    await limits.enter("carol", 2)
    for name in ("carol", "carol", "alice"):
        limits.leave(name)
    assert limits.in_flight == {}

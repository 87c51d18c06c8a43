"""Engine settings (fixed at start) and runtime knobs (changed by POST /sim/config)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Literal

from pd_router.sim.asgi import ApiError

Role = Literal["prefill", "decode"]
# The P/D protocol spoken: vLLM's NixlConnector handshake, or SGLang's bootstrap rooms.
Dialect = Literal["vllm", "sglang"]


@dataclass(frozen=True)
class EngineSettings:
    role: Role
    host: str
    port: int
    engine_id: str
    model: str = "sim-model"
    block_size: int = 16
    prefix_cache_blocks: int = 1 << 20
    # Prefills computed at once; more wait their turn (a compute-bound engine).
    prefill_concurrency: int = 1024
    max_model_len: int = 4096
    kv_lease: float = 30.0
    slots: int = 64
    standalone: bool = False
    name_prefill: bool = False
    # Publish KV cache events on this port (vLLM's ZMQ wire format); None: no events.
    kv_events_port: int | None = None
    # As vLLM's --api-key: every /v1/ request must carry 'Authorization: Bearer <key>'.
    api_key: str | None = None
    dialect: Dialect = "vllm"
    # sglang: how long a prefill holds a computed room for a decode engine to take, and how
    # long a take waits for its room to be computed.
    bootstrap_timeout: float = 30.0


@dataclass
class SimConfig:
    """Knobs a test may turn while the engine runs; both roles accept every key.

    ``fail_after_tokens``: decode cuts the connection after that many token events, without
    ``[DONE]`` (non-streaming: after generating that many tokens, mid-body); prefill cuts
    its response body whenever it is set, and pins nothing.
    ``fail_status``: answer every generation request with this status and an OpenAI error.
    ``health_status``: ``/health`` answers this error status (a proxy in front refusing it).
    ``prefill_delay`` + ``prefill_per_token`` x the prompt tokens not in the prefix cache:
    how long a prefill computes.
    ``health_delay``: ``/health`` answers only after this long (a busy engine).
    ``models_delay``: ``/v1/models`` answers only after this long.
    ``stall``: while true, decode streams send nothing more and ``/health`` still answers
    200 (a hung scheduler, as vLLM's ``/health`` only reads an error flag).
    """

    prefill_delay: float = 0.0
    prefill_per_token: float = 0.0
    accept_delay: float = 0.0
    ttft: float = 0.0
    itl: float = 0.0
    health_delay: float = 0.0
    models_delay: float = 0.0
    stall: bool = False
    default_max_tokens: int = 16
    fail_after_tokens: int | None = None
    fail_status: int | None = None
    health_status: int | None = None
    fail_message: str | None = None

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def update(self, changes: dict[str, Any]) -> None:
        """Apply every change or none of them; raises ApiError naming the bad key."""
        validated = {key: _validate(key, value) for key, value in changes.items()}
        for key, value in validated.items():
            setattr(self, key, value)


_DELAYS = (
    "prefill_delay",
    "prefill_per_token",
    "accept_delay",
    "ttft",
    "itl",
    "health_delay",
    "models_delay",
)


def _count(value: object) -> int | None:
    """The value as a non-negative int, or None if it is anything else (bools included)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        return None
    return value


def _validate(key: str, value: object) -> object:
    if key in _DELAYS:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
            raise ApiError(f"{key} must be a non-negative number of seconds", key)
        return float(value)
    if key == "default_max_tokens":
        if not _count(value):
            raise ApiError(f"{key} must be a positive integer", key)
        return value
    if key == "fail_after_tokens":
        if value is not None and _count(value) is None:
            raise ApiError(f"{key} must be a non-negative integer or null", key)
        return value
    if key in ("fail_status", "health_status"):
        status = _count(value)
        if value is not None and (status is None or not 400 <= status <= 599):
            raise ApiError(f"{key} must be an HTTP error status (400-599) or null", key)
        return value
    if key == "stall":
        if not isinstance(value, bool):
            raise ApiError(f"{key} must be true or false", key)
        return value
    if key == "fail_message":
        if value is not None and not isinstance(value, str):
            raise ApiError(f"{key} must be a string or null", key)
        return value
    raise ApiError(f"unknown config key {key!r}", key)

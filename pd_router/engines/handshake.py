"""vLLM's P/D dialect (NixlConnector pull): what prefill and decode are sent, and usage;
and what a decode engine is handed in either dialect (``Prefilled``).

The prefill engine computes the prompt's KV and keeps it pinned for the decode engine to
pull; its answer carries ``kv_transfer_params`` naming where the blocks are. The decode
engine gets the client's request unchanged plus exactly that object. (SGLang's dialect,
``bootstrap.py``, sends both engines one request at once.)
"""

from __future__ import annotations

from typing import Any

# What vLLM's NixlConnector expects on the prefill side: "keep the KV for a remote decode".
PREFILL_KV_PARAMS: dict[str, Any] = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}

# Fields that make sense only for the decode phase and would change what prefill computes.
_DECODE_ONLY = ("stream_options", "min_tokens")


def hands_over(body: dict[str, Any]) -> bool:
    """Whether a prefill engine's one-token answer to the request can be handed over to a
    decode engine, as vLLM computes it; else the decode engine computes the request whole,
    as one engine alone would. A validated body (``edge/validation.py``: ``n`` is a positive
    integer if given). Not handed over:

    * several sequences: vLLM answers a request with one ``kv_transfer_params`` (a batch of
      prompts, its first prompt's; ``n`` samples, one of them), so the decode engine would
      decode every other sequence from the wrong blocks, and theirs would stay pinned;
    * beam search (``use_beam_search``): vLLM builds its parameters without the request's
      ``kv_transfer_params`` (``to_beam_search_params``), so the prefill answers none, a
      502 for the client and, three times over, a node taken for dead;
    * ``tool_choice: "required"``: vLLM parses the answer's text as the list of tool calls
      (``TypeAdapter(list[FunctionDefinition])`` in its chat serving), and one token of it
      is no list: a 400 no engine alone would answer;
    * what asks for the prompt's own log-probabilities (``prompt_logprobs``, or ``echo``
      with ``logprobs`` or with ``max_tokens`` 0): they come from computing the prompt,
      which a decode engine that pulls its KV does not do."""
    n = body.get("n")
    if n is not None and n > 1:
        return False
    if body.get("use_beam_search") or body.get("tool_choice") == "required":
        return False
    if body.get("prompt_logprobs") is not None or (
        body.get("echo") and (body.get("logprobs") is not None or body.get("max_tokens") == 0)
    ):
        return False
    prompt = body.get("prompt")
    return not (isinstance(prompt, list) and len(prompt) > 1 and isinstance(prompt[0], str | list))


def prefill_body(body: dict[str, Any]) -> dict[str, Any]:
    """The client's request as a one-token, non-streaming prefill."""
    out = {key: value for key, value in body.items() if key not in _DECODE_ONLY}
    out["max_tokens"] = 1
    if "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1
    out["stream"] = False
    out["kv_transfer_params"] = dict(PREFILL_KV_PARAMS)
    return out


def decode_body(body: dict[str, Any], kv_transfer_params: dict[str, Any]) -> dict[str, Any]:
    return {**body, "kv_transfer_params": kv_transfer_params}


def local_body(body: dict[str, Any]) -> dict[str, Any]:
    """The client's request for a decode engine to compute itself (a local prefill): no
    ``kv_transfer_params``, so a vLLM ``kv_consumer`` prefills it like a plain engine."""
    return {key: value for key, value in body.items() if key != "kv_transfer_params"}


def drain_body(body: dict[str, Any], kv_transfer_params: dict[str, Any]) -> dict[str, Any]:
    """A decode request whose only job is to make the engine pull (and so free) the KV.

    Sent when the client left between prefill and decode: one token, not streamed, so it
    ends as soon as the blocks were pulled.
    """
    out = prefill_body(body)
    out["kv_transfer_params"] = kv_transfer_params
    return out


class Prefilled:
    """What the router keeps from a prefill answer."""

    __slots__ = (
        "kv_transfer_params",
        "prompt_details",
        "prompt_tokens",
        "prompt_token_ids",
        "is_local",
        "sent",
    )

    def __init__(self, answer: Any) -> None:
        params = answer.get("kv_transfer_params") if isinstance(answer, dict) else None
        # No prefill engine: the decode engine computes the prompt (``local``).
        self.is_local = False
        if not isinstance(params, dict):
            if not _stopped(answer):
                raise ValueError(
                    "answer has no kv_transfer_params "
                    "(is the engine running with a kv_producer --kv-transfer-config?)"
                )
            # The prefill ended at its first token (an end-of-sequence or stop token), and
            # vLLM keeps KV for a decode engine only for a prefill cut at its max_tokens:
            # the request's own outcome, not the engine's fault. The decode engine
            # computes the prompt itself and answers it.
            params, self.is_local = {}, True
        self.kv_transfer_params: dict[str, Any] = params
        # SGLang's dialect: the request the decode engine gets, as the prefill engine got it.
        self.sent: dict[str, Any] | None = None
        usage = answer.get("usage")
        # The engine's count of the prompt: what the router's estimate learns from.
        self.prompt_tokens: object = usage.get("prompt_tokens") if isinstance(usage, dict) else None
        details = usage.get("prompt_tokens_details") if isinstance(usage, dict) else None
        # The decode engine reports the whole transferred prompt as cached; what was
        # really served from cache is what the prefill engine saw.
        self.prompt_details: dict[str, Any] | None = details if isinstance(details, dict) else None
        # The prompt's token ids, when asked for (``return_token_ids``): vLLM answers them at
        # the top of a chat completion and in the choice of a completion.
        ids = answer.get("prompt_token_ids")
        if ids is None:
            choices = answer.get("choices")
            if isinstance(choices, list) and choices and isinstance(choices[0], dict):
                ids = choices[0].get("prompt_token_ids")
        self.prompt_token_ids: list[Any] | None = ids if isinstance(ids, list) else None

    @classmethod
    def local(cls) -> Prefilled:
        """No prefill engine: the decode engine computes the prompt, and its usage is true."""
        prefilled = cls({"kv_transfer_params": {}})
        prefilled.is_local = True
        return prefilled

    @classmethod
    def bootstrapped(cls, sent: dict[str, Any]) -> Prefilled:
        """SGLang's dialect: the decode engine gets ``sent``, the prefill engine's request,
        and takes the KV from it by its room; its usage is its own."""
        prefilled = cls({"kv_transfer_params": {}})
        prefilled.sent = sent
        return prefilled

    @property
    def pins(self) -> bool:
        """Whether the prefill engine keeps KV pinned until a decode engine pulls it (vLLM's
        dialect): a decode engine's refusal is then drained, and so is a hand-off the client
        left. SGLang's prefill engine lets go when its own request is closed."""
        return not self.is_local and self.sent is None

    def forget(self) -> None:
        """The engines have all they need: what was sent is not held while the answer
        streams (a long prompt would set the memory each open stream costs)."""
        self.kv_transfer_params = {}
        if self.sent is not None:
            self.sent = {}

    def fix_usage(self, usage: dict[str, Any]) -> None:
        if not self.pins:
            return
        if self.prompt_details is None:
            usage.pop("prompt_tokens_details", None)
        else:
            usage["prompt_tokens_details"] = self.prompt_details


def _stopped(answer: Any) -> bool:
    """A prefill answer whose generation ended before its max_tokens (``finish_reason``
    other than ``length``): it ended at its first token."""
    choices = answer.get("choices") if isinstance(answer, dict) else None
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        return False
    reason = choices[0].get("finish_reason")
    return isinstance(reason, str) and reason != "length"

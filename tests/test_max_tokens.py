"""``max_tokens`` against the engines' context, end to end: the router's CLI in front of
simulated engines with a 16-token context (``--max-model-len 16``), the ``openai`` SDK as
the client. The simulated engines decide as vLLM 0.32 does."""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest

from pd_router.sim.fleet import SimFleet
from tests.helpers import RouterProcess

SMALL = ["--max-model-len", "16"]


@pytest.fixture(scope="module")
def router() -> Iterator[RouterProcess]:
    with SimFleet(prefill=1, decode=1, prefill_args=SMALL, decode_args=SMALL) as fleet:
        prefill, decode = [fleet.prefill[0].url], [fleet.decode[0].url]
        with RouterProcess(prefill, decode) as router:
            yield router


def client_for(router: RouterProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{router.url}/v1", api_key="unused", max_retries=0)


def test_max_tokens_beyond_the_context_is_a_400_as_vllm_gives(router: RouterProcess) -> None:
    """2^63 passed the router's checks and a simulated engine then generated until the
    client left; vLLM (0.32) refuses more than max_model_len with this message."""
    for name in ("max_tokens", "max_completion_tokens"):
        with pytest.raises(openai.BadRequestError) as caught:
            client_for(router).chat.completions.create(
                model="sim-model",
                messages=[{"role": "user", "content": "hello"}],
                stream=True,
                timeout=30,
                **{name: 2**63},
            )
        message = caught.value.body["message"]
        assert message.startswith("decode engine http://127.0.0.1:")
        assert message.endswith(
            f"/v1/chat/completions: {name}=9223372036854775808 cannot be greater than "
            "max_model_len=16. Please request fewer output tokens. "
            f"(parameter={name}, value=9223372036854775808)"
        )
    router.assert_idle()


def test_the_answer_ends_where_the_context_does(router: RouterProcess) -> None:
    """max_tokens within max_model_len but past the prompt's room: vLLM generates what fits."""
    prompt = "one two three four five six"
    answer = client_for(router).completions.create(
        model="sim-model", prompt=prompt, max_tokens=16, timeout=30
    )
    assert answer.usage is not None
    assert (answer.usage.prompt_tokens, answer.usage.completion_tokens) == (6, 10)
    words = prompt.split()  # a simulated decode engine repeats the pulled prompt's words
    assert answer.choices[0].text == "".join(" " + words[i % 6] for i in range(10))
    assert answer.choices[0].finish_reason == "length"
    router.assert_idle()

"""Simulated vLLM engines for testing and demoing the router without a GPU.

One OS process per engine (``python -m pd_router.sim prefill|decode ...``). The engines
speak vLLM's NixlConnector prefill/decode protocol: the prefill engine answers with
``kv_transfer_params`` naming its pinned KV blocks, and the decode engine pulls those
blocks (``POST /kv/pull`` on the prefill's HTTP port stands in for NIXL) before it
generates. A token is a whitespace-separated word of the prompt, and the decode output
repeats the pulled prompt tokens, so a test can tell which prefill an answer came from.
With ``--dialect sglang`` they speak SGLang's bootstrap protocol instead (``bootstrap.py``).

``pd_router.sim.fleet`` starts and stops engines from Python. This package imports nothing
from the rest of ``pd_router``.
"""

from pd_router.sim.fleet import EngineProcess, SimFleet, free_port

__all__ = ["EngineProcess", "SimFleet", "free_port"]

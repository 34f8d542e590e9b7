"""TensorRT-LLM's handoff (``sim.run.pd_trtllm`` has the whole sequence): ``sim.loop.handoff``'s
with the context server's copy of the request keeping the client's max_tokens.

TensorRT-LLM's disaggregated server sends the context server a copy of the client's request with
only its ``disaggregated_params`` (``context_only``) and streaming changed
(``tensorrt_llm/serve/openai_disagg_service.py``, ``_get_ctx_request``; earlier
``openai_disagg_server.py``, ``_send_context_request``): max_tokens stays the client's. The
context server's capacity scheduler therefore keeps back prompt + max_tokens blocks for it under
GUARANTEED_NO_EVICT (``KVCacheManager::getRemainingBlocksToCompletion`` has no context-only case),
though it computes the prompt and samples one token only: the context phase over, the request
leaves the scheduler (``_send_disagg_ctx_cache``: DISAGG_CONTEXT_TRANS_IN_PROGRESS; under the
overlap scheduler this happens when its last chunk is launched, so it is neither scheduled nor
counted in the next step: ``policies.tensorrt_llm``'s ``context_server``).
"""

from __future__ import annotations

from sim.loop.handoff import Handoff


class TrtllmHandoff(Handoff):
    """``Handoff`` whose context copies keep the client's max_tokens (they still end after their
    first token: they are submitted with a true output of one)."""

    kind = "tensorrt_llm"
    prefill_keeps_max_tokens = True

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        for s in self.prefill:
            s.policy.context_server = True

"""TensorRT-LLM's disaggregated serving (TensorRT-LLM 1.2, PyTorch backend): which handoff it is,
and the checks of a ``disaggregation`` section whose pools run ``tensorrt_llm``.

The handoff is source-first, as vLLM's NixlConnector's (``sim.loop.handoff``), not SGLang's
destination-first one: the disaggregated server (``tensorrt_llm/serve/openai_disagg_service.py``,
``_send_disagg_request_ctx_first``, the default ``schedule_style``; earlier
``openai_disagg_server.py``) sends the request to a context server as ``context_only``, not
streamed, and waits for its answer; only then does it send it, as ``generation_only`` with the
answer's ``disaggregated_params`` (``ctx_request_id``, ``first_gen_tokens``: the token the context
side sampled), to a generation server, which allocates its KV and pulls it. So ``sim.loop.handoff``
runs it with these differences:

1. Context side (``py_executor.py``: ``_send_disagg_ctx_cache``, ``_handle_responses``,
   ``_terminate_disagg_ctx_finished_requests``): the request is prefilled and samples its first
   token, the answer goes back, and its KV blocks stay held (DISAGG_CONTEXT_TRANS_IN_PROGRESS; with
   block reuse pinned by ``store_blocks_for_reuse``) until the transfer to the generation side
   completes (DISAGG_CONTEXT_COMPLETE), as ``SchedulerState.held``. The pool runs
   ``policies.tensorrt_llm``; its copy of the request keeps the client's max_tokens, so
   GUARANTEED_NO_EVICT keeps back prompt + max_tokens blocks for it until its context phase is
   launched (``sim.loop.handoff_trtllm``).
2. Generation side: ``policies.tensorrt_llm_disagg`` (DISAGG_GENERATION_INIT admitted by the
   capacity scheduler, the KV received, the first token appended from ``first_gen_tokens``).
3. The client's stream is the generation server's: its first token is ``first_gen_tokens``, sent
   by the generation server when it first schedules the request after the transfer
   (``_handle_first_token_response``). So TTFT = context queue + prefill + hop + generation-side
   admission + transfer + the wait for the generation server's next pass; no decode step
   (``decode_first_step_s`` is 0).
4. No abort timeout: KV nobody reads stays held (``kv_transfer_timeout_ms`` is off by default;
   when set, a timed-out transfer fails the request, which is not modelled), so
   ``abort_timeout_s`` (vLLM's) is refused.

Refused here: a ``tensorrt_llm`` pool paired with another engine's (the cache transceiver speaks
only to TensorRT-LLM), a generation pool whose ``capacity_scheduler_policy`` is not
GUARANTEED_NO_EVICT, and ``abort_timeout_s``. Not modelled: the generation-first
``schedule_style`` of later versions, a request that ends at its first token (the disaggregated server answers from the context side and
its KV waits for a transfer that never comes; here it goes through the generation side, which
finishes it at its first pass), layer-wise transfer (DISAGG_CONTEXT_INIT_AND_TRANS),
``max_tokens_in_buffer``.
"""

from __future__ import annotations

from typing import Any

from sim.base.strict import ConfigError

KIND = "tensorrt_llm"


def check_tensorrt_llm_pools(section: dict[str, Any], prefill: Any, decode: Any, source: str) -> bool:
    """True if the pools run TensorRT-LLM's handoff (the module doc), after its checks; False
    where neither pool is ``tensorrt_llm``. ``prefill``, ``decode``: the ``Pool``s."""
    p_kind, d_kind = prefill.cfg.policy.kind, decode.cfg.policy.kind
    if KIND not in (p_kind, d_kind):
        return False
    if p_kind != d_kind:
        other, side = ("prefill", p_kind) if d_kind == KIND else ("decode", d_kind)
        raise ConfigError(f"{source}: field 'disaggregation.{other}.policy.kind' is {side}, the other pool's is "
                          f"{KIND}: TensorRT-LLM's cache transceiver hands KV only between TensorRT-LLM context "
                          f"and generation servers; set both pools' policy kind to {KIND}, or neither")
    policy = decode.cfg.policy.capacity_scheduler_policy
    if policy != "GUARANTEED_NO_EVICT":
        raise ConfigError(f"{source}: field 'disaggregation.decode.policy.capacity_scheduler_policy' is "
                          f"{policy}: a TensorRT-LLM generation server is modelled under GUARANTEED_NO_EVICT "
                          f"only (the default); remove it or set GUARANTEED_NO_EVICT")
    if "abort_timeout_s" in section:
        raise ConfigError(f"{source}: field 'disaggregation.abort_timeout_s' is vLLM's NixlConnector timeout; "
                          f"TensorRT-LLM's context server keeps the KV until it is read (kv_transfer_timeout_ms "
                          f"is off by default, and a timed-out transfer that fails the request is not "
                          f"modelled): remove it")
    return True

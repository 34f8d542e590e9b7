"""TensorRT-LLM's generation server in disaggregated serving (``state.remote``: ``sim.loop.handoff``),
as its PyTorch executor and capacity scheduler run a ``generation_only`` request (TensorRT-LLM 1.2
era: ``tensorrt_llm/_torch/pyexecutor/py_executor.py``, a version of the 1.2 era with
``_check_kv_transfer_timeout`` and ``max_total_draft_tokens``, the index names no commit for it;
``cpp/tensorrt_llm/batch_manager/capacityScheduler.cpp``, ``GuaranteedNoEvictScheduler::impl``;
``cpp/include/tensorrt_llm/batch_manager/llmRequest.h``, ``LlmRequestState``).

The handoff is source-first: the disaggregated server sends the request to the generation side
only after the context side answered (``sim.run.pd_trtllm`` has the whole sequence). On the
generation side:

1. A request arrives as DISAGG_GENERATION_INIT (here: waiting, ``remote_kv``). The capacity
   scheduler (GUARANTEED_NO_EVICT) takes the generation requests first, each keeping back its
   blocks to completion, then the DISAGG_GENERATION_INIT ones in order ("Start by trying to include
   disagg generation init requests"), each while its blocks to completion (prompt + max_tokens)
   fit what is left and ``max_batch_size`` is not reached; the first misfit ends that scan.
   They take no token budget: the micro batch scheduler never sees them
   (``fitting_disagg_gen_init_requests`` is returned apart).
2. ``_prepare_disagg_gen_init``: the KV manager allocates the prompt's blocks (as for a context
   request), and ``_recv_disagg_gen_cache`` asks the cache transceiver to receive the KV
   (``request_and_receive_async``: DISAGG_GENERATION_TRANS_IN_PROGRESS, here ``remote.holding``;
   the transfer starts: ``remote.on_alloc``). No prefix lookup is made here: the whole prompt
   comes over the link.
3. While its KV is on its way, the request is in neither list the capacity scheduler counts
   (its state is not a schedulable one: past GENERATION_COMPLETE in the ``LlmRequestState`` of
   the 1.x headers, before CONTEXT_INIT in later ones; skipped either way): it holds its prompt's
   blocks, but its blocks to completion are not kept back and it takes no place among
   ``max_batch_size``. Another request may so be admitted into blocks it will need; decodes that
   then find no free block end the run with a PolicyError (TensorRT-LLM's KV manager fails).
4. ``_check_disagg_gen_transfer_status`` runs once per iteration, before the scheduler
   (``_prepare_and_schedule_batch``). When every active request's KV is on its way, the loop
   waits for one transfer to end (``_recv_disagg_gen_cache`` right after admitting them, and the
   next iteration's check: ``check_gen_transfer_status(1)``): requests that arrive meanwhile are
   taken in only after that (here: ``blocked``). A transfer that ended since is
   DISAGG_GENERATION_TRANS_COMPLETE, which the capacity scheduler
   counts as a generation request. ``_prepare_disagg_gen_transmission_complete`` then moves it to
   GENERATION_IN_PROGRESS with its context computed (``context_current_position = prompt_len``)
   and appends the first token the context side sampled (``first_gen_tokens``): the prompt's
   last token is not computed again. ``_handle_first_token_response`` sends that token to the
   client then, before the step runs (``py_decoding_iter == 1``): the client's first token
   leaves at the pass that schedules the request, and its first step feeds that token and
   samples the second. (Here: ``promote_received``; a request whose only output is that
   token finishes there.)
5. Then it decodes as any generation request (``policies.tensorrt_llm`` rules 3, 4 and 6;
   under the overlap scheduler ``_handle_responses`` skips its first iteration's response,
   the first token already sent).

Not modelled: MAX_UTILIZATION and STATIC_BATCH on the generation side (refused:
``sim.run.pd_trtllm``), prefix reuse on the generation side (the whole prompt is received),
a TRANS_COMPLETE request that the micro batch scheduler's budget leaves out of a step (here it
is promoted, and its first token sent, at the pass that sees its transfer ended),
``kv_transfer_timeout_ms`` (off by default), speculative decoding's context draft tokens.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Mapping

from policies.tensorrt_llm_rules import blocks_to_completion, grow, tokens_left
from sim.core.policy import PolicyError

if TYPE_CHECKING:
    from sim.core.request import Request
    from sim.core.state import SchedulerState


def promote_received(state: SchedulerState, now_s: float) -> None:
    """Step 4 of the module doc: each held request whose transfer ended (``remote.received``)
    runs from now with its prompt computed and the context side's first token appended, that
    token sent to the client now; one whose output is that token alone finishes now."""
    remote = state.remote
    received = remote.received
    if not received:
        return
    promoted: list[Request] = []
    for r in [q for q in remote.holding if q.req_id in received]:
        received.discard(r.req_id)
        remote.loading.discard(r.req_id)
        state.admit_remote(r, now_s)             # running, first_scheduled_s = now
        state.prefilling.discard(r.req_id)       # a generation request: it decodes next
        promoted.append(r)
    state.deliver_first_tokens(promoted, now_s)  # first_gen_tokens, streamed now


def generation_capacity(state: SchedulerState, max_requests: int, flight: Mapping[int, int],
                        now_s: float) -> list[Request]:
    """Steps 1-3 of the module doc (GUARANTEED_NO_EVICT on a generation server): the running
    generation requests, each keeping back its blocks to completion, then the waiting
    DISAGG_GENERATION_INIT requests in order while theirs fit and ``max_requests`` allows: their
    prompt's blocks are allocated and their transfer starts. Returns the running requests the
    micro batch scheduler reads (the admitted ones run only once their KV is in)."""
    kv = state.kv
    available = kv.num_free_blocks
    fitting: list[Request] = []
    get = flight.get
    new_blocks = 0
    for r in state.running:
        if len(fitting) >= max_requests:
            break
        if tokens_left(r, get(r.req_id, 0)) != 1:
            raise RuntimeError(f"request {r.req_id}: a generation server ran a context chunk")
        fitting.append(r)
        available -= blocks_to_completion(kv, r)
        ahead = get(r.req_id, 0)
        if ahead and r.num_output_tokens + 1 >= r.max_output_tokens:
            continue                             # GENERATION_TO_COMPLETE: not in the next step
        if r.num_computed_tokens + ahead >= len(r.block_ids) * kv.block_size:
            new_blocks += 1
    if new_blocks > kv.num_free_blocks:
        raise PolicyError(f"tensorrt_llm: a generation server's decodes need {new_blocks} new KV blocks and "
                          f"{kv.num_free_blocks} are free: its capacity scheduler does not keep back the blocks "
                          f"of requests whose KV is still on its way (rule 3 of policies.tensorrt_llm_disagg), "
                          f"and TensorRT-LLM's KV manager fails there too; give the generation pool more KV "
                          f"memory")
    remote = state.remote
    waiting = state.waiting
    count = len(fitting)
    while waiting:
        r = waiting[0]
        if not r.remote_kv:
            raise RuntimeError(f"request {r.req_id}: a generation server got a request without its "
                               f"context's KV")
        if count >= max_requests:
            break
        need = blocks_to_completion(kv, r)
        if need > available:
            break
        available -= need
        count += 1
        grow(kv, r, r.num_prompt_tokens)         # _prepare_disagg_gen_init: the prompt's blocks
        state.park_remote(r)                     # DISAGG_GENERATION_TRANS_IN_PROGRESS
        remote.holding.append(r)
        remote.on_alloc(r, r.num_prompt_tokens, now_s)
    return fitting


def blocked(state: SchedulerState) -> bool:
    """True when every active request of a generation server waits for its KV (step 4 of the
    module doc): nothing runs, nothing waits to be admitted, some transfer is in flight and none has
    ended. The executor loop then waits for a transfer to end before it takes in anything new."""
    remote = state.remote
    return (not state.running and not state.waiting and bool(remote.holding) and not remote.received)

"""TensorRT-LLM (PyTorch backend, the LLM API's default): its batch manager's
capacity scheduler, then its micro batch scheduler, over a KV pool that
reuses blocks by content.

The rules of tensorrt-llm 1.2.1 as read in NVIDIA/TensorRT-LLM's sources:
``cpp/tensorrt_llm/batch_manager/capacityScheduler.cpp``,
``microBatchScheduler.cpp``, ``kvCacheManager.cpp`` (``getRemainingBlocksToCompletion``,
``getNeededBlocksOneStep``, ``findNewContextBlock``, ``loadOrAllocateBlocks``),
``cpp/include/tensorrt_llm/batch_manager/scheduledBlocksManager.h``,
``llmRequest.h`` (``setPrepopulatedPromptLen``), ``tensorrt_llm/_torch/pyexecutor/
scheduler.py`` (``SimpleScheduler`` = ``BindCapacityScheduler`` then
``BindMicroBatchScheduler``, whose context-length limit is ``max_num_tokens``),
``py_executor.py`` (``_pause_requests``), ``_util.py`` (chunk unit =
``tokens_per_block``) and ``tensorrt_llm/llmapi/llm_args.py`` (the defaults).
The index of the repository holds no tagged copy, so the files read are
versions of its history around the 1.2 releases (capacityScheduler.cpp at
02a10fed, microBatchScheduler.cpp at 0a949d31, scheduler.py at 034fffb0,
capacitySchedulerTest.cpp at 08c2acfa), not the v1.2.1 tag itself: that
capacity scheduler already has a PREFILL_FIRST policy, which the LLM API's
enum read (three policies) does not offer, and reuse-aware token budgets
(PR #11637, 2026-03) came after and are not modelled.

1. Capacity scheduler (``capacity_scheduler_policy``; at most ``max_batch_size``
   requests). GUARANTEED_NO_EVICT (default): every decoding request runs and
   keeps back the blocks it lacks to reach prompt + max_tokens; then, in
   order, unfinished prefills and waiting requests are taken while their
   blocks to completion fit what is left of the free pool; the first misfit
   stops the scan. It never preempts. STATIC_BATCH: the same, but waiting
   requests only while nothing decodes, and no skip rule. MAX_UTILIZATION:
   in order (running, then waiting), each request takes the blocks of its
   next step only (a decode: one when its blocks are full; a waiting one:
   its whole known sequence's); on a misfit the *last* running request is
   paused (KV freed, recomputed later from its prompt + outputs, reusing its
   own cached blocks if they survive), the scan retries, and no waiting
   request is taken in that step.
2. Skip rule (block reuse on): a waiting request whose first uncached full
   block is the one an earlier request of the same scan (or an unfinished
   prefill) is about to compute is passed over this step (not a misfit: the
   scan goes on), so that it reuses that block next step.
3. Micro batch scheduler, over the capacity scheduler's list in its order
   (decodes first): a decode takes one token of ``max_num_tokens``; the
   first that does not fit ends the list. Without ``enable_chunked_prefill``
   a prefill takes its whole prompt (prompt + outputs after a pause) or
   ends the list; prompts over ``max_num_tokens`` are refused at arrival, and a
   paused request whose prompt + outputs outgrew it is cut short. With it,
   prefills are sized together after the decodes: whole if all fit, else by
   ``context_chunking_policy`` (``tensorrt_llm_rules.chunk_sizes``) in units
   of ``tokens_per_block``, each at most ``max_num_tokens``; a 0-token chunk waits.
4. KV: a request's prompt blocks are all taken with its first chunk, then
   one block per ``tokens_per_block`` decoded. With ``enable_block_reuse``
   the pool is ``sim.core.prefix.PrefixCachePool``: a new prefill reuses the
   cached full blocks of its longest prefix, at most prompt - 1 tokens
   (TensorRT-LLM ignores the last token), looked up when it is allocated, in
   order. The budget was charged before the lookup (``setPrepopulatedPromptLen``
   moves the chunk past the reused tokens): a whole prompt then computes only
   its uncached tokens, a chunk that stops short keeps its size. Prompt blocks become reusable once the
   prefill's last chunk is scheduled (TensorRT-LLM stores context blocks
   after the context phase), decoded blocks as they fill, a paused
   prefill's computed blocks when it is paused.
5. Memory: ``free_gpu_memory_fraction`` of the memory left after weights and
   activations (``KvMemory(fraction, "free")``), pages of ``tokens_per_block``.
6. The overlap scheduler (``disable_overlap_scheduler`` false, the LLM API's
   default in ``llmapi/llm_args.py``): ``PyExecutor._executor_loop_overlap``
   instead of the synchronous ``_executor_loop``. Read in ``py_executor.py``
   (a version of the 1.2 era, with the hang detector and the control
   requests; the index names no commit for it), ``scheduler.py``
   (``BindCapacityScheduler``, ``BindMicroBatchScheduler``), ``sampler.py``
   (``TorchSampler.update_requests``), ``llmRequest.h`` and the C++
   schedulers named above. Each iteration schedules step N+1 while step N is
   on the device, prepares its KV (``prepare_resources``) and launches it,
   feeding it N's sampled tokens on the device; only then does it take in
   N's tokens (``_update_requests``: stop checks, finishes), launch N+1's
   sampling, move N+1's context requests on (``_update_request_states``),
   and process N's responses (``_process_previous_batch``: ``_handle_responses``
   terminates the finished requests, which frees their KV). So the pass that
   chooses N+1 sees step N's tokens as computed, but not the tokens N
   samples, nor N's finishes and frees (those of step N-1 are in: here
   ``SchedulerState.commit_pipelined`` runs at N's end, after N+1 was
   chosen; ``pipelined``: sim.loop.server). In that pass:
   a) a context request whose chunk in N is not its last schedules its next
      chunk from where N's ends (its position moved when N was launched);
   b) one whose last chunk is in N is already a generation request (its
      state moved to GENERATION_IN_PROGRESS when N was launched): it decodes
      in N+1, fed the token N samples, with no step between its prompt and
      its first decode;
   c) a request whose token in N is its last by max_tokens is marked
      GENERATION_TO_COMPLETE when N is launched (``_update_request_states``,
      ``will_complete_next_iteration``: the tokens taken in plus one reach
      max_tokens). The capacity scheduler still takes it (it runs with
      no_schedule_after GENERATION_COMPLETE, and ``isGenerationInProgressState``
      counts GENERATION_TO_COMPLETE in): it keeps its place among the
      ``max_batch_size`` and, under GUARANTEED_NO_EVICT, its blocks to
      completion; the micro batch scheduler, whose no_schedule_after state
      is GENERATION_TO_COMPLETE since TensorRT-LLM PR #8587 (2025-10, the
      early exit: the PR's description and the C++ header's default;
      the bindings of the versions the index holds still default to
      GENERATION_COMPLETE, so which 1.2 build first skips it is not pinned
      here), leaves it out of N+1. A request that stops on EOS in N
      is not known to: it decodes in N+1, its token thrown away
      (``TorchSampler.update_requests`` skips a finished request). Either
      keeps its KV blocks, an N+1 block included, until N's results are
      processed after N+1 is launched: the pass that chooses N+2 sees them
      free;
   d) the KV manager holds the slots of N's tokens (``getNeededBlocksOneStep``
      and ``getRemainingBlocksToCompletion`` count its allocated blocks and
      tokens), so GUARANTEED_NO_EVICT reserves and MAX_UTILIZATION counts
      one step on from there; decoded blocks are registered for reuse over
      the tokens whose ids the host knows, a token in flight completing its
      block a step later (our reading: TensorRT-LLM's KV manager stores a
      block from the request's tokens, which lack the one in flight);
   e) a request that MAX_UTILIZATION pauses while it has a token in N keeps
      that token (``_update_requests`` takes N's tokens in before
      ``_pause_requests``), which its recompute then includes.
   The timing is the pipelined loop's (sim.loop.server.pipelined_start_s): a
   step's host work (``Profile.host_s``) runs beside the device's step
   before it, so a steady stream of steps runs at max(host, device) a step.
7. ``speculative`` (``sim.core.speculative``'s acceptance model, draft counters and proposer
   pricing), as read in ``py_executor.py`` (``_prepare_draft_requests``), ``resource_manager.py``
   (``KVCacheManager.prepare_resources``, ``update_resources``, ``rewind_kv_cache``),
   ``kvCacheManager.cpp`` (``getNeededBlocksOneStep``, ``getRemainingBlocksToCompletion``,
   ``updateToken``), ``microBatchScheduler.cpp``, ``speculative/utils.py``
   (``get_num_extra_kv_tokens``), ``speculative/interface.py`` (``support_overlap_scheduler``,
   ``needs_kv_cache_rewind``) and ``py_executor_creator.py`` (versions of the 1.2 era; no
   tagged copy). ``method`` mtp is MTP (``MTPDecodingConfig``: ``num_speculative_tokens`` k is
   its ``num_nextn_predict_layers``, the max_draft_len; the draft layers priced are the
   checkpoint's MTP layers, as for vllm_v1; ``llm_args.py``'s ``MTPDecodingConfig.spec_dec_mode``
   runs a checkpoint of one MTP layer, DeepSeek-V3's, as MTP-Eagle one-model, that layer k
   times; with more layers, or ``use_mtp_vanilla``, TensorRT-LLM's vanilla MTP, whose extra KV
   slots the versions read disagree on: k - 1 taken here), eagle3 and eagle are EAGLE3 one-model (the draft
   layers inside the target's engine); all three draft on the device, their KV in the target's
   pool. Refused: ngram (TensorRT-LLM's NGram drafter proposes from its own pool of matches, as
   many drafts as it finds), a separate draft model (two-model EAGLE3, draft/target), and
   speculation with the overlap scheduler on: TensorRT-LLM 1.2 keeps it on for MTP and EAGLE3
   one-model (``support_overlap_scheduler``), which batchsim does not model with drafts, so
   ``policy.disable_overlap_scheduler: true`` is required (the synchronous loop).
   a) Before each scheduling pass every generation request gets k placeholder drafts
      (``_prepare_draft_requests``: GENERATION_IN_PROGRESS only; a context request has none).
      The micro batch scheduler charges a generation request 1 + k tokens of ``max_num_tokens``
      (the first that does not fit ends the list, as in rule 3) and a context request its
      tokens only; each generation step is a verify item of 1 + k query tokens (``batch.drafts``),
      from its first one after the prompt (the one-model drafter drafts in the context step).
   b) KV: a context's first chunk allocates its prompt plus ``get_num_extra_kv_tokens`` =
      k - 1 extra slots (``add_sequence`` then ``add_token`` for each); each generation step
      adds 1 + k slots (``add_token`` for its token and each draft) to the KV sequence; after
      the step ``update_resources`` rewinds the rejected drafts (``py_rewind_len`` = k -
      accepted, ``rewind_kv_cache``: ``updateToken`` releases a block the sequence no longer
      reaches), so between steps a generation request holds the blocks of computed + k - 1
      tokens. (vLLM keeps the rejected drafts' slots and SGLang reuses them; here they go back.)
   c) Capacity: GUARANTEED_NO_EVICT reserves prompt + max_tokens as in rule 1
      (``getRemainingBlocksToCompletion`` counts no drafts or extra slots); MAX_UTILIZATION
      counts a generation request's next step as min(1 + k, max_tokens - its generated slots)
      slots past its KV sequence (``getNeededBlocksOneStep``, one step: the two-step lookahead
      of pipeline parallelism is not modelled), a waiting request its known tokens' blocks (no
      extra slots). Neither counts every slot a step then allocates (the extra slots, drafts
      past the reservation near a request's end), so a pool with nothing to spare can run dry:
      a PolicyError here (a one-line error), where TensorRT-LLM's KV manager fails to allocate.
   d) A verify step accepting a drafts gives a + 1 tokens (fewer where the output ends); the
      counters are ``sim.core.speculative``'s (the summary's ``spec_decode_*``).

Not modelled: partial block reuse (``enable_partial_reuse``, on by default:
a cached block matching only a prefix of a new block's tokens is reused or
copied, so a hit may end inside a block), KV offloading to host, of the
overlap scheduler what its loop does beyond rules 6 a-e: a step that
``_can_queue`` holds back on some rank (attention DP), the drafter and
guided decoding under overlap, and the KV cache manager v2's scheduler
(a prototype, off by default, whose capacity scheduler leaves
GENERATION_TO_COMPLETE requests out too),
pipeline parallel's two-step lookahead,
the active list's arrival order where it differs from running-then-waiting
(a request the skip rule passed over keeps its place ahead of those admitted
past it: under MAX_UTILIZATION it may then pause them; a paused request is
the newest started one, so it queues as here), a pause's
cut of prompt + outputs to ``max_input_len``, a running request with one
prompt token left counted as a decode,
of speculative decoding: the overlap scheduler with drafts, NGram and two-model drafters,
dynamic draft lengths, tree drafts, disabling speculation by batch size; beams, LoRA pages,
of disaggregated serving what ``policies.tensorrt_llm_disagg`` (the generation server),
``sim.loop.handoff_trtllm`` (a context server: a request leaves its scheduler once its context
phase is launched, ``context_server``) and ``sim.run.pd_trtllm`` (the handoff) leave out.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from policies.base import PolicyBase, batch_or_idle, config_knobs, knob, plain_stretch_shape
from policies.tensorrt_llm_capacity import max_utilization, no_evict
from policies.tensorrt_llm_disagg import blocked, generation_capacity, promote_received
from policies.tensorrt_llm_rules import (
    CAPACITY_POLICIES,
    CHUNKING_POLICIES,
    chunk_sizes,
    grow,
    reused_chunk,
)
from sim.core.batch import Batch, BatchItem, Idle
from sim.core.policy import EngineKnob, KvMemory, PolicyContext, PolicyError, PrefixSwitch
from sim.core.prefix import PrefixCachePool
from sim.core.speculative import SpeculativeSpec, parse_speculative, refuse_method

if TYPE_CHECKING:
    from sim.core.request import Request
    from sim.core.state import SchedulerState


# Rule 7: batchsim's methods as TensorRT-LLM's PyTorch backend runs them (one-model drafting, the
# draft layers in the target's engine): MTP (MTPDecodingConfig, num_nextn_predict_layers = k) and
# EAGLE3 one-model (EagleDecodingConfig / Eagle3DecodingConfig with eagle3_one_model, its default).
SPEC_MODES = {"mtp": "MTP", "eagle3": "EAGLE3_ONE_MODEL", "eagle": "EAGLE3_ONE_MODEL"}


def parse_tensorrt_llm_speculative(data: Any, src: str = "the workload",
                                   where: str = "policy.speculative") -> SpeculativeSpec | None:
    """``policy.speculative`` for TensorRT-LLM (rule 7 of the module doc): vLLM's spelling
    (``sim.core.speculative``), methods mtp, eagle3 and eagle (EAGLE3 one-model); n-gram refused.
    None for k = 0 (no speculation)."""
    refuse_method(data, "ngram", "tensorrt_llm: TensorRT-LLM's NGram drafter (NGramDecodingConfig) proposes "
                  "from its own pool of matches, as many drafts as it finds, and runs without the overlap "
                  "scheduler; batchsim models its one-model drafters only: use mtp, eagle3 or eagle", src, where)
    spec = parse_speculative(data, src, where)
    return spec if spec.num_speculative_tokens else None


@dataclass(frozen=True, slots=True)
class TensorRtLlmConfig:
    kind: Literal["tensorrt_llm"] = "tensorrt_llm"
    max_num_tokens: int = knob(8192, "most tokens per step, and per prefill chunk (TensorRT-LLM 1.2.1's LLM API "
                                     "default 8192, any device)")
    max_batch_size: int = knob(2048, "most requests scheduled per step (TensorRT-LLM 1.2.1's default 2048)")
    capacity_scheduler_policy: str = knob("GUARANTEED_NO_EVICT", "GUARANTEED_NO_EVICT (reserve to prompt + "
                                          "max_tokens, never evict; the default), MAX_UTILIZATION (next step "
                                          "only, pause the newest) or STATIC_BATCH")
    enable_chunked_prefill: bool = knob(False, "split prefills into chunks under max_num_tokens (TensorRT-LLM's "
                                               "default: off)")
    context_chunking_policy: str = knob("FIRST_COME_FIRST_SERVED", "how chunks share the budget: "
                                        "FIRST_COME_FIRST_SERVED (default) or EQUAL_PROGRESS")
    enable_block_reuse: bool = knob(True, "reuse cached KV blocks of earlier requests' prefixes (KvCacheConfig "
                                          "default: on; sim.core.prefix)")
    tokens_per_block: int = knob(32, "KV page size in tokens, also the chunk unit (KvCacheConfig default 32)")
    free_gpu_memory_fraction: float = knob(0.9, "share of the memory left after weights and activations given "
                                                "to the KV cache (KvCacheConfig default 0.9)")
    disable_overlap_scheduler: bool = knob(False, "run the synchronous executor loop; false (the LLM API's "
                                                  "default): the overlap scheduler chooses each step while the "
                                                  "one before it runs, its outputs seen a step later (rule 6 of "
                                                  "the module doc)")
    speculative: dict[str, Any] | None = knob(None, "speculative decoding (rule 7 of the module doc): {method: "
                                                    "mtp | eagle3 | eagle (one-model), num_speculative_tokens "
                                                    "(max_draft_len), acceptance_length or acceptance_rates}; "
                                                    "needs disable_overlap_scheduler: true; unset: none")


class TensorRtLlmPolicy(PolicyBase):
    # Fast path (sim.loop.stretch): a decode-only step leaves GUARANTEED_NO_EVICT's free pool less
    # the running requests' blocks to completion unchanged (a decode's new block is one fewer to
    # come) and MAX_UTILIZATION's head of the queue needing more than the free pool less the
    # step's new blocks, which only falls; so the admission that failed fails again (a budget or
    # batch-size misfit stays one). A decode-only step decodes every running request while
    # max_num_tokens >= max_batch_size (else the budget may cut decodes: steps every iteration).
    # Kernel profiles (profile.kernels) price this engine on TensorRT-LLM's own kernels (its FMHA and XQA attention, its MoE), measured per version.
    kernel_tables = "trtllm"
    decode_stretch = True
    # (refuses_by_prompt False: reserved to completion, refused if prompt + max_tokens exceed the pool)
    prefix_switch = PrefixSwitch("enable_block_reuse")
    # A context server of disaggregated serving (sim.loop.handoff_trtllm): a request whose context
    # phase is launched leaves the scheduler then (DISAGG_CONTEXT_TRANS_IN_PROGRESS).
    context_server = False
    pipelined_knob = "disable_overlap_scheduler"
    pipelined_off = True
    parse_speculative = staticmethod(parse_tensorrt_llm_speculative)   # policy_config's check of rule 7
    server_knobs = {
        "block_size": EngineKnob("tokens_per_block", "KvCacheConfig's tokens_per_block, its KV page"),
        "gpu_memory_utilization": EngineKnob("free_gpu_memory_fraction", "KvCacheConfig's free_gpu_memory_fraction, "
                                                                         "a share of the memory left after weights "
                                                                         "and activations"),
        "watermark": EngineKnob(None, "its capacity scheduler reserves to completion (GUARANTEED_NO_EVICT) or "
                                      "pauses requests (MAX_UTILIZATION)"),
    }

    def __init__(self, config: TensorRtLlmConfig, context: PolicyContext) -> None:
        for name, allowed in (("capacity_scheduler_policy", CAPACITY_POLICIES),
                              ("context_chunking_policy", CHUNKING_POLICIES)):
            if getattr(config, name) not in allowed:
                raise ValueError(f"{name} must be one of {', '.join(allowed)}, got {getattr(config, name)!r}")
        if not 0 < config.free_gpu_memory_fraction <= 1:
            raise ValueError(f"free_gpu_memory_fraction must be in (0, 1], got {config.free_gpu_memory_fraction}")
        for name in ("max_num_tokens", "max_batch_size", "tokens_per_block"):
            if getattr(config, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(config, name)}")
        if config.enable_chunked_prefill and config.max_num_tokens < config.tokens_per_block:
            raise ValueError(f"max_num_tokens ({config.max_num_tokens}) must be at least tokens_per_block "
                             f"({config.tokens_per_block}) with enable_chunked_prefill: chunks are whole blocks")
        self.config = config
        self.speculative = (parse_tensorrt_llm_speculative(config.speculative)
                            if config.speculative is not None else None)
        # Rule 7: each generation request's drafts (max_draft_len) and the one-model drafter's extra
        # KV slots (get_num_extra_kv_tokens: max_draft_len - 1); the verify items of the last step.
        self.num_drafts = self.extra_kv = 0
        self._verified: frozenset[int] = frozenset()
        if self.speculative is not None:
            if not config.disable_overlap_scheduler:
                raise ValueError("policy.speculative with the overlap scheduler on: TensorRT-LLM 1.2 keeps it on "
                                 "for MTP and EAGLE3 one-model, which batchsim does not model with drafts; set "
                                 "policy.disable_overlap_scheduler: true to run it (rule 7 of the module doc)")
            self.num_drafts = self.speculative.num_speculative_tokens
            self.extra_kv = self.num_drafts - 1
            self.decode_stretch = False              # acceptance draws: every step is its own
        self.token_budget = config.max_num_tokens
        self.max_num_seqs = config.max_batch_size
        self.block_size = config.tokens_per_block
        self.kv_memory = KvMemory(config.free_gpu_memory_fraction, "free")
        if config.enable_block_reuse:
            self.kv_pool_class = PrefixCachePool
        self.chunking = config.enable_chunked_prefill
        # Without chunking a prefill must fit one step (the micro batch scheduler's context-length check).
        self.max_prompt_tokens = None if self.chunking else config.max_num_tokens
        self.capacity = config.capacity_scheduler_policy
        self._waiting_for_kv = False         # a generation server waiting for a transfer to end
        if config.max_num_tokens < config.max_batch_size:
            self.decode_stretch = False      # see the class's decode_stretch
        if not config.disable_overlap_scheduler:     # rule 6 of the module doc: _executor_loop_overlap
            self.pipelined = True            # SchedulerState.commit_pipelined: a paused request's token in
            self.decode_stretch = False      # flight is still delivered (_update_requests runs before the pause)

    stretch_shape = plain_stretch_shape          # its decodes attend over their own contexts; no case (c)

    @staticmethod
    def unread_knobs(config: TensorRtLlmConfig) -> dict[str, str]:
        return {} if config.enable_chunked_prefill else {
            "context_chunking_policy": "without enable_chunked_prefill: nothing is chunked"}

    def knobs(self) -> dict[str, Any]:
        return config_knobs(self.config, speculative=self.config.speculative or {"num_speculative_tokens": 0})

    def schedule(self, state: SchedulerState, now_s: float) -> Batch | Idle:
        # The overlap scheduler (rule 6): the step in flight's tokens, by request (none in the
        # synchronous loop, whose state.pending stays empty).
        flight = {it[0]: it[1] for it in state.pending[-1].items} if state.pending else {}
        if self._verified:
            self._rewind(state)
        skip = frozenset()
        if self.context_server and flight:           # sim.loop.handoff_trtllm: context phases launched
            requests = state.requests
            skip = frozenset(rid for rid, n in flight.items() if rid in requests and requests[rid].num_computed_tokens
                             + n >= requests[rid].num_prompt_tokens + requests[rid].num_output_tokens)
        if state.remote is not None:                 # a generation server (policies.tensorrt_llm_disagg)
            if self._waiting_for_kv:
                if not state.remote.received:
                    return Idle()                    # check_gen_transfer_status(1): nothing taken in
                self._waiting_for_kv = False
            promote_received(state, now_s)
            fitting = generation_capacity(state, self.max_num_seqs, flight, now_s)
            decision = self._micro_batch(state, now_s, fitting, flight)
            self._waiting_for_kv = blocked(state)
            return decision
        if self.capacity == "MAX_UTILIZATION":
            fitting = max_utilization(state, self.max_num_seqs, flight, self.num_drafts, self.extra_kv, skip)
        else:
            fitting = no_evict(state, self.max_num_seqs, self.capacity == "STATIC_BATCH", flight, skip)
        return self._micro_batch(state, now_s, fitting, flight)

    def _rewind(self, state: SchedulerState) -> None:
        """Rule 7's ``update_resources``: each request that verified drafts in the last step and
        still runs rewinds its KV sequence by its rejected drafts (``py_rewind_len``) to computed
        + ``extra_kv`` tokens, giving back the blocks past those (``rewind_kv_cache``)."""
        kv = state.kv
        verified, self._verified = self._verified, frozenset()
        for r in state.running:
            if r.req_id in verified and r.block_ids:
                kv.free_tail(r, kv.num_blocks_for(r.num_computed_tokens + self.extra_kv))

    # ---- micro batch scheduler and KV ---------------------------------------------------------------
    def _micro_batch(self, state: SchedulerState, now_s: float, fitting: list[Request],
                     flight: dict[int, int]) -> Batch | Idle:
        """Rule 3 of the module doc over the capacity scheduler's list, then rule 4's allocations;
        with a step in flight (rule 6) its tokens count as computed, and a request whose known
        tokens it completes decodes next, feeding the token it samples (a placeholder here)."""
        kv = state.kv
        bs = kv.block_size
        caching = kv.caching
        max_tokens = self.token_budget
        used = count = 0
        items: list[BatchItem] = []
        contexts: list[Request] = []
        wanted: list[int] = []               # each context's tokens still to compute (a first chunk: all)
        all_fit = True
        new_item = tuple.__new__             # BatchItem(...) without the NamedTuple call overhead
        get = flight.get
        k = self.num_drafts                  # rule 7: a generation request's drafts (0: none)
        width = 1 + k
        verify: dict[int, int] = {}
        for r in fitting:
            computed = r.num_computed_tokens
            rest = r.num_prompt_tokens + r.num_output_tokens - computed
            placeholder = 0
            if flight:
                ahead = get(r.req_id, 0)
                if ahead:
                    computed += ahead
                    rest -= ahead
                    if rest <= 0:                                # it samples in flight: that token next
                        if r.num_output_tokens + 1 >= r.max_output_tokens:
                            continue                             # GENERATION_TO_COMPLETE: not scheduled
                        rest, placeholder = 1, 1
            if rest == 1 and r.block_ids:                        # a decode
                if used + width > max_tokens:
                    break
                if k:                                            # rule 7: 1 + k slots, a verify item
                    for _ in range(kv.num_blocks_for(computed + self.extra_kv + width) - len(r.block_ids)):
                        if not kv.append_block(r):
                            raise PolicyError(f"tensorrt_llm: request {r.req_id} has no KV block for its {k} "
                                              f"draft slots (TensorRT-LLM's prepare_resources adds them past what "
                                              f"its capacity scheduler counted; its KV manager fails there too): "
                                              f"give the KV cache more memory or lower "
                                              f"policy.speculative.num_speculative_tokens")
                    verify[r.req_id] = k
                elif computed >= len(r.block_ids) * bs and not kv.append_block(r):
                    raise RuntimeError(f"request {r.req_id}: no KV block for a decode the capacity "
                                       f"scheduler let through")
                items.append(new_item(BatchItem, (r.req_id, width, computed, 0)))
                used += width
                # the token completes a block: registered over the tokens known (less a placeholder)
                if caching and (computed + 1 - placeholder) // bs > r.num_hashed_blocks:
                    kv.cache(r, computed + 1 - placeholder)
            elif not self.chunking:
                if rest > max_tokens and not r.block_ids:        # a paused request outgrew one step
                    state.cut_short(r, now_s)
                    continue
                if used + rest > max_tokens:
                    break
                contexts.append(r)
                wanted.append(rest)
                used += rest
            else:
                if rest > max_tokens:
                    all_fit = False
                contexts.append(r)
                wanted.append(rest)
            count += 1
            if count >= self.max_num_seqs:
                break
        if self.chunking and contexts and (not all_fit or sum(min(n, max_tokens) for n in wanted)
                                           > max_tokens - used):
            wanted = chunk_sizes(wanted, max_tokens - used, bs, max_tokens, self.config.context_chunking_policy)
        to_register: list[Request] = []
        for r, chunk in zip(contexts, wanted):
            if chunk <= 0:
                continue
            known = r.num_prompt_tokens + r.num_output_tokens
            if r.block_ids:                                      # a later chunk (after the one in flight)
                start = r.num_computed_tokens + get(r.req_id, 0)
            else:                                                # a first chunk: take the prompt's blocks
                hit = kv.lookup(r) if caching else []
                start = len(hit) * bs
                if hit:
                    kv.touch(r, hit)
                if k and kv.num_blocks_for(known + self.extra_kv) - len(r.block_ids) > kv.num_free_blocks:
                    raise PolicyError(f"tensorrt_llm: request {r.req_id} has no KV blocks for its context and "
                                      f"the drafter's {self.extra_kv} extra slots (rule 7: TensorRT-LLM reserves "
                                      f"neither past what its capacity scheduler counts, and its KV manager fails "
                                      f"there too): give the KV cache more memory or lower "
                                      f"policy.speculative.num_speculative_tokens")
                grow(kv, r, known + self.extra_kv)               # rule 7: the drafter's extra slots
                if caching:
                    kv.record_lookup(r, start)
                state.admit(r, now_s, start)
                chunk = reused_chunk(start, chunk, known, bs)
            items.append(BatchItem(r.req_id, chunk, start))
            if caching and start + chunk == known:
                to_register.append(r)
        for r in to_register:                                    # after every lookup of this step
            kv.cache(r, r.num_prompt_tokens + r.num_output_tokens)
        if verify:
            self._verified = frozenset(verify)
            drafts = state.speculation.drafts if state.speculation is not None else {}
            for rid in verify:
                drafts.pop(rid, None)                            # TensorRT-LLM drafts k for every one
            return Batch(tuple(items), verify)
        return batch_or_idle(items)


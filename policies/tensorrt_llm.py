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

Not modelled: partial block reuse (``enable_partial_reuse``, on by default:
a cached block matching only a prefix of a new block's tokens is reused or
copied, so a hit may end inside a block), KV offloading to host, the
overlap scheduler (on by default: ``llmapi/llm_args.py``'s
``disable_overlap_scheduler`` is false; ``py_executor.py``'s
``_executor_loop_overlap`` chooses a step while the one before it runs and
processes that one's results, finishes and frees after launching the next;
this policy is its synchronous ``_executor_loop``: see docs/policies.md),
pipeline parallel's two-step lookahead,
the active list's arrival order where it differs from running-then-waiting
(a request the skip rule passed over keeps its place ahead of those admitted
past it: under MAX_UTILIZATION it may then pause them; a paused request is
the newest started one, so it queues as here), a pause's
cut of prompt + outputs to ``max_input_len``, a running request with one
prompt token left counted as a decode,
speculative decoding, beams, LoRA pages, disaggregated serving.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from policies.base import PolicyBase, batch_or_idle, knob, plain_stretch_shape
from policies.tensorrt_llm_capacity import max_utilization, no_evict
from policies.tensorrt_llm_rules import (
    CAPACITY_POLICIES,
    CHUNKING_POLICIES,
    chunk_sizes,
    grow,
    reused_chunk,
)
from sim.core.batch import Batch, BatchItem, Idle
from sim.core.policy import EngineKnob, KvMemory, PolicyContext, PrefixSwitch
from sim.core.prefix import PrefixCachePool

if TYPE_CHECKING:
    from sim.core.request import Request
    from sim.core.state import SchedulerState


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
        if config.max_num_tokens < config.max_batch_size:
            self.decode_stretch = False      # see the class's decode_stretch

    stretch_shape = plain_stretch_shape          # its decodes attend over their own contexts; no case (c)

    @staticmethod
    def unread_knobs(config: TensorRtLlmConfig) -> dict[str, str]:
        return {} if config.enable_chunked_prefill else {
            "context_chunking_policy": "without enable_chunked_prefill: nothing is chunked"}

    def schedule(self, state: SchedulerState, now_s: float) -> Batch | Idle:
        if self.capacity == "MAX_UTILIZATION":
            fitting = max_utilization(state, self.max_num_seqs)
        else:
            fitting = no_evict(state, self.max_num_seqs, static=self.capacity == "STATIC_BATCH")
        return self._micro_batch(state, now_s, fitting)

    # ---- micro batch scheduler and KV ---------------------------------------------------------------
    def _micro_batch(self, state: SchedulerState, now_s: float, fitting: list[Request]) -> Batch | Idle:
        """Rule 3 of the module doc over the capacity scheduler's list, then rule 4's allocations."""
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
        for r in fitting:
            computed = r.num_computed_tokens
            rest = r.num_prompt_tokens + r.num_output_tokens - computed
            if rest == 1 and r.block_ids:                        # a decode
                if used + 1 > max_tokens:
                    break
                if computed >= len(r.block_ids) * bs and not kv.append_block(r):
                    raise RuntimeError(f"request {r.req_id}: no KV block for a decode the capacity "
                                       f"scheduler let through")
                items.append(new_item(BatchItem, (r.req_id, 1, computed, 0)))
                used += 1
                if caching and (computed + 1) // bs > r.num_hashed_blocks:
                    kv.cache(r, computed + 1)                    # the token completes a block
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
            if r.block_ids:                                      # a later chunk
                start = r.num_computed_tokens
            else:                                                # a first chunk: take the prompt's blocks
                hit = kv.lookup(r) if caching else []
                start = len(hit) * bs
                if hit:
                    kv.touch(r, hit)
                grow(kv, r, known)
                if caching:
                    kv.record_lookup(r, start)
                state.admit(r, now_s, start)
                chunk = reused_chunk(start, chunk, known, bs)
            items.append(BatchItem(r.req_id, chunk, start))
            if caching and start + chunk == known:
                to_register.append(r)
        for r in to_register:                                    # after every lookup of this step
            kv.cache(r, r.num_prompt_tokens + r.num_output_tokens)
        return batch_or_idle(items)


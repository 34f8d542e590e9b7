"""vLLM v1 (the engine of today's vLLM): one token budget, running requests first.

The rules of ``vllm.v1.core.sched.scheduler.Scheduler.schedule`` in vLLM
0.32.0 with FCFS, prefix caching on or off, speculative decoding on or off, with or without
a P/D KV connector (rule 9) (``tests/policies/test_vllm_v1_differential.py`` checks them step by step
against that class):

1. ``long_prefill_token_threshold`` caps a request's tokens in a step, but
   only while more than one request is running or waiting.
2. Running requests, in order, each get ``num_tokens - num_computed_tokens``
   tokens (a decode: 1; an unfinished prefill or a recompute: the rest of
   it), capped by the threshold and the remaining budget. (vLLM's cap at
   the model length binds only with speculative decoding: no request
   reaches the scheduler with prompt + max_tokens above it, see 6.)
   Blocks are allocated for exactly the tokens scheduled. When the pool is
   short, the *last* running request is preempted (recompute: blocks freed,
   back to the front of the waiting queue) until the allocation fits; if the
   victim is the request itself, no further running request is scheduled.
3. Only in a step that preempted nothing, waiting requests are admitted FCFS
   while fewer than ``max_num_seqs`` run and budget is left. The first one
   that does not fit stops the scan. A request fits when the blocks of its
   *whole* known sequence fit in the free pool (``scheduler_reserve_full_isl``),
   plus the watermark if anything is running; only the first chunk's blocks
   are then allocated.
4. One block of the pool is vLLM's null block and never holds KV:
   ``server.num_blocks`` is vLLM's ``num_gpu_blocks`` and one fewer is usable.

5. Prefix caching (``enable_prefix_caching``, vLLM 0.32's default: on),
   in the KV pool of ``sim.core.prefix`` (its doc gives the block rules). A
   waiting request (new or preempted: none has computed tokens) first looks
   up its longest cached prefix, at most ``num_tokens - 1`` tokens in whole
   blocks; it then schedules ``num_tokens - hit`` tokens (threshold and
   budget as above: hit tokens take no budget), and both admission checks
   count the blocks it still needs plus the hit blocks no other request
   holds (they leave the free queue when taken). Every allocation registers
   the full blocks among the tokens scheduled, a decode's included, so a
   later request of the same step can hit them. The lookup is counted
   (vLLM's ``prefix_cache_queries`` / ``hits``) only when the request is
   admitted.

6. Arrivals as vLLM 0.32's OpenAI server takes them (``clamps_max_tokens``):
   a prompt of max_model_len tokens or more, or a max_tokens above
   max_model_len, is refused (HTTP 400: ``TokenizeParams``, the input
   processor's prompt-length check); a max_tokens that prompt + max_tokens
   would take past max_model_len is cut to max_model_len - prompt
   (``get_max_tokens``), and the reply ends there (finish_reason "length").

7. ``async_scheduling`` (vLLM's ``AsyncScheduler`` under ``EngineCore.
   step_with_batch_queue``, a queue of two; ``tests/policies/
   test_vllm_v1_differential.py`` checks it step by step too): a step is
   chosen while the one before it runs (``pipelined``: sim.loop.server). That
   step's tokens count as computed, and each token it samples as a
   placeholder: a decode schedules one more token beside it; a request whose
   token in flight is its last by ``max_tokens`` is passed over (it holds its
   slot and blocks until that output is in); one that stops on EOS is not
   known to and runs one more token, thrown away; finishes and frees are seen
   one step late; a preempted request's in-flight token is still delivered;
   blocks are registered in the prefix cache only over tokens whose ids are
   known (``SchedulerState.commit_pipelined``). Unset, it is on as in vLLM
   0.32 (``VllmConfig``), except on a CPU (``CpuPlatform`` turns it off) or
   where ``profile.engine`` names the synchronous loop (sim.run.runner.
   async_scheduling_of). The timing overlaps as vLLM's batch queue does
   (sim.loop.server.pipelined_start_s): a step's host work (the update of the
   output two steps back, scheduling, input preparation: ``Profile.host_s``)
   runs while the step before it is on the device, so a step starts at
   max(end of the one before, its choice + its host work) and a steady stream
   runs at max(host, device) a step. Which of a profile's terms are host work:
   a synchronous engine's (the analytic presets' vllm-v0 and vllm-v1); terms
   measured or fitted on async runs (the presets' vllm-v1-async, the kernel
   profiles' async host terms) are what vLLM's overlap left unhidden and stay
   on the device's path; measured profiles separate none.

8. ``speculative`` (``sim.core.speculative``: vLLM's ``SpeculativeConfig`` with the
   methods eagle, eagle3, mtp, ngram;
   ``tests/policies/test_vllm_v1_differential.py`` drives vLLM's ``Scheduler`` with drafts
   through ``update_draft_token_ids`` and checks it step by step). Every request that
   sampled gets k drafts (``Speculation.drafts``, vLLM's ``spec_token_ids``); a running
   request then schedules ``num_tokens + drafts - num_computed_tokens`` (1 + k for a
   decode), capped by the threshold, the budget and ``max_model_len - computed - 1``, and a
   request that gets no token this step keeps its drafts; a scheduled one's are cleared.
   Every allocation reserves ``num_lookahead_tokens`` more slots (EAGLE/MTP: k; n-gram: 0)
   within max_model_len, while blocks are registered in the prefix cache over known tokens
   only. With EAGLE/MTP a prefix hit drops its last block (their drafter needs its hidden
   states). A waiting request with one token to compute (a prompt found cached but its
   last token), in a step whose running requests hold no prefill and where a running
   request was scheduled or it has a hit, is padded to 1 + k tokens with placeholder drafts
   (never accepted; vLLM's uniform decode batch), and if 1 + k exceeds the budget left,
   admission stops. A verify step accepts a of its d drafts (the acceptance model); the
   request gets a + 1 tokens (fewer where its output ends) and its computed tokens roll
   back by d - a; the rejected slots stay allocated. Under async scheduling (vLLM's default
   with EAGLE/MTP on a GPU; n-gram turns it off, as vLLM does, and refuses it when asked)
   the drafts are ``AsyncScheduler``'s placeholders: a scheduled request that will sample
   holds k of them for its next step, its step in flight 1 + d output placeholders, so the
   next step schedules ``num_tokens + drafts + placeholders - computed`` (1 + k) as if the
   step in flight accepted everything, and its output then rolls the rejected ones back
   (``SchedulerState._commit_pipelined_speculative``; checked against ``AsyncScheduler``
   in the same differential test).

9. A decode instance of disaggregated serving (``state.remote``: ``sim.loop.handoff``), as
   vLLM 0.32's ``Scheduler`` runs a KV connector that loads asynchronously (NixlConnector's
   scheduler side: ``get_num_new_matched_tokens``, ``update_state_after_alloc``). Admission
   first drains ``kv_holding_waiting`` (``remote.holding``), then the waiting queue. A held
   request whose KV is still on its way is passed over (it keeps its place); one whose
   transfer ended (``finished_recving``) is promoted: its blocks are registered in the prefix
   cache, its last prompt token is set back to be computed again, and it is scheduled as a
   request with computed tokens (its missing blocks and the watermark checked, no lookup). A
   waiting request whose prompt another instance computed (``remote_kv``) looks up its local
   prefix, and the rest of its prompt is to come over the link: if its whole sequence fits
   the free pool less the watermark (``scheduler_reserve_full_isl``) and less the blocks the
   running prefills still need (``_inflight_prefill_reserved_blocks``), its blocks are
   allocated (registered only once loaded), it takes no budget, moves to the held queue as
   WAITING_FOR_REMOTE_KVS and its transfer may start (``remote.on_alloc``); else admission
   stops. The held requests passed over go back in front, in order. A request preempted
   after its KV came recomputes locally (the connector asks for a load only once).

10. A hybrid model (attention beside Gated DeltaNet layers: ``sim.cost.hybrid``) with prefix
   caching on runs vLLM 0.32's ``mamba_cache_mode`` "align" (its default then:
   ``MambaModelConfig.verify_and_update_config``), its pool ``sim.core.mamba_align``'s (the
   state blocks kept at block boundaries, the hit the least over the attention and linear
   groups, the same-step refusal). A prefill chunk is cut as
   ``Scheduler._mamba_block_aligned_split`` cuts it on vLLM's default path (no partial hash
   hits, no prefill checkpoint blocks, no EAGLE, no shared-prefix checkpoint), for running and
   waiting requests alike, after the threshold and the budget: a chunk from ``start`` that ends
   before ``max(prompt, num_tokens - 1)`` is cut down to a block boundary (unless that leaves
   nothing and a block is wider than ``min(max_num_batched_tokens, threshold)``), and it stops
   at the first of these strictly inside it: the next block boundary if ``start`` is inside a
   block, the last state boundary ``(num_tokens - 1) // block x block``, and the junction
   floored to a block from ``start`` (vLLM's ``shared_prefix_boundary``: the attention hit where
   the linear groups' was shorter). A running request left no tokens is passed over (the next
   one is tried); a waiting one stops admission. No decode stretch (every step moves state
   blocks); the hot decode path is off. Async scheduling (rule 7) works the same, with the
   committed tokens deciding which state blocks are given back (``allocate_slots``'s
   ``total_computed_tokens - num_in_flight_tokens``); checked against both schedulers by
   ``tests/policies/test_vllm_v1_differential.py``.

Not modelled: priorities, a draft model (its own
KV and forward), tree attention, dynamic
speculation length (``num_speculative_tokens_per_batch_size``), multi-module MTP's
prefill lookahead, KV connectors other than rule 9's (a connector's failed loads, offloading
connectors), multimodal inputs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from policies.base import PolicyBase, config_knobs, knob, plain_stretch_shape
from policies.vllm import check_budget
from sim.core.batch import Batch, BatchItem, Idle
from sim.core.policy import EngineKnob, PolicyContext, PrefixSwitch
from sim.core.prefix import PrefixCachePool
from sim.core.speculative import parse_speculative

if TYPE_CHECKING:
    from sim.core.request import Request
    from sim.core.state import SchedulerState

GIB = 1024**3


@dataclass(frozen=True, slots=True)
class VllmV1Config:
    kind: Literal["vllm_v1"] = "vllm_v1"
    max_num_seqs: int | None = knob(None, "most requests running at once; unset: the knob a server-calibrated "
                                          "profile recorded, else vLLM 0.32's OpenAI-server default for the "
                                          "profile's device (engine_defaults)")
    max_num_batched_tokens: int | None = knob(None, "most tokens per step; unset: as max_num_seqs")
    long_prefill_token_threshold: int = knob(0, "most tokens of one request per step while more than one request "
                                                "runs or waits (0: off, vLLM's default)")
    reserve_full_prompt: bool = knob(True, "admit only if the whole prompt's blocks fit the free pool (vLLM's "
                                           "scheduler_reserve_full_isl, default true)")
    watermark: float = knob(0.0, "share of the pool kept free when admitting while requests run (vLLM v1's "
                                 "default 0)", below=1)
    enable_prefix_caching: bool = knob(True, "reuse the KV of cached full blocks of earlier requests' tokens "
                                             "(vLLM 0.32's default: on; sim.core.prefix)")
    async_scheduling: bool | None = knob(None, "choose each step while the one before it runs, as vLLM's "
                                                "AsyncScheduler does (rule 7 of the module doc); unset: as vLLM "
                                                "0.32 decides it, on except on a CPU, whose platform turns it off")
    speculative: dict[str, Any] | None = knob(None, "speculative decoding (rule 8 of the module doc): {method: "
                                                    "eagle | eagle3 | mtp | ngram, num_speculative_tokens, "
                                                    "acceptance_length or acceptance_rates}; unset: none "
                                                    "(num_speculative_tokens 0)")


def engine_defaults(context: PolicyContext) -> tuple[int, int]:
    """(max_num_batched_tokens, max_num_seqs) that vLLM 0.32.0's OpenAI API
    server picks when neither is given (``EngineArgs.get_batch_defaults``):
    CPU 2048 x world / 128 x world; GPUs with >= 160 GiB 16384 / 1024; with
    >= 70 GiB and not an A100, 8192 / 1024; others (and an unknown device)
    2048 / 256. The token budget is then capped at max_num_seqs x
    max_model_len and max_num_seqs at the token budget."""
    device, memory_bytes = context.device.lower(), context.memory_bytes_per_gpu
    if device.startswith("cpu"):
        tokens, seqs = 2048 * context.world_size, 128 * context.world_size
    elif memory_bytes >= 160 * GIB:
        tokens, seqs = 16384, 1024
    elif memory_bytes >= 70 * GIB and "a100" not in device:
        tokens, seqs = 8192, 1024
    else:
        tokens, seqs = 2048, 256
    tokens = min(tokens, seqs * context.max_model_len)
    return tokens, min(seqs, tokens)


class VllmV1Policy(PolicyBase):
    # Fast path (sim.loop.stretch): a decode-only step that preempted nobody means admission failed
    # for want of slots, budget or free blocks; slots and budget stay, free blocks only shrink.
    # With prefix caching the whole-prompt check's need (its blocks less the hit blocks others
    # hold) only grows: a stretch registers no block a waiting prompt holds (prompts never hold a
    # running request's outputs) and its evictions only cut hits short. Without that check
    # (reserve_full_prompt false) the first chunk's need can shrink when an eviction cuts a hit
    # (blocks_for(hit + chunk) falls with the hit while the chunk stays capped by the budget); the
    # LRU evicts a hit's deepest block first, which keeps the fall within the freed block, but
    # duplicate blocks of one hash break that argument, so that case steps every iteration.
    decode_stretch = True
    # vLLM v1's block pool keeps no v0 block-manager watermark; its admission watermark is a knob here
    server_knobs = {"watermark": EngineKnob("watermark", "a share of the pool kept free when admitting while "
                                                         "requests run")}
    num_reserved_blocks = 1                  # vLLM's null block
    clamps_max_tokens = True                 # rule 6 of the module doc
    prefix_switch = PrefixSwitch("enable_prefix_caching")
    always_chunks = True                     # chunked prefill: any prompt that fits the context
    pipelined_knob = "async_scheduling"
    dp_router = "vllm_dp"                   # --data-parallel-size: DPLBAsyncMPClient (sim.loop.feed.vllm_dp_pick)

    def __init__(self, config: VllmV1Config, context: PolicyContext) -> None:
        """Knobs left unset come from the server a profile was measured on
        (``context.engine``), else from vLLM's defaults for the device."""
        self.config = config
        if config.enable_prefix_caching:
            self.kv_pool_class = PrefixCachePool
        if config.enable_prefix_caching and not config.reserve_full_prompt:
            self.decode_stretch = False      # see the class's decode_stretch
        # vLLM 0.32: VllmConfig turns async scheduling on unless something incompatible is asked
        # (nothing batchsim models is), and the CPU platform turns it off (CpuPlatform).
        self.async_scheduling = (config.async_scheduling if config.async_scheduling is not None
                                 else not (context.cpu or context.device.lower().startswith("cpu")))
        self.speculative = (parse_speculative(config.speculative, "the workload")
                            if config.speculative is not None else None)
        if self.speculative is not None and not self.speculative.num_speculative_tokens:
            self.speculative = None          # k = 0: no speculation (a sweep's baseline)
        if self.speculative is not None:
            self.decode_stretch = False      # drafts and acceptance draws: every step is its own
            method = self.speculative.method
            if config.async_scheduling is None and method == "ngram":
                self.async_scheduling = False    # vLLM: "Async scheduling not supported with ngram-based"
            elif config.async_scheduling and method == "ngram":
                raise ValueError("async_scheduling true with speculative.method ngram: vLLM 0.32 refuses it "
                                 "(its async scheduling takes EAGLE/MTP/draft-model speculation only)")
        if self.async_scheduling:
            self.pipelined = True            # rule 7 of the module doc
            self.decode_stretch = False
        self.max_model_len = max_model_len = context.max_model_len
        tokens, seqs = engine_defaults(context)
        tokens = context.engine.get("max_num_batched_tokens") or tokens
        seqs = context.engine.get("max_num_seqs") or seqs
        self.token_budget = config.max_num_batched_tokens or tokens
        self.max_num_seqs = config.max_num_seqs or min(seqs, self.token_budget)
        # vLLM's start-up checks (SchedulerConfig.verify_max_model_len).
        check_budget(self.token_budget, self.max_num_seqs)
        if config.long_prefill_token_threshold > max_model_len:
            raise ValueError(f"long_prefill_token_threshold ({config.long_prefill_token_threshold}) cannot "
                             f"exceed max_model_len ({max_model_len}), as vLLM requires")

    stretch_shape = plain_stretch_shape          # its decodes attend over their own contexts; no case (c)

    def knobs(self) -> dict[str, Any]:
        return config_knobs(self.config, max_num_seqs=self.max_num_seqs, max_num_batched_tokens=self.token_budget,
                            async_scheduling=self.async_scheduling,
                            speculative=self.config.speculative or {"num_speculative_tokens": 0})

    def schedule(self, state: SchedulerState, now_s: float) -> Batch | Idle:
        if self.speculative is not None:
            return self._schedule_speculative(state, now_s)
        if self.pipelined:
            return self._schedule_async(state, now_s)
        kv = state.kv
        running = state.running
        budget = self.token_budget
        threshold = self.config.long_prefill_token_threshold
        if len(running) + state.num_waiting <= 1:
            threshold = 0
        items: list[BatchItem] = []
        preempted = False
        block_size = kv.block_size
        caching = kv.caching
        align = caching and kv.state_blocks            # rule 10: a hybrid model's align mode
        if align:
            kv.new_step_starts()
        new_item = tuple.__new__          # BatchItem(...) without the NamedTuple call overhead
        i = 0
        while i < len(running) and budget > 0:
            r = running[i]
            computed = r.num_computed_tokens
            n = r.num_prompt_tokens + r.num_output_tokens - computed
            if n == 1 and not align and computed < len(r.block_ids) * block_size:
                items.append(new_item(BatchItem, (r.req_id, 1, computed, 0)))   # the hot path: a
                budget -= 1                                                      # decode with room
                i += 1
                if caching and not (computed + 1) % block_size:
                    kv.cache(r, computed + 1)          # the token completes its block
                continue
            if align:
                n = self._aligned(kv, r, computed, n, threshold, budget, block_size)
                if not n:                              # no block-aligned chunk fits: the next one
                    i += 1
                    continue
            n, evicted = self._schedule_running(state, r, computed, n, threshold, budget, items)
            preempted = preempted or evicted
            if not n:
                break
            budget -= n
            i += 1
        if not preempted:
            self._admit(state, now_s, budget, threshold, items)
        return Batch(tuple(items)) if items else Idle()

    def _aligned(self, kv: Any, r: Request, start: int, n: int, threshold: int, budget: int, size: int) -> int:
        """Rule 10 of the module doc: ``n`` tokens of ``r`` from ``start``, within the long-prefill
        ``threshold`` (0: none) and the step's ``budget``, cut where vLLM's
        ``Scheduler._mamba_block_aligned_split`` cuts them (its default path: no partial hash hits,
        no prefill checkpoint blocks, no EAGLE, no shared-prefix junction); 0: none fit."""
        n = min(n, threshold, budget) if 0 < threshold else min(n, budget)
        known = r.num_prompt_tokens + r.num_output_tokens
        prefill_end = max(r.num_prompt_tokens, known - 1)
        if start >= prefill_end:
            return n
        last_state = max(0, (known - 1) // size * size)    # get_mamba_prefill_checkpoint_position
        end = start + n
        if end < prefill_end:
            most = self.token_budget
            if self.config.long_prefill_token_threshold > 0:
                most = min(most, self.config.long_prefill_token_threshold)
            floor = end // size * size
            if floor > start or size <= most:
                end = floor
        stops = [last_state]
        if start % size:
            stops.append((start // size + 1) * size)
        # The shared-prefix junction (Marconi-style: a prefix other requests computed whose state
        # is not cached), floored to a block from the chunk's start.
        junction = kv.shared_prefix_boundary(r)
        if start < junction < end:
            stops.append(start + (junction - start) // size * size)
        inside = [s for s in stops if start < s < end]
        if inside:
            end = min(inside)
        return max(end - start, 0)

    @staticmethod
    def _schedule_running(state: SchedulerState, r: Request, computed: int, n: int, threshold: int, budget: int,
                          items: list[BatchItem]) -> tuple[int, bool]:
        """Step 2's general path for running ``r`` (``computed`` tokens, the step in flight's
        included, ``n`` to compute): capped by the threshold and the budget (>= 1: a running
        request always has a token to compute), its blocks allocated (which registers the full
        blocks among the tokens it knows), the last running request preempted while they do not
        fit. (tokens scheduled, 0 if ``r`` itself was preempted; whether anyone was)."""
        if 0 < threshold < n:
            n = threshold
        n = min(n, budget)
        kv, running = state.kv, state.running
        preempted = False
        while not kv.can_allocate(r, computed + n):
            victim = running[-1]
            state.preempt(victim)
            preempted = True
            if victim is r:
                return 0, True
        kv.allocate(r, computed + n)
        items.append(BatchItem(r.req_id, n, computed))
        return n, preempted

    def _admit(self, state: SchedulerState, now_s: float, budget: int, threshold: int,
               items: list[BatchItem]) -> None:
        """Step 3 of the module doc: FCFS admission, stopping at the first misfit."""
        if state.remote is not None:
            return self._admit_remote(state, now_s, budget, threshold, items)
        kv = state.kv
        waiting, running = state.waiting, state.running
        # vLLM: int(watermark x num_gpu_blocks), the null block included
        watermark_blocks = int(self.config.watermark * (kv.num_blocks + self.num_reserved_blocks))
        caching = kv.caching
        block_size = kv.block_size
        align = caching and kv.state_blocks
        while budget > 0 and waiting and len(running) < self.max_num_seqs:
            r = waiting[0]
            known = r.num_prompt_tokens + r.num_output_tokens     # a preempted request recomputes its outputs too
            hit = kv.lookup(r) if caching else ()
            hit_tokens = len(hit) * block_size
            # Blocks the request takes beyond its hit, plus the hit blocks now in the free queue, plus
            # a hybrid model's state blocks (sim.cost.hybrid: one a linear-layer group).
            extra = (kv.num_evictable(hit) - len(hit) if hit else 0) + (
                kv.state_admission_blocks(r) if align else kv.state_blocks)
            n = known - hit_tokens
            if 0 < threshold < n:
                n = threshold
            n = min(n, budget)
            if align:
                n = self._aligned(kv, r, hit_tokens, n, threshold, budget, block_size)
                if not n:
                    break
            free = kv.num_free_blocks - (watermark_blocks if running else 0)
            if self.config.reserve_full_prompt:
                whole = min(known, self.max_model_len)
                if kv.num_blocks_for(whole) + extra > free:
                    break
            if kv.num_blocks_for(hit_tokens + n) + extra > free:
                break
            if hit:
                kv.touch(r, hit)
            kv.allocate(r, hit_tokens + n)
            if caching:
                kv.record_lookup(r, hit_tokens)
            state.admit(r, now_s, hit_tokens)
            items.append(BatchItem(r.req_id, n, hit_tokens))
            budget -= n

    def _admit_remote(self, state: SchedulerState, now_s: float, budget: int, threshold: int,
                      items: list[BatchItem]) -> None:
        """Step 3 on a decode instance of disaggregated serving (rule 9 of the module doc):
        ``kv_holding_waiting`` first, then the waiting queue, a remote prefill's blocks
        allocated without budget while its KV is pulled."""
        kv = state.kv
        waiting, running, remote = state.waiting, state.running, state.remote
        holding, loading, received = remote.holding, remote.loading, remote.received
        watermark_blocks = int(self.config.watermark * (kv.num_blocks + self.num_reserved_blocks))
        caching = kv.caching
        block_size = kv.block_size
        max_len = self.max_model_len
        skipped: list[Request] = []
        while budget > 0 and len(running) < self.max_num_seqs:
            if holding:
                r = holding[0]
                if r.req_id in loading:
                    if r.req_id not in received:
                        skipped.append(holding.popleft())        # its KV is still on its way
                        continue
                    # _update_waiting_for_remote_kv: the blocks are registered now; a whole
                    # prompt's KV computes its last token again, to sample from it.
                    received.discard(r.req_id)
                    loading.discard(r.req_id)
                    if caching:
                        kv.cache(r, r.num_computed_tokens)
                    if r.num_computed_tokens == r.num_prompt_tokens + r.num_output_tokens:
                        state.rewind_remote(r, r.num_computed_tokens - 1)
                computed = r.num_computed_tokens
                n = r.num_prompt_tokens + r.num_output_tokens - computed
                if 0 < threshold < n:
                    n = threshold
                n = min(n, budget)
                free = kv.num_free_blocks - (watermark_blocks if running else 0)
                full = max(0, kv.num_blocks_for(min(r.num_prompt_tokens + r.num_output_tokens, max_len))
                           - len(r.block_ids))
                if self.config.reserve_full_prompt and full > free:
                    break
                if max(0, kv.num_blocks_for(computed + n) - len(r.block_ids)) > free:
                    break
                kv.allocate(r, computed + n)
                state.admit_remote(r, now_s)
                items.append(BatchItem(r.req_id, n, computed))
                budget -= n
                continue
            if not waiting:
                break
            r = waiting[0]
            known = r.num_prompt_tokens + r.num_output_tokens
            hit = kv.lookup(r) if caching else ()
            hit_tokens = len(hit) * block_size
            extra = kv.num_evictable(hit) - len(hit) if hit else 0
            free = kv.num_free_blocks - (watermark_blocks if running else 0)
            if not r.remote_kv:                       # a request of its own (or recomputing)
                n = known - hit_tokens
                if 0 < threshold < n:
                    n = threshold
                n = min(n, budget)
                if self.config.reserve_full_prompt and kv.num_blocks_for(min(known, max_len)) + extra > free:
                    break
                if kv.num_blocks_for(hit_tokens + n) + extra > free:
                    break
                if hit:
                    kv.touch(r, hit)
                kv.allocate(r, hit_tokens + n)
                if caching:
                    kv.record_lookup(r, hit_tokens)
                state.admit(r, now_s, hit_tokens)
                items.append(BatchItem(r.req_id, n, hit_tokens))
                budget -= n
                continue
            # NixlConnector.get_num_new_matched_tokens: the prompt beyond the local hit comes over
            # the link, loaded asynchronously; its blocks are taken now, without budget, if they
            # fit what the in-flight prefills still need (_inflight_prefill_reserved_blocks).
            remote_tokens = r.num_prompt_tokens - hit_tokens
            if self.config.reserve_full_prompt and kv.num_blocks_for(min(known, max_len)) + extra > free:
                break
            reserved = 0
            prefilling = state.prefilling
            for q in running:
                if q.req_id in prefilling:
                    reserved += max(0, kv.num_blocks_for(min(q.num_prompt_tokens + q.num_output_tokens, max_len))
                                    - len(q.block_ids))
            if kv.num_blocks_for(known) + extra > free - reserved:
                break
            if hit:
                kv.touch(r, hit)
            kv.reserve(r, known)                      # delay_cache_blocks: registered when loaded
            if caching:
                kv.record_lookup(r, hit_tokens)
            state.park_remote(r)
            skipped.append(r)
            remote.on_alloc(r, remote_tokens, now_s)
        if skipped:
            holding.extendleft(reversed(skipped))

    def _schedule_async(self, state: SchedulerState, now_s: float) -> Batch | Idle:
        """Rule 7 of the module doc: ``schedule`` with the step in flight (``state.pending``)
        counted as computed, its sampled tokens as placeholders."""
        kv = state.kv
        running = state.running
        budget = self.token_budget
        threshold = self.config.long_prefill_token_threshold
        if len(running) + state.num_waiting <= 1:
            threshold = 0
        flight = {it[0]: it[1] for it in state.pending[-1].items} if state.pending else {}
        get = flight.get
        items: list[BatchItem] = []
        preempted = False
        block_size = kv.block_size
        caching = kv.caching
        align = caching and kv.state_blocks            # rule 10
        if align:
            kv.new_step_starts()
        new_item = tuple.__new__
        i = 0
        while i < len(running) and budget > 0:
            r = running[i]
            ahead = get(r.req_id, 0)
            computed = r.num_computed_tokens + ahead
            known = r.num_prompt_tokens + r.num_output_tokens
            if ahead and computed == known:              # a token in flight: a placeholder
                if computed + 1 >= r.num_prompt_tokens + r.max_output_tokens:
                    i += 1             # that token is its last by length: nothing to schedule
                    continue
                if not align and computed < len(r.block_ids) * block_size:   # the hot path: a decode with room
                    items.append(new_item(BatchItem, (r.req_id, 1, computed, 0)))
                    budget -= 1
                    i += 1
                    if caching and known // block_size > r.num_hashed_blocks:
                        kv.cache(r, known)    # as allocate would: the full blocks of known ids
                    continue
                n = 1
            else:
                n = known - computed
            if align:
                n = self._aligned(kv, r, computed, n, threshold, budget, block_size)
                if not n:
                    i += 1
                    continue
            n, evicted = self._schedule_running(state, r, computed, n, threshold, budget, items)
            preempted = preempted or evicted
            if not n:
                break
            budget -= n
            i += 1
        if not preempted:
            self._admit(state, now_s, budget, threshold, items)
        return Batch(tuple(items)) if items else Idle()

    def _schedule_speculative(self, state: SchedulerState, now_s: float) -> Batch | Idle:
        """Rule 8 of the module doc: ``schedule`` with drafts (``state.speculation``), and under
        rule 7 ``AsyncScheduler``'s: a request whose step in flight (``state.pending``, empty
        in the synchronous loop) will sample holds 1 + d output placeholders, and the next
        step schedules ``num_tokens + drafts + placeholders - computed`` (1 + k for a decode),
        the step in flight's tokens counted as computed as if every draft were accepted (its
        output rolls them back). Synchronously the drafts are the proposer's, set at commit;
        asynchronously k placeholder drafts are set here for every request that will sample."""
        spec_state = state.speculation
        if spec_state is None:
            raise RuntimeError("vllm_v1 with speculative decoding needs state.speculation (sim.run.runner sets it)")
        pipelined = self.pipelined
        kv = state.kv
        running = state.running
        budget = self.token_budget
        threshold = self.config.long_prefill_token_threshold
        if len(running) + state.num_waiting <= 1:
            threshold = 0
        max_model_len = self.max_model_len
        lookahead = self.speculative.lookahead
        ahead_batch = state.pending[-1] if state.pending else None
        flight = {it[0]: it[1] for it in ahead_batch.items} if ahead_batch is not None else {}
        flight_drafts = (ahead_batch.drafts or {}) if ahead_batch is not None else {}
        drafts = spec_state.drafts
        prefilling = state.prefilling
        block_size = kv.block_size
        caching = kv.caching
        verify: dict[int, int] = {}
        items: list[BatchItem] = []
        sampling: list[int] = []
        preempted = prefill_scheduled = False
        i = 0
        while i < len(running) and budget > 0:
            r = running[i]
            rid = r.req_id
            ahead = flight.get(rid, 0)
            computed = r.num_computed_tokens + ahead
            known = r.num_prompt_tokens + r.num_output_tokens
            placeholders = 0
            if ahead:
                d_in = flight_drafts.get(rid, 0)
                if computed - d_in >= known:                   # its step in flight samples
                    placeholders = 1 + d_in
                    if computed + 2 - placeholders >= r.num_prompt_tokens + r.max_output_tokens:
                        i += 1           # the step in flight yields its last token by length
                        continue
            s = drafts.get(rid, 0)
            n = known + s + placeholders - computed
            if 0 < threshold < n:
                n = threshold
            n = min(n, budget, max_model_len - computed - 1)     # the sampled token's position fits
            if n <= 0:
                i += 1
                continue
            slots = computed + n
            extra = min(slots + lookahead, max_model_len) - slots
            if slots + extra <= len(r.block_ids) * block_size:       # the hot path: room in its blocks
                if caching and min(slots, known) // block_size > r.num_hashed_blocks:
                    kv.cache(r, min(slots, known))                    # as allocate would
            else:
                victim = None
                while not kv.can_allocate(r, slots + extra):
                    victim = running[-1]
                    state.preempt(victim)
                    preempted = True
                    if victim is r:
                        break
                if victim is r:
                    break
                kv.allocate(r, slots, extra)
            items.append(BatchItem(rid, n, computed))
            prefill_scheduled = prefill_scheduled or (rid in prefilling and not placeholders)
            if s:
                if slots > known + placeholders:
                    verify[rid] = slots - known - placeholders
                del drafts[rid]                      # vLLM clears spec_token_ids once scheduled
            if pipelined and slots >= known + placeholders:
                sampling.append(rid)
            budget -= n
            i += 1
        if not preempted:
            first = len(items)
            self._admit_speculative(state, now_s, budget, threshold, items, verify, len(items) > 0,
                                    prefill_scheduled)
            if pipelined:
                requests = state.requests
                sampling += [it[0] for it in items[first:] if it[1] + it[2] >= requests[it[0]].num_prompt_tokens
                             + requests[it[0]].num_output_tokens]
        if not pipelined:
            return Batch(tuple(items), verify or None) if items else Idle()
        k = self.speculative.num_speculative_tokens
        for rid in sampling:
            drafts[rid] = k          # AsyncScheduler: placeholder drafts for the next step
        if not items:
            spec_state.padded.clear()
            return Idle()
        batch = Batch(tuple(items), verify or None)
        spec_state.sampling[id(batch)] = (frozenset(sampling), frozenset(spec_state.padded))
        spec_state.padded.clear()    # kept with the batch: the one in flight commits first
        return batch

    def _admit_speculative(self, state: SchedulerState, now_s: float, budget: int, threshold: int,
                           items: list[BatchItem], verify: dict[int, int], scheduled_running: bool,
                           prefill_scheduled: bool) -> None:
        """Step 3 with drafts: EAGLE/MTP's prefix hit one block shorter, the lookahead slots
        allocated, a one-token request padded to 1 + k (rule 8)."""
        kv = state.kv
        spec = self.speculative
        k = spec.num_speculative_tokens
        padded = state.speculation.padded
        waiting, running = state.waiting, state.running
        watermark_blocks = int(self.config.watermark * (kv.num_blocks + self.num_reserved_blocks))
        caching = kv.caching
        block_size = kv.block_size
        max_model_len = self.max_model_len
        while budget > 0 and waiting and len(running) < self.max_num_seqs:
            r = waiting[0]
            known = r.num_prompt_tokens + r.num_output_tokens
            hit = kv.lookup(r) if caching else ()
            if hit and spec.drops_eagle_block:
                hit = hit[:-1]
            hit_tokens = len(hit) * block_size
            extra = kv.num_evictable(hit) - len(hit) if hit else 0
            n = known - hit_tokens
            pad = False
            if n == 1 and not prefill_scheduled and (scheduled_running or hit_tokens > 0):
                if hit_tokens + 1 + k + 1 <= max_model_len:
                    if 1 + k > budget:
                        break                        # vLLM: rather not schedule than schedule unpadded
                    n = 1 + k
                    pad = True
            if 0 < threshold < n:
                n = threshold
            n = min(n, budget)
            free = kv.num_free_blocks - (watermark_blocks if running else 0)
            if self.config.reserve_full_prompt:
                if kv.num_blocks_for(min(known, max_model_len)) + extra > free:
                    break
            slots = hit_tokens + n
            ahead = min(slots + spec.lookahead, max_model_len) - slots
            if kv.num_blocks_for(slots + ahead) + extra > free:
                break
            if hit:
                kv.touch(r, hit)
            kv.allocate(r, slots, ahead)
            if caching:
                kv.record_lookup(r, hit_tokens)
            state.admit(r, now_s, hit_tokens)
            items.append(BatchItem(r.req_id, n, hit_tokens))
            if pad and n > 1:
                verify[r.req_id] = n - 1
                padded.add(r.req_id)
            budget -= n

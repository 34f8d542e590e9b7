"""vLLM v1 (the engine of today's vLLM): one token budget, running requests first.

The rules of ``vllm.v1.core.sched.scheduler.Scheduler.schedule`` in vLLM
0.32.0 with FCFS, prefix caching on or off, no speculative decoding, no KV
connector (``tests/policies/test_vllm_v1_differential.py`` checks them step by step
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
   async_scheduling_of). The timing is not overlapped: a step still costs its
   forward pass plus its host time, the async host terms with kernel profiles.

Not modelled: async scheduling's host-time overlap, priorities, speculative
decoding, KV connectors, multimodal inputs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from policies.base import PolicyBase, config_knobs, knob, plain_stretch_shape
from policies.vllm import check_budget
from sim.core.batch import Batch, BatchItem, Idle
from sim.core.policy import EngineKnob, PolicyContext, PrefixSwitch
from sim.core.prefix import PrefixCachePool

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
                            async_scheduling=self.async_scheduling)

    def schedule(self, state: SchedulerState, now_s: float) -> Batch | Idle:
        if self.pipelined:
            return self._schedule_async(state, now_s)
        kv = state.kv
        running = state.running
        budget = self.token_budget
        threshold = self.config.long_prefill_token_threshold
        if len(running) + len(state.waiting) <= 1:
            threshold = 0
        items: list[BatchItem] = []
        preempted = False
        block_size = kv.block_size
        caching = kv.caching
        new_item = tuple.__new__          # BatchItem(...) without the NamedTuple call overhead
        i = 0
        while i < len(running) and budget > 0:
            r = running[i]
            computed = r.num_computed_tokens
            n = r.num_prompt_tokens + r.num_output_tokens - computed
            if n == 1 and computed < len(r.block_ids) * block_size:
                items.append(new_item(BatchItem, (r.req_id, 1, computed, 0)))   # the hot path: a
                budget -= 1                                                      # decode with room
                i += 1
                if caching and not (computed + 1) % block_size:
                    kv.cache(r, computed + 1)          # the token completes its block
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
        kv = state.kv
        waiting, running = state.waiting, state.running
        # vLLM: int(watermark x num_gpu_blocks), the null block included
        watermark_blocks = int(self.config.watermark * (kv.num_blocks + self.num_reserved_blocks))
        caching = kv.caching
        block_size = kv.block_size
        while budget > 0 and waiting and len(running) < self.max_num_seqs:
            r = waiting[0]
            known = r.num_prompt_tokens + r.num_output_tokens     # a preempted request recomputes its outputs too
            hit = kv.lookup(r) if caching else ()
            hit_tokens = len(hit) * block_size
            # Blocks the request takes beyond its hit, plus the hit blocks now in the free queue.
            extra = kv.num_evictable(hit) - len(hit) if hit else 0
            n = known - hit_tokens
            if 0 < threshold < n:
                n = threshold
            n = min(n, budget)
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

    def _schedule_async(self, state: SchedulerState, now_s: float) -> Batch | Idle:
        """Rule 7 of the module doc: ``schedule`` with the step in flight (``state.pending``)
        counted as computed, its sampled tokens as placeholders."""
        kv = state.kv
        running = state.running
        budget = self.token_budget
        threshold = self.config.long_prefill_token_threshold
        if len(running) + len(state.waiting) <= 1:
            threshold = 0
        flight = {it[0]: it[1] for it in state.pending[-1].items} if state.pending else {}
        get = flight.get
        items: list[BatchItem] = []
        preempted = False
        block_size = kv.block_size
        caching = kv.caching
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
                if computed < len(r.block_ids) * block_size:     # the hot path: a decode with room
                    items.append(new_item(BatchItem, (r.req_id, 1, computed, 0)))
                    budget -= 1
                    i += 1
                    if caching and known // block_size > r.num_hashed_blocks:
                        kv.cache(r, known)    # as allocate would: the full blocks of known ids
                    continue
                n = 1
            else:
                n = known - computed
            n, evicted = self._schedule_running(state, r, computed, n, threshold, budget, items)
            preempted = preempted or evicted
            if not n:
                break
            budget -= n
            i += 1
        if not preempted:
            self._admit(state, now_s, budget, threshold, items)
        return Batch(tuple(items)) if items else Idle()

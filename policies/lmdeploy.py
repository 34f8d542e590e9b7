"""LMDeploy's PyTorch engine (lmdeploy 0.18.0): persistent batching, prefill or decode per step.

Source read, from the 0.18.0 wheel: ``lmdeploy/pytorch/engine/inputs_maker.py``
(``do_prefill_default``, ``_ForwardInputsTask.run``, ``LongContextChunker``,
``create_model_inputs_delta``), ``lmdeploy/pytorch/paging/scheduler.py`` (``schedule_running``),
``paging/prefill_scheduler.py`` (``_PrefillScheduler.schedule``, its admission gates and
reordering), ``paging/eviction_helper/recompute_eviction_helper.py``,
``paging/block_manager/default_block_manager.py``, ``strategies/ar/engine.py`` (prealloc sizes),
``pytorch/config.py``, ``engine/config_builder.py``, ``messages.py`` (``PytorchEngineConfig``
defaults) and ``utils.get_max_batch_size``. Chunked prefill of the new engine mode
(``enable_chunked_prefill``) is off in 0.18.0 (``MiscConfig`` hard-codes it false).

1. Each step is a prefill *or* a decode (a prefill runs only new requests; running ones pause).
   ``do_prefill``: nothing waiting -> decode (the decode counter resets); the decode counter has
   reached ``prefill_interval`` -> prefill; the waiting requests' tokens reach
   ``max_prefill_token_num`` -> prefill; fewer than ``max_batch_size / 2`` running -> prefill;
   else decode and count it. A step that runs a prefill resets the counter; a prefill that admits
   nobody falls back to a decode.
2. A prefill admits waiting requests by arrival while fewer than ``max_batch_size`` run: the first
   always, a later one only while the step's tokens stay within ``max_prefill_token_num`` (else the
   scan stops); each needs blocks for all its tokens plus ``prefill_interval`` (the engine's
   prealloc; cut at the pool's size, where LMDeploy would wait forever), and the first that does
   not fit stops the scan.
3. A decode walks the running requests from the newest: one whose next token has no slot needs
   blocks for ``prefill_interval`` tokens more; if the pool cannot give them it preempts *itself*
   (recompute: blocks freed, back to the waiting queue by arrival), so an older request can be the
   victim while a newer one that was served first keeps its block.
4. A prompt longer than ``max_prefill_token_num`` is prefilled alone in chunks of that size
   (``LongContextChunker``): it is admitted only first in a prefill, its blocks grow chunk by
   chunk, and while it runs the opt-TTFT turns of 0.18 apply: a non-final chunk never follows
   another (a decode, or a short prefill, runs between), up to 3 short prefills
   (``LMDEPLOY_PT_TTFT_SHORT_TURNS``) may go before it, shortest first, and with a long prompt
   waiting the prefill turn tries short ones first (smallest first) until the long turn is due,
   then the long prompt with the fewest chunks (aged by 2 s a chunk) goes first. Its last chunk
   runs at once, as a prefill.
5. The pool: ``cache_max_entry_count`` (0.8) of the memory free after the weights, less the
   runtime buffers of a ``max_prefill_token_num`` step (``engine/executor/base.py``,
   ``_get_runtime_size``): ``KvMemory(0.8, "free")``, in blocks of ``block_size`` (64); one block
   is reserved for dummy inputs. ``max_batch_size`` unset: 1024 on H100/H800/H200/L20Y, 384 on A100/A800, else
   128 (``get_max_batch_size``).
6. ``enable_prefix_caching`` (off, as in LMDeploy): a waiting request first takes its cached full
   blocks (``sim.core.prefix``'s pool stands in for LMDeploy's ``BlockTrie``); the hit tokens cost
   no budget.

Not modelled: the async engine loop's one-step prefetch (the scheduler decides as if the previous
step had committed, which is what its "+ max_q_seqlen" compensation aims at), speculative
decoding, multimodal spans in long prompts, DP/EP, PD disaggregation and KV connectors.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import islice
from typing import TYPE_CHECKING, Any, Literal

from policies.base import PolicyBase, config_knobs, knob, plain_stretch_shape
from policies.lmdeploy_queue import SHORT_TURNS, prefill_order, requeue_by_arrival
from sim.core.batch import Batch, BatchItem, Idle
from sim.core.policy import EngineKnob, KvMemory, PolicyContext, PrefixSwitch, StretchShape
from sim.core.prefix import PrefixCachePool
from sim.core.request import Request, Status

if TYPE_CHECKING:
    from sim.core.state import SchedulerState

# utils.get_max_batch_size: device name fragment -> max_batch_size (others: 128)
MAX_BATCH_SIZES = {"a100": 384, "a800": 384, "h100": 1024, "h800": 1024, "l20y": 1024, "h200": 1024}


@dataclass(frozen=True, slots=True)
class LmdeployConfig:
    kind: Literal["lmdeploy"] = "lmdeploy"
    max_batch_size: int | None = knob(None, "most requests running at once; unset: LMDeploy's default for "
                                            "the profile's GPU (1024 H100/H200, 384 A100, else 128)")
    max_prefill_token_num: int = knob(8192, "most tokens of a prefill step, and a long prompt's chunk "
                                            "(LMDeploy's default 8192)")
    prefill_interval: int = knob(16, "consecutive decode steps that force a prefill, and the tokens of KV "
                                     "preallocated (LMDeploy's default 16)")
    block_size: int = knob(64, "tokens per KV block (LMDeploy's default 64)")
    cache_max_entry_count: float = knob(0.8, "share of the free GPU memory given to the KV cache "
                                             "(LMDeploy's default 0.8)")
    enable_prefix_caching: bool = knob(False, "reuse cached full blocks of earlier prompts (LMDeploy's "
                                              "default: off)")


def default_max_batch_size(context: PolicyContext) -> int:
    device = context.device.lower()
    return next((size for name, size in MAX_BATCH_SIZES.items() if name in device), 128)


class LmdeployPolicy(PolicyBase):
    # Fast path (sim.loop.stretch): with nothing waiting, every step decodes all running requests
    # (case (a)); a decode grows by one block at a block boundary, as the loop's stretch does, when
    # block_size >= prefill_interval (stretch_shape refuses smaller pages). With requests waiting
    # the decode counter moves every step (rule 1), so stretch_shape refuses case (b); a long
    # prompt's chunks end any stretch, its last one too.
    decode_stretch = True
    num_reserved_blocks = 1        # CacheConfig.num_reserved_gpu_blocks
    prefix_switch = PrefixSwitch("enable_prefix_caching")
    server_knobs = {
        "block_size": EngineKnob("block_size", "PytorchEngineConfig's block_size, its KV block"),
        "gpu_memory_utilization": EngineKnob("cache_max_entry_count", "PytorchEngineConfig's cache_max_entry_count, "
                                                                      "a share of the memory free after the weights"),
        "watermark": EngineKnob(None, "a decode that finds no block preempts itself"),
    }

    def __init__(self, config: LmdeployConfig, context: PolicyContext) -> None:
        if not 0 < config.cache_max_entry_count < 1:
            raise ValueError(f"cache_max_entry_count must be in (0, 1), got {config.cache_max_entry_count}")
        if config.block_size < 16 or config.block_size & (config.block_size - 1):
            raise ValueError(f"block_size must be a power of 2 >= 16 (LMDeploy's kernel block), got "
                             f"{config.block_size}")
        self.config = config
        self.max_num_seqs = config.max_batch_size or default_max_batch_size(context)
        self.token_budget = config.max_prefill_token_num
        self.block_size = config.block_size
        self.kv_memory = KvMemory(config.cache_max_entry_count, "free")
        if config.enable_prefix_caching:
            self.kv_pool_class = PrefixCachePool
        self._decode_count = 0                 # inputs_maker's _decode_count
        self._short_turns = 0                  # _short_prefill_turns_since_long_chunk
        self._last_kind: str | None = None     # the kind of the step just scheduled
        self._long: Request | None = None      # the LongContextChunker's request
        self._state: SchedulerState | None = None    # the state of the last step (stretch_shape reads its queue)

    def stretch_shape(self, running, live_context, num_live, prefilling) -> StretchShape | None:
        state = self._state
        if state is None or state.waiting:            # case (b): the decode counter moves every step
            return None
        if state.kv.block_size < self.config.prefill_interval:
            return None                                # a decode's prealloc takes blocks two at a time
        if self._long is not None:
            # A long prompt's last chunk may be one token (a recompute of prompt + outputs): it looks
            # like a decode, but preallocates prefill_interval tokens more (rule 4), a block a decode
            # would not take.
            return None
        return plain_stretch_shape(self, running, live_context, num_live, prefilling)

    def knobs(self) -> dict[str, Any]:
        return config_knobs(self.config, max_batch_size=self.max_num_seqs)

    # ---- one step: _ForwardInputsTask.run ------------------------------------------------------
    def schedule(self, state: SchedulerState, now_s: float) -> Batch | Idle:
        self._state = state
        long = self._long if self._long is not None and self._long.status == Status.RUNNING else None
        self._long = long
        limit = self.config.max_prefill_token_num
        prefill = self._do_prefill(state, long)
        items: list[BatchItem] = []
        deferred = blocked = tried_long = tried_short = decode = False
        turn_due = self._short_turns >= SHORT_TURNS
        decoding = [r for r in state.running if r is not long]
        if long is not None:                          # _select_active_chunk_work
            final = long.num_uncomputed_tokens <= limit
            if (not final and self._last_kind == "long_chunk") or (final and decoding and not prefill):
                deferred = True
            elif not final and state.waiting and not turn_due:
                tried_short, items = True, self._short_prefill(state, now_s)
                if not items:
                    tried_long, items = True, self._chunk(state, long)
                    blocked = not items
            else:
                tried_long, items = True, self._chunk(state, long)
                blocked = not items
        elif prefill:                                 # _select_prefill_work
            long_waiting = any(r.num_uncomputed_tokens > limit for r in state.waiting)
            if long_waiting and not turn_due:
                tried_short, items = True, self._short_prefill(state, now_s)
                if not items:
                    tried_long, items = True, self._prefill(state, now_s, "long_first")
            else:
                tried_long = long_waiting
                items = self._prefill(state, now_s, "long_first" if long_waiting else "standard")
        if not items and tried_long and not blocked and not tried_short and state.waiting:
            tried_short, items = True, self._short_prefill(state, now_s)
        num_preemptions = state.num_preemptions
        if not items and decoding:
            items, decode = self._decode(state, decoding), True
        if not items and deferred and not tried_short and not turn_due and state.waiting:
            tried_short, items, decode = True, self._short_prefill(state, now_s), False
        if not items and deferred:
            items, decode = self._chunk(state, long), False
        if not items:
            if state.num_preemptions != num_preemptions:
                return self.schedule(state, now_s)    # every decode preempted itself: the loop goes on
            return Idle()
        if not decode:
            self._decode_count = 0
        long_now = self._long                         # a non-final chunk leaves it set
        self._last_kind = ("decode" if decode else "long_chunk"
                           if long_now is not None and items[0].req_id == long_now.req_id else "prefill")
        return Batch(tuple(items))

    def _do_prefill(self, state: SchedulerState, long: Request | None) -> bool:
        """Rule 1 of the module doc (``do_prefill_default``)."""
        limit = self.config.max_prefill_token_num
        pending_last = long is not None and long.num_uncomputed_tokens <= limit
        if not state.waiting and not pending_last:
            self._decode_count = 0
            return False
        if pending_last or self._decode_count >= self.config.prefill_interval:
            return True
        tokens = 0
        for r in state.waiting:
            tokens += r.num_uncomputed_tokens
            if tokens >= limit:
                return True
        if len(state.running) < self.max_num_seqs * 0.5:
            return True
        self._decode_count += 1
        return False

    # ---- prefill: _PrefillScheduler.schedule ------------------------------------------------------
    def _short_prefill(self, state: SchedulerState, now_s: float) -> list[BatchItem]:
        items = self._prefill(state, now_s, "short_only")
        if items:
            self._short_turns += 1
        return items

    def _prefill(self, state: SchedulerState, now_s: float, turn: str) -> list[BatchItem]:
        """Rules 2 and 4: admit by the turn's order; ``turn`` is standard, short_only or long_first."""
        cfg = self.config
        limit = cfg.max_prefill_token_num
        room = self.max_num_seqs - len(state.running)
        if room <= 0 or not state.waiting:
            return []
        kv = state.kv
        bs = kv.block_size
        # a standard turn stops at its first misfit: it never looks past ``room`` requests
        waiting = list(islice(state.waiting, room)) if turn == "standard" else list(state.waiting)
        order = prefill_order(waiting, cfg.max_prefill_token_num, now_s, turn)
        capacity = kv.num_blocks * bs                  # a prealloc past the pool is cut (LMDeploy would hang)
        items: list[BatchItem] = []
        tokens = 0
        for r in order:
            if len(items) >= room:
                break
            hit = kv.lookup(r) if kv.caching else []
            cached = len(hit) * bs
            count = r.num_uncomputed_tokens - cached
            is_long = count > limit
            if is_long and turn == "short_only":
                continue                                          # non-final long gate: skip
            n = limit if is_long else count
            if items and tokens + n > limit:
                if turn == "short_only":
                    continue
                break
            target = cached + limit if is_long else min(r.num_uncomputed_tokens + cfg.prefill_interval, capacity)
            need = kv.num_blocks_for(target) - len(hit) + (kv.num_evictable(hit) if hit else 0)
            if need > kv.num_free_blocks:
                break
            if hit:
                kv.touch(r, hit)
            kv.allocate(r, target)
            if kv.caching:
                kv.record_lookup(r, cached)
            state.admit(r, now_s, cached)
            items.append(BatchItem(r.req_id, n, cached))
            tokens += n
            if is_long:
                self._long, self._short_turns = r, 0
                break
        return items

    def _chunk(self, state: SchedulerState, long: Request | None) -> list[BatchItem]:
        """The long prompt's next chunk (``_build_active_chunk``), if its blocks fit; [] if not."""
        if long is None:
            return []
        kv = state.kv
        limit = self.config.max_prefill_token_num
        computed = long.num_computed_tokens
        rest = long.num_uncomputed_tokens
        final = rest <= limit
        n = rest if final else limit
        target = min(computed + n + (self.config.prefill_interval if final else 0), kv.num_blocks * kv.block_size)
        if not kv.can_allocate(long, target):
            return []
        kv.allocate(long, target)
        if final:
            self._long = None
        self._short_turns = 0
        return [BatchItem(long.req_id, n, computed)]

    # ---- decode: Scheduler.schedule_running ---------------------------------------------------------
    def _decode(self, state: SchedulerState, decoding: list[Request]) -> list[BatchItem]:
        """Rule 3: newest first, a request that cannot grow preempts itself."""
        kv = state.kv
        bs = kv.block_size
        interval = self.config.prefill_interval
        capacity = kv.num_blocks * bs
        valid = [True] * len(decoding)
        for i in range(len(decoding) - 1, -1, -1):
            r = decoding[i]
            computed = r.num_computed_tokens
            if computed < len(r.block_ids) * bs:
                continue
            target = min(computed + interval, capacity)
            if kv.can_allocate(r, target):
                kv.allocate(r, target)
                continue
            state.preempt(r)
            requeue_by_arrival(state.waiting)
            valid[i] = False
        items = []
        caching = kv.caching
        for r, ok in zip(decoding, valid):
            if ok:
                computed = r.num_computed_tokens
                items.append(BatchItem(r.req_id, 1, computed))
                if caching and not (computed + 1) % bs:
                    kv.cache(r, computed + 1)      # the token completes its block
        return items


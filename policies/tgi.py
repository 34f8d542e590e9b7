"""Text Generation Inference (TGI), router v3: the batching loop of its last release line, v3.3.x.

TGI (huggingface/text-generation-inference) is in maintenance mode, its last release line v3.3.x:
that is what this work's brief states; offline we could confirm neither that nor the exact patch
tag (the index holds TGI's own repo up to a 3.1.1-dev0 workspace, and forks that track v3.2+).
We model the v3.2+ router files below and take v3.3.x's scheduling to be theirs.
Source read: ``backends/v3/src/backend.rs`` (``batching_task``, chunking version, fork
JulienDelavande/text-generation-inference), ``backends/v3/src/queue.rs`` (``State::next_batch``,
the v3.2+ version with ``support_chunking`` and ``is_hpu_device``, fork
wdunn001/text-generation-inference), ``backends/v3/src/block_allocator.rs`` and ``radix.rs``,
``launcher/src/main.rs`` (``resolve_attention``, the argument defaults) and the shard's
``server/text_generation_server/models/flash_causal_lm.py`` (``generate_token``: the next chunk).
``max_batch_prefill_tokens``: TGI 3's launcher derives a default from the GPU and the model when
it is unset, a rule we could not read (the launcher file we could read is older: ``max_input_tokens
+ 50``); we use 4096.

The router keeps one running batch. ``attention`` (the launcher's ``ATTENTION``; flashinfer is
its default on CUDA >= sm80) decides the KV page (flashinfer 1 token, flashdecoding 256, paged 16)
and whether the shard supports prefill chunking (flashinfer and flashdecoding do, paged does not).

With chunking (``support_chunking``):

1. Every step runs the whole running batch: a decoding request computes one token; a request
   whose prompt was cut computes its next chunk, sized by the shard after the previous step:
   ``min(rest, max_batch_prefill_tokens - (n - 1))`` tokens (at least 1), n the requests of that
   step, walking the batch from its newest request (``generate_token``'s reversed loop).
2. New requests join the same step (``prefill`` with the cached batch: one mixed forward) under
   a budget of ``max_batch_prefill_tokens`` less the cached batch's tokens, taken FCFS from the
   queue (``next_batch``): each needs blocks for ``prompt + max_new_tokens - 1`` tokens, reserved
   at once (so TGI never preempts), the first that does not fit stops the scan; its prompt (less
   a cached prefix) counts against the budget, and the one that overflows it is cut to fill it
   exactly and ends the scan. ``waiting_served_ratio`` and ``max_waiting_tokens`` are ignored
   (the router warns so).

Without chunking (paged):

3. A prefill step runs only new requests; the running batch pauses, then decodes with them
   (``backend.rs``: prefill, then concatenate). With nothing running, ``next_batch`` takes what
   fits. With a batch running, each iteration first tries to add a batch: ``min_size`` is
   ``floor(batch_size x waiting_served_ratio)`` unless ``waiting_tokens`` (decode steps since the
   last prefill, counted from 1) reached ``max_waiting_tokens``, when it is none; the queue must
   hold ``min_size`` requests and the assembled batch must reach it, else nothing joins. A joining
   prefill is always followed by a decode step. Prompts over ``max_batch_prefill_tokens`` are
   refused (the launcher requires ``max_input_tokens <= max_batch_prefill_tokens``).

4. The pool is ``max_batch_total_tokens`` = ``max_batch_total_tokens / block_size`` blocks, which
   the shard infers at warm-up from the free memory after a ``max_batch_prefill_tokens`` forward,
   times ``TGI_WIGGLE_ROOM`` 0.95 (``cuda_memory_fraction`` 1.0): ``KvMemory(0.95, "free")``.
   Block 0 is kept for health checks. ``max_concurrent_requests`` (128) bounds the requests in
   flight; TGI answers 429 beyond it, here it caps the running batch and the rest queue.

5. ``prefix_caching`` (TGI's default is on for flashinfer and flashdecoding; off here, see below):
   a waiting request takes its longest cached prefix (at most prompt - 1 tokens), which costs no
   budget. TGI's radix trie is token-granular and caches a request's *prompt* when it finishes;
   with ``prefix_caching`` on we run ``sim.core.prefix``'s block cache at TGI's page (1 token for
   flashinfer), registering a prompt's tokens as they are scheduled and never its outputs. That
   timing differs from TGI's (a concurrent request can hit a prompt still running), and hashing
   every token costs (3,000 requests of ``workloads/azure_conv.yaml`` simulate in 46 s instead of
   5 s, measured once on 2 busy cores): an approximation, off by default.

Not modelled: speculation, grammar, padded (non-flash) models, ``max_batch_size`` (only for
hardware without unpadded attention), VLMs, the 429s of ``max_concurrent_requests``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from policies.base import PolicyBase, batch_or_idle, knob, plain_stretch_shape
from sim.core.batch import Batch, BatchItem, Idle
from sim.core.policy import EngineKnob, KvMemory, PolicyContext, PrefixSwitch
from sim.core.prefix import PrefixCachePool
from sim.core.request import Request

if TYPE_CHECKING:
    from sim.core.state import SchedulerState

# launcher resolve_attention -> (block size: the Rust Attention::block_size, prefill chunking)
ATTENTIONS: dict[str, tuple[int, bool]] = {"flashinfer": (1, True), "flashdecoding": (256, True), "paged": (16, False)}
TGI_WIGGLE_ROOM = 0.95          # the shard's share of the free memory after warm-up that holds KV


@dataclass(frozen=True, slots=True)
class TgiConfig:
    kind: Literal["tgi"] = "tgi"
    max_batch_prefill_tokens: int = knob(4096, "most prompt tokens per prefill, and with chunking per step "
                                               "(4096; TGI 3 derives its default from the GPU and model)")
    max_waiting_tokens: int = knob(20, "without chunking: decode steps after which any waiting request may "
                                       "join (TGI's default 20)")
    waiting_served_ratio: float = knob(0.3, "without chunking: waiting requests needed, as a share of the "
                                            "running batch, to pause it for a prefill (TGI's default 0.3)")
    max_concurrent_requests: int = knob(128, "most requests in flight; here the running batch's cap (TGI's "
                                             "default 128; TGI answers 429 beyond it)")
    attention: str = knob("flashinfer", "the shard's attention: flashinfer (1-token pages, chunking; TGI's CUDA "
                                        "default), flashdecoding (256, chunking) or paged (16, no chunking)")
    prefix_caching: bool = knob(False, "reuse cached prompt prefixes (TGI's default on; here off: an "
                                       "approximation of its radix trie, see policies/tgi.py)")


class TgiPolicy(PolicyBase):
    # Fast path (sim.loop.stretch), with chunking and no prefix cache: blocks are reserved at
    # admission, so a decode step allocates nothing; a decode-only step with requests waiting means
    # the head did not fit the free blocks, the budget or the cap, and none of them changes until a
    # request finishes or arrives. Without chunking the loop's counters (waiting_tokens) live here:
    # it steps every iteration, as it does with the prefix cache (a stretch would cache outputs).
    decode_stretch = True
    num_reserved_blocks = 1        # TGI's block 0, kept for health checks
    prefix_switch = PrefixSwitch("prefix_caching")     # the launcher's name
    server_knobs = {
        "block_size": EngineKnob("attention", "TGI's KV page follows its attention: flashinfer 1 token, "
                                              "flashdecoding 256, paged 16"),
        "gpu_memory_utilization": EngineKnob(None, "TGI's pool is 0.95 of the memory free after its warm-up "
                                                   "forward; its --cuda-memory-fraction is not modelled"),
        "watermark": EngineKnob(None, "TGI reserves prompt + max_new_tokens at admission and never preempts"),
    }

    def __init__(self, config: TgiConfig, context: PolicyContext) -> None:
        if config.attention not in ATTENTIONS:
            raise ValueError(f"attention must be one of {', '.join(ATTENTIONS)}, got {config.attention!r}")
        self.config = config
        self.block_size, self.chunking = ATTENTIONS[config.attention]
        if config.prefix_caching and not self.chunking:
            raise ValueError("prefix_caching needs attention flashinfer or flashdecoding: TGI has no prefix "
                             "cache on paged attention")
        if config.prefix_caching:
            self.kv_pool_class = PrefixCachePool
        self.kv_memory = KvMemory(TGI_WIGGLE_ROOM, "free")
        self.token_budget = config.max_batch_prefill_tokens
        self.max_num_seqs = config.max_concurrent_requests
        self.max_prompt_tokens = None if self.chunking else config.max_batch_prefill_tokens
        self.decode_stretch = self.chunking and not config.prefix_caching
        self._last_batch_size = 0          # requests in the step just run (the shard's len(batch))
        self._waiting_tokens = 0           # without chunking: backend.rs's waiting_tokens
        self._must_decode = False          # without chunking: a joining prefill just ran

    stretch_shape = plain_stretch_shape          # decodes attend over their own contexts; no case (c)

    @staticmethod
    def unread_knobs(config: TgiConfig) -> dict[str, str]:
        if not ATTENTIONS.get(config.attention, (0, False))[1]:
            return {}
        why = f"with attention {config.attention}, which chunks prefills (TGI's router ignores it too)"
        return {"waiting_served_ratio": why, "max_waiting_tokens": why}

    def schedule(self, state: SchedulerState, now_s: float) -> Batch | Idle:
        if self.chunking:
            return self._schedule_chunked(state, now_s)
        return self._schedule_paused(state, now_s)

    # ---- with prefill chunking --------------------------------------------------------------------
    def _schedule_chunked(self, state: SchedulerState, now_s: float) -> Batch | Idle:
        """Rules 1-2 of the module doc: the cached batch's step, then new requests under the rest."""
        budget = self.config.max_batch_prefill_tokens - (self._last_batch_size - 1)
        items: list[BatchItem] = []
        kv = state.kv
        for r in reversed(state.running):           # generate_token walks the batch newest first
            computed = r.num_computed_tokens
            rest = r.num_prompt_tokens + r.num_output_tokens - computed
            if rest > 1:                             # a cut prompt: its next chunk
                n = max(min(rest, budget), 1)
                budget -= n
                if kv.caching:
                    kv.cache(r, computed + n)
            else:
                n = 1
            items.append(BatchItem(r.req_id, n, computed))
        items.reverse()
        current_tokens = sum(it.num_new_tokens for it in items)
        room = self.config.max_batch_prefill_tokens - current_tokens
        if room > 0 and state.waiting:
            items += self._next_batch(state, now_s, room, None)
        self._last_batch_size = len(items)
        return batch_or_idle(items)

    # ---- without prefill chunking -----------------------------------------------------------------
    def _schedule_paused(self, state: SchedulerState, now_s: float) -> Batch | Idle:
        """Rule 3 of the module doc: backend.rs's loop, one forward per call."""
        running = state.running
        if not running:                              # the outer loop: a fresh batch
            new = self._next_batch(state, now_s, self.config.max_batch_prefill_tokens, None)
            self._waiting_tokens, self._must_decode = 1, False
            return batch_or_idle(new)
        if self._must_decode:
            self._must_decode = False
        else:
            min_size = (None if self._waiting_tokens >= self.config.max_waiting_tokens
                        else int(len(running) * self.config.waiting_served_ratio))
            new = self._next_batch(state, now_s, self.config.max_batch_prefill_tokens, min_size)
            if new:
                self._waiting_tokens, self._must_decode = 1, True
                return Batch(tuple(new))
        self._waiting_tokens += 1
        return Batch(tuple(BatchItem(r.req_id, 1, r.num_computed_tokens) for r in running))

    # ---- queue.rs next_batch ----------------------------------------------------------------------
    def _next_batch(self, state: SchedulerState, now_s: float, prefill_budget: int,
                    min_size: int | None) -> list[BatchItem]:
        """New requests FCFS (rule 2, or rule 3 with ``min_size``), their blocks reserved; [] if none."""
        waiting = state.waiting
        if not waiting or (min_size is not None and len(waiting) < min_size):
            return []
        kv = state.kv
        bs = kv.block_size
        budget = -(-prefill_budget // bs) * bs       # padded to a multiple of the block size
        room = self.max_num_seqs - len(state.running)
        free = kv.num_free_blocks
        prefill_tokens = 0
        taken: list[tuple[Request, list[int], int]] = []     # (request, its cached prefix, tokens this step)
        for r in waiting:
            if len(taken) >= room:
                break
            hit = kv.lookup(r) if kv.caching else []
            total = r.num_prompt_tokens + r.max_output_tokens - 1       # + speculate (0)
            need = kv.num_blocks_for(max(total, r.num_prompt_tokens)) - len(hit)
            if hit:
                need += kv.num_evictable(hit)
            if need > free:                          # block_allocator.allocate failed
                break
            postfix = r.num_prompt_tokens - len(hit) * bs
            if prefill_tokens + postfix > budget:
                chunk = budget - prefill_tokens
                if self.chunking and chunk > 0:
                    taken.append((r, hit, chunk))
                break
            free -= need
            taken.append((r, hit, postfix))
            prefill_tokens += postfix
        if not taken or (min_size is not None and len(taken) < min_size):
            return []
        items = []
        for r, hit, n in taken:
            self._reserve(state, r, hit, n, now_s)
            items.append(BatchItem(r.req_id, n, len(hit) * bs))
        return items

    @staticmethod
    def _reserve(state: SchedulerState, r: Request, hit: list[int], n: int, now_s: float) -> None:
        """Admit ``r`` holding blocks for prompt + max_new_tokens - 1 tokens; with the prefix cache
        only its hit and the ``n`` tokens scheduled now are registered (the rest as scheduled)."""
        kv = state.kv
        cached = len(hit) * kv.block_size
        total = max(r.num_prompt_tokens + r.max_output_tokens - 1, r.num_prompt_tokens)
        if not kv.caching:
            kv.allocate(r, total)
            state.admit(r, now_s)
            return
        if hit:
            kv.touch(r, hit)
        kv.allocate(r, cached + n)                   # registers the tokens scheduled now
        while len(r.block_ids) * kv.block_size < total:
            kv.append_block(r)                       # the rest of the reservation, unregistered
        kv.record_lookup(r, cached)
        state.admit(r, now_s, cached)

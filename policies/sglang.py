"""SGLang: prefill first, under the PrefillAdder's budgets, over a radix prefix cache.

The rules of SGLang 0.5.23 (the PyPI wheel), from ``sglang/srt/managers/
scheduler.py`` (``get_next_batch_to_run``, ``_get_new_batch_prefill_raw``,
``update_running_batch``; with the overlap loop ``event_loop_overlap``,
``_reqs_finishing_inflight``, ``is_disable_overlap_for_batch``),
``scheduler_components/batch_result_processor.py`` (``process_batch_result_prefill``,
``process_batch_result_decode``), ``schedule_policy.py`` (``SchedulePolicy``,
``PrefillAdder``, ``CLIP_MAX_NEW_TOKENS``), ``schedule_batch.py``
(``retract_decode``, ``check_decode_mem``, ``release_req``),
``scheduler_components/new_token_ratio_tracker.py``, ``environ.py`` (the
ratio constants), ``mem_cache/radix_cache.py`` and ``mem_cache/common.py``
(``sim.core.radix``), ``mem_cache/prefill_budget.py`` (``policies.sglang_adder``),
``arg_groups/fields/schedule.py`` and ``arg_groups/memory_hook.py`` (defaults
by GPU memory) and ``mem_cache/kv_cache_configurator.py`` (``resolve_max_num_reqs``):

1. Each iteration first tries a prefill batch; if it gets one it runs it,
   else it decodes the running batch (every running request but the one
   being chunked). With ``enable_mixed_chunk`` the running decodes join the
   prefill batch when their next tokens fit (budgets start short of them).
2. A prefill pass is skipped while the batch is marked full (set when an
   admission ran out of memory or slots; cleared when a request leaves) or
   nothing waits, unless a chunked request is in progress. The request in
   progress takes the next chunk first: the chunk budget, or the memory left
   if less. Then waiting requests, in queue order, each matched in the radix
   cache (at most ``num_tokens - 1`` tokens, whole pages), are admitted by
   ``PrefillAdder`` (``policies.sglang_adder`` gives the budgets) while fewer
   than ``max_running_requests`` run: a request whose uncached tokens exceed
   the chunk budget left becomes the one chunked request.
3. ``new_token_ratio`` starts at min(0.7 x schedule_conservativeness, 1),
   falls by (init - floor) / 600 every decode step to its floor, min(init x
   0.14, 1), after a retraction is set to min(1, (outputs + 20 x n) /
   (max_tokens + 1)) summed over the n requests left, and goes back to its
   start whenever the scheduler is fully idle (``on_idle``).
4. A decode step needs a page for each request whose next token starts one.
   When they do not fit (after evicting), requests are retracted one by one,
   fewest outputs first and among those the longest prompt, until they fit
   (one always stays); each frees its own KV (its checkpointed prefix stays
   in the tree, unlocked), the tree then evicts up to 20 tokens per request
   left, and it goes to the back of the waiting queue, to be prefilled again.
5. ``schedule_policy`` fcfs keeps the queue's order (and every 32nd pass
   refreshes the LRU stamps of the first 128 waiting prompts, the queue's head
   last); lpm sorts it by cached prefix, longest first, deferring a request
   whose short match (<= 32 tokens) shares >= 32 tokens with one ahead of it,
   and falls back to fcfs while more than 128 wait.
6. The KV: the radix pool of ``sim.core.radix`` (token-granular with the
   default ``page_size`` 1), sized from ``mem_fraction_static`` of the device
   memory (weights + KV; activations outside it). A prefilled chunk's tokens
   enter the tree when the step ends, a finished request's prompt and outputs
   when it finishes.

   With ``ignore_eos`` and the cache disabled, admission is SGLang's
   ``add_one_req_ignore_eos`` (``policies.sglang_adder``).

   A request that cannot decode even alone (the chunked request holds the
   rest of the pool) is aborted by SGLang; here it ends cut short.

7. ``enable_overlap`` (SGLang's default: ``disable_overlap_schedule`` false in
   ``arg_groups/fields/schedule.py``; the server args turn it off for PP,
   MPS without MLX and diffusion LLMs, none of them modelled, and for
   speculative decoding on a CPU (rule 8), so it stays on on a CPU too
   otherwise): ``Scheduler.event_loop_overlap``.
   Each batch is chosen while the one before it runs (``pipelined``:
   sim.loop.server), and that one's results are processed after the new one
   is launched (``process_batch_result``, ``SchedulerState.commit_overlap``).
   The pass sees the batch in flight as SGLang does: its requests' tokens count
   for pages and contexts (``kv_committed_len``), and a prefill in flight is
   already merged into the running batch, so it decodes next with a
   placeholder. A request whose token in flight is its last by max_tokens is
   left out of the decode (``_reqs_finishing_inflight``, in
   ``update_running_batch`` and the mixed chunk); if the others then lack a
   page, nothing decodes this pass and nobody is retracted (the results in
   flight free that request). Admission and retraction count the outputs whose
   results are in. One that stops on EOS is not known to: it runs one more
   token, thrown away, and its release keeps that item's KV (its tokens up to
   there enter the tree). A retracted request's token in flight is dropped
   (``is_retracted``). The chunk in flight is checkpointed when the next
   batch is chosen (``stash_chunked_request``), a completed prefill when its
   results are in. ``new_token_ratio`` goes back to its start only with
   nothing in flight (``on_idle``). ``SGLANG_DISABLE_CONSECUTIVE_PREFILL_OVERLAP``
   (``is_disable_overlap_for_batch``, off by default) changes when results
   are processed, not what is chosen. The timing is the pipelined loop's
   (sim.loop.server.pipelined_start_s): a step's host work (the profile's
   host part, ``Profile.host_s``: scheduling and result processing) runs
   beside the device's step before it, which is what the overlap scheduler
   is for.
   ``tests/policies/test_sglang_overlap_differential.py`` runs SGLang's own
   ``event_loop_overlap``, ``update_running_batch`` and
   ``_reqs_finishing_inflight`` against this.

8. ``speculative`` (``sim.core.speculative``'s acceptance model, draft counters and proposer
   pricing; SGLang's ``arg_groups/speculative_hook.py``, ``mem_cache/allocation_sizing.py``,
   ``speculative/eagle_utils.py``, ``speculative/eagle_worker_v2.py``,
   ``scheduler_components/batch_result_processor.py``). ``method`` eagle, eagle3 and mtp are
   SGLang's EAGLE, EAGLE3 and NEXTN (``_resolve_speculative_algorithm_alias`` turns NEXTN into
   EAGLE); ``num_speculative_tokens`` k is ``speculative_num_steps`` with
   ``speculative_eagle_topk`` 1, where ``_handle_eagle_family`` sets
   ``speculative_num_draft_tokens`` to k + 1 (a chain). ``eagle_topk`` above 1 (a tree verified
   with tree attention; SGLang's own pick for Llama when nothing is given is 5 steps x topk 4)
   and NGRAM (its trie drafts a BFS tree, ``speculative_ngram_max_bfs_breadth`` 10 wide,
   ``speculative_num_draft_tokens`` 12) are refused, as is a separate draft model (STANDALONE).
   Unset, ``max_running_requests`` is 48 (``_handle_eagle_family``); the memory defaults are
   resolved before it (``handle_gpu_memory_settings`` runs first), so they stay. SGLang 0.5.23
   keeps its overlap loop with speculation (spec v2: ``eagle_worker_v2``), off only on a CPU
   (``_disable_overlap_schedule_for_cpu``), and so does ``enable_overlap`` here (rule 7).
   ``enable_mixed_chunk`` is refused (SGLang degrades a mixed step's decodes to plain
   one-token decodes). The PrefillAdder is unchanged (no decode reservation
   for drafts: ``_get_running_request_total_token_offset`` is the same; the decodes' extra
   slots are allocated, so not free). A decode step (``eagle_prepare_for_decode``) tops every
   request's own KV up to its committed tokens (``kv_committed_len``: prompt + outputs - 1)
   plus ``get_alloc_reserve_per_decode`` = 2 x max(num_steps x topk, num_draft_tokens) =
   2 (k + 1) slots, page-ceiled (``page_aligned_decode_alloc_lens``); ``check_decode_mem``
   counts those pages (``_new_tokens_required_next_decode_spec_v2``), and retraction (rule 4)
   runs on that count. The step verifies every running request's last token and its k drafts:
   k + 1 query tokens a request (no token budget: decodes never take one), its attention a
   decode's over its context. A verify step accepting a drafts commits a + 1 tokens
   (``kv_committed_len += accept_lens``: the accepted drafts and the bonus, fewer where the
   output ends); the rejected drafts' slots stay allocated, reused by the next step's top-up,
   and the over-allocation is freed with the request (``_release_overallocated_kv_indices``).
   Every prefill that completes a prompt drafts too, so each decode verifies k drafts. Under
   rule 7 the pass sees the batch in flight as spec v2 does: a prefill's tokens are committed
   when it is chosen (``prepare_for_extend``), a verify's only at its results, so a verify is
   chosen over the tokens committed then (the device places it after the accepted ones: its
   context in the batch is that stale count) and the top-up's second k + 1 slots hold it (a
   request whose verify is in flight needs no page more until its results are in); a request
   whose in-flight step yields its last token by length sits out (``_reqs_finishing_inflight``:
   one more output ends it), one that the in-flight verify ends otherwise runs a verify thrown
   away, and its release keeps only its committed tokens
   (``SchedulerState._commit_overlap_speculative``). The
   draft model's passes (``draft_extend`` over the k + 1 verified tokens, then num_steps - 1
   one-token ``draft_forward`` passes) are priced by ``Profile.proposer_s`` as vLLM's
   proposer is, and its layers' weights and KV come out of the pool
   (``sim.run.runner.drafter_share``: SGLang's draft pool shares the target's slot indices).

9. DP attention (``context.data_parallel`` d > 1: ``--tp d x t --dp d --enable-dp-attention``,
   each rank one scheduler and KV pool of ``tensor_parallel`` t GPUs; the lockstep and its
   padding are ``sim.loop.dp``'s, the router ``sglang_dp``). ``_handle_data_parallelism``
   divides ``chunked_prefill_size`` (the memory rule's default or the one given) by d and
   multiplies ``schedule_conservativeness`` by 0.3 (new_token_ratio's start, rule 3); a given
   ``max_running_requests`` is the server's, max(1, it // d) a rank
   (``pool_configurator``'s ``requested_max_running_requests_per_worker``); the memory rules
   read SGLang's TP size, d x t, and DP attention's graph reserve
   (``sglang_defaults``). ``dp_graph_tokens``: the decode CUDA graphs' largest batch, up to
   which a decode-only step pads every rank to the largest (``DpPaddingMode`` MAX_LEN under
   the decode graphs; an extend step gathers each rank's own tokens, SUM_LEN). The overlap
   loop (rule 7) is not modelled with DP ranks: unset, ``enable_overlap`` is off with them
   (``sim.run.runner``), though SGLang runs it.

Not modelled: priorities and priority preemption, hierarchical (host) cache, PP,
LoRA, grammar, the error an aborted request returns; with speculation: trees (topk > 1, NGRAM),
a separate draft model, adaptive num_steps, mixed chunks, the draft extend of prefill chunks
that do not complete their prompt (priced only for the chunk that samples).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, Sequence

from policies.base import PolicyBase, batch_or_idle, config_knobs, knob
from policies.sglang_adder import NO_TOKEN, OTHER, CONTINUE, PrefillAdder
from policies.sglang_defaults import decode_graph_bs, engine_defaults
from policies.sglang_queue import order_waiting
from sim.base.strict import ConfigError
from sim.core.batch import Batch, BatchItem, Idle
from sim.core.policy import EngineKnob, KvMemory, PolicyContext, PrefixSwitch, StretchShape
from sim.core.radix import RadixCachePool, TokenPool
from sim.core.request import Request, Status
from sim.core.speculative import SpeculativeSpec, parse_speculative, refuse_method

if TYPE_CHECKING:
    from sim.core.state import SchedulerState

INIT_NEW_TOKEN_RATIO = 0.7              # SGLANG_INIT_NEW_TOKEN_RATIO
MIN_NEW_TOKEN_RATIO_FACTOR = 0.14       # SGLANG_MIN_NEW_TOKEN_RATIO_FACTOR
NEW_TOKEN_RATIO_DECAY_STEPS = 600       # SGLANG_NEW_TOKEN_RATIO_DECAY_STEPS
RETRACT_DECODE_STEPS = 20               # SGLANG_RETRACT_DECODE_STEPS
# Rule 8: speculative_algorithm for batchsim's methods (NEXTN, SGLang's MTP, resolves to EAGLE in
# _resolve_speculative_algorithm_alias), and the max_running_requests _handle_eagle_family sets
# when none is given.
SPEC_ALGORITHMS = {"eagle": "EAGLE", "eagle3": "EAGLE3", "mtp": "EAGLE"}
SPEC_MAX_RUNNING_REQUESTS = 48


def parse_sglang_speculative(data: Any, src: str = "the workload",
                             where: str = "policy.speculative") -> SpeculativeSpec | None:
    """``policy.speculative`` for SGLang (rule 8): vLLM's spelling (``sim.core.speculative``) with
    SGLang's ``eagle_topk`` (1 only); n-gram and trees refused. None for k = 0 (no speculation)."""
    if isinstance(data, dict) and "eagle_topk" in data:
        data = dict(data)
        topk = data.pop("eagle_topk")
        if not isinstance(topk, int) or isinstance(topk, bool) or topk < 1:
            raise ConfigError(f"{src}: field '{where}.eagle_topk' must be an integer >= 1 (SGLang's "
                              f"speculative_eagle_topk), got {topk!r}")
        if topk > 1:
            raise ConfigError(f"{src}: field '{where}.eagle_topk' is {topk}: SGLang drafts a tree of {topk} "
                              f"branches a step and verifies it with tree attention, which batchsim does not "
                              f"model; use eagle_topk 1 (a chain of num_speculative_tokens drafts)")
    refuse_method(data, "ngram", "sglang: SGLang 0.5.23's NGRAM verifies a tree of speculative_num_draft_tokens "
                  "(default 12) drafts, speculative_ngram_max_bfs_breadth (default 10) wide, and batchsim models "
                  "chains (topk 1) only; use eagle, eagle3 or mtp", src, where)
    spec = parse_speculative(data, src, where)
    return spec if spec.num_speculative_tokens else None


@dataclass(frozen=True, slots=True)
class SglangConfig:
    kind: Literal["sglang"] = "sglang"
    chunked_prefill_size: int | None = knob(None, "most tokens of a prefill batch (chunks); -1: no chunked prefill; "
                                                  "unset: SGLang's default by GPU memory (<20 GiB 2048, <60 GiB "
                                                  "4096, <160 GiB 8192, else 16384; unknown device 4096)", off=-1)
    max_prefill_tokens: int = knob(16384, "prefill tokens one pass admits before it stops (SGLang's default 16384)")
    max_running_requests: int | None = knob(None, "most requests running at once; unset: SGLang's rule from the "
                                                  "pool, min(clamp(pool_tokens / max_model_len x 512, 2048, "
                                                  "4096), pool_tokens // 2), 4096 until the pool is known")
    schedule_policy: str = knob("fcfs", "waiting-queue order: fcfs (default) or lpm (longest cached prefix "
                                        "first; fcfs while more than 128 wait)")
    schedule_conservativeness: float = knob(1.0, "scales new_token_ratio's start, min(0.7 x it, 1) (default 1.0)")
    enable_mixed_chunk: bool = knob(False, "running decodes join chunked prefill batches (default off)")
    disable_radix_cache: bool = knob(False, "no prefix cache (default false: the radix cache is on)")
    page_size: int = knob(1, "KV page in tokens; matches and the tree are whole pages (default 1)")
    mem_fraction_static: float | None = knob(None, "share of GPU memory for weights + KV; unset: SGLang's "
                                                   "(memory - reserve) / memory by GPU memory (0.95 unknown)")
    ignore_eos: bool = knob(False, "clients send ignore_eos (SGLang's benchmarks do unless --disable-ignore-eos): "
                                   "reservations take max_tokens in full (ratio 1)")
    enable_overlap: bool = knob(True, "SGLang's overlap loop: each batch is chosen while the one before it "
                                      "runs, its results seen a step later (rule 7 of the module doc); default "
                                      "on, as SGLang 0.5.23 (disable_overlap_schedule false, on a CPU too)")
    speculative: dict[str, Any] | None = knob(None, "speculative decoding (rule 8 of the module doc): {method: "
                                                    "eagle | eagle3 | mtp, num_speculative_tokens (SGLang's "
                                                    "speculative_num_steps, topk 1), acceptance_length or "
                                                    "acceptance_rates}; unset: none")


class SglangPolicy(PolicyBase):
    # Fast path (sim.loop.stretch): with nothing waiting, or the batch marked full (cleared only when a
    # request leaves), a decode step admits nobody and touches no node of the tree; the pages it
    # grows into come free, or from evicting the LRU's next nodes, as the fast path's append_block
    # takes them. new_token_ratio decays by the decode steps a stretch ran (state.num_steps), one
    # decay at a time as stepping does. stretch_shape declines right after a prefill (its
    # checkpoints are pending) and while requests wait with the batch not marked full.
    # Kernel profiles (profile.kernels) price this engine on SGLang's own kernels (FlashInfer / FA3 attention, its fused MoE), measured per SGLang version.
    kernel_tables = "sglang"
    decode_stretch = True
    # (num_reserved_blocks 0: SGLang's padded slot 0 lies outside the pool's size)
    prefix_switch = PrefixSwitch("disable_radix_cache", on=False)
    pipelined_knob = "enable_overlap"
    dp_router = "sglang_dp"                 # rule 9: DataParallelController's round robin
    dp_pads_prefill = False                 # rule 9: an extend step is not padded (SUM_LEN)
    parse_speculative = staticmethod(parse_sglang_speculative)    # policy_config's check of rule 8's fields
    # A decode instance of disaggregated serving (sim.loop.handoff_sglang.DecodeQueues): its
    # prealloc and transfer queues, run at the start of every pass (process_decode_queue).
    pd_decode: Any = None
    server_knobs = {
        "block_size": EngineKnob("page_size", "SGLang's --page-size, its KV page in tokens"),
        "gpu_memory_utilization": EngineKnob("mem_fraction_static", "SGLang's --mem-fraction-static, the share "
                                                                    "of GPU memory for weights + KV"),
        "watermark": EngineKnob(None, "SGLang keeps no watermark: its PrefillAdder holds back each running "
                                      "request's expected outputs (new_token_ratio)"),
    }

    def __init__(self, config: SglangConfig, context: PolicyContext) -> None:
        if config.schedule_policy not in ("fcfs", "lpm"):
            raise ValueError(f"schedule_policy must be fcfs or lpm (the ones modelled), got {config.schedule_policy!r}")
        if config.chunked_prefill_size is not None and config.chunked_prefill_size <= 0 \
                and config.chunked_prefill_size != -1:
            raise ValueError(f"chunked_prefill_size must be > 0 or -1 (off), got {config.chunked_prefill_size}")
        if config.mem_fraction_static is not None and not 0 < config.mem_fraction_static < 1:
            raise ValueError(f"mem_fraction_static must be in (0, 1), got {config.mem_fraction_static}")
        self.config = config
        self.speculative = (parse_sglang_speculative(config.speculative)
                            if config.speculative is not None else None)
        overlap = config.enable_overlap
        if self.speculative is not None:          # rule 8 of the module doc
            if context.cpu or context.device.lower().startswith("cpu"):
                overlap = False                    # _disable_overlap_schedule_for_cpu
            if config.enable_mixed_chunk:
                raise ValueError("policy.enable_mixed_chunk true with policy.speculative: SGLang turns a mixed step's decodes "
                                 "into plain one-token decodes (and turns mixed chunks off for n-gram), which "
                                 "batchsim does not model; set enable_mixed_chunk: false")
            self.decode_stretch = False            # acceptance draws: every step is its own
        d = context.data_parallel
        chunk, fraction = engine_defaults(context, config.chunked_prefill_size, config.max_prefill_tokens,
                                          config.max_running_requests, d)
        # Rule 9: the decode graphs' largest batch (the servers' max_running_requests caps it)
        self.dp_graph_tokens = decode_graph_bs(context, config.max_running_requests, d) if d > 1 else 0
        self._server_chunk = chunk if chunk > 0 else -1
        if d > 1 and chunk > 0:
            chunk //= d
        self.chunk_size = chunk if chunk > 0 else None
        self.mem_fraction = config.mem_fraction_static or fraction
        self.kv_memory = KvMemory(self.mem_fraction, "static")
        self.block_size = config.page_size
        self.kv_pool_class = TokenPool if config.disable_radix_cache else RadixCachePool
        self.lpm = config.schedule_policy == "lpm" and not config.disable_radix_cache
        self.token_budget = self.chunk_size
        self.max_num_seqs = (max(1, config.max_running_requests // d) if config.max_running_requests
                             else 4096)
        self._pool_rule = config.max_running_requests is None
        # Rule 8: a decode reserves 2 x max(num_steps x topk, num_draft_tokens) = 2 (k + 1) slots past
        # its committed tokens (get_alloc_reserve_per_decode); SGLang sets max_running_requests 48.
        self.spec_reserve = 0
        self._verify: dict[int, int] = {}
        self._flight_verify: frozenset[int] = frozenset()     # rule 8 under rule 7: verify items in flight
        if self.speculative is not None:
            self.spec_reserve = 2 * (self.speculative.num_speculative_tokens + 1)
            if self._pool_rule:
                self.max_num_seqs, self._pool_rule = SPEC_MAX_RUNNING_REQUESTS, False
        conservativeness = config.schedule_conservativeness * (0.3 if d > 1 else 1.0)    # rule 9
        init = min(INIT_NEW_TOKEN_RATIO * conservativeness, 1.0)
        self.init_ratio, self.min_ratio = init, min(init * MIN_NEW_TOKEN_RATIO_FACTOR, 1.0)
        self.ratio_decay = (init - self.min_ratio) / NEW_TOKEN_RATIO_DECAY_STEPS
        self.new_token_ratio = init
        self.chunked: Request | None = None       # the request being prefilled in chunks
        self.batch_is_full = False
        self._num_running = 0                      # len(state.running) after the last pass
        self._prefilled: list[Request] = []        # the last step's prefill items, checkpointed after it
        self._num_refresh_calls = 0                # fcfs's LRU refresh counter
        self._num_steps = 0                        # state.num_steps once our last step commits
        self._waiting: Any = ()                    # the queue we last saw
        if overlap:                                # rule 7 of the module doc
            self.pipelined = self.overlap_loop = True
            self.decode_stretch = False
        # Overlap: the prefills chosen that completed their prompts, (request, tokens), checkpointed
        # once their batch's results are in; the chunked request's chunk in flight, checkpointed
        # (stashed) when the next batch is chosen.
        self._completing: list[tuple[Request, int]] = []
        self._stash: tuple[Request, int] | None = None

    @staticmethod
    def unread_knobs(config: SglangConfig) -> dict[str, str]:
        unread = {}
        if config.disable_radix_cache and config.schedule_policy == "lpm":
            unread["schedule_policy"] = ("with disable_radix_cache: lpm sorts by cached prefix, and nothing is "
                                         "cached, so fcfs runs (as in SGLang)")
        if config.enable_mixed_chunk and config.chunked_prefill_size == -1:
            unread["enable_mixed_chunk"] = "with chunked_prefill_size -1: decodes join chunked prefills only"
        return unread

    def max_request_tokens(self, num_blocks: int, block_size: int) -> int:
        # PrefillAdder.add_one_req admits a request alone on an empty pool only if its prompt +
        # min(max_tokens, CLIP_MAX_NEW_TOKENS) + one page < the pool's tokens; prompt + max_tokens
        # <= pool - page - 1 passes for any split. add_one_req_ignore_eos (ignore_eos, cache off)
        # also ceils the prompt to pages and keeps one token to spare: pool - 2 pages - 1.
        pool = num_blocks * block_size
        if self.config.ignore_eos and self.config.disable_radix_cache:
            return pool - 2 * block_size - 1
        return pool - block_size - 1

    def stretch_shape(self, running: Sequence[Request], live_context: int, num_live: int,
                      prefilling: Request | None) -> StretchShape | None:
        if prefilling is not None or (self._waiting and not self.batch_is_full):
            return None
        if any(r.status == Status.RUNNING for r in self._prefilled):
            return None
        return StretchShape(live_context, num_live, 0)

    def knobs(self) -> dict[str, Any]:
        # Rule 9: the server's arguments (a DP rank runs chunk // d and max_running_requests // d)
        return config_knobs(self.config, chunked_prefill_size=self._server_chunk,
                            max_running_requests=self.config.max_running_requests or self.max_num_seqs,
                            mem_fraction_static=self.mem_fraction,
                            enable_overlap=self.pipelined,
                            speculative=self.config.speculative or {"num_speculative_tokens": 0})

    def schedule(self, state: SchedulerState, now_s: float) -> Batch | Idle:
        kv = state.kv
        if self._pool_rule:                        # resolve_max_num_reqs, once the pool is known
            tokens = kv.capacity_tokens
            self.max_num_seqs = max(1, min(max(min(int(tokens / state.max_model_len * 512), 4096), 2048),
                                           tokens // 2))
            self._pool_rule = False
        if self.pd_decode is not None:
            self.pd_decode.process_decode_queue(state, now_s)
        self._waiting = state.waiting
        if self.pipelined:
            flight = self._overlap_results(state)
        else:
            flight = {}
            for _ in range(state.num_steps - self._num_steps):     # decode steps a stretch ran without us
                if self.new_token_ratio <= self.min_ratio:
                    break
                self.new_token_ratio = max(self.new_token_ratio - self.ratio_decay, self.min_ratio)
            for r in self._prefilled:              # the last prefill's results: its tokens enter the tree
                if r.status == Status.RUNNING:
                    kv.checkpoint(r, r.num_computed_tokens)
            self._prefilled = []
        running = [r for r in state.running if r is not self.chunked]
        if len(state.running) < self._num_running or not running:
            self.batch_is_full = False             # a request left
        if not state.running and not state.waiting and not state.pending:
            self.new_token_ratio = self.init_ratio      # on_idle: the scheduler is fully idle
        items = self._prefill(state, now_s, running, flight)
        if items is None:
            items = self._decode(state, running, now_s, flight)
        self._num_running = len(state.running)
        self._num_steps = state.num_steps + bool(items)
        if self._verify:                           # rule 8: a decode step's verify items
            verify, self._verify = self._verify, {}
            return Batch(tuple(items), verify)
        return batch_or_idle(items)

    def _overlap_results(self, state: SchedulerState) -> dict[int, int]:
        """Rule 7's bookkeeping at the start of a pass: the prefills whose results came in since are
        checkpointed (``process_batch_result_prefill``), then the chunk in flight is stashed
        (``get_next_batch_to_run``). Returns the batch in flight's tokens by request id."""
        kv = state.kv
        if self._completing:
            left = []
            for r, end in self._completing:
                if r.status != Status.RUNNING:
                    continue                       # finished (released into the tree) or retracted
                if r.num_computed_tokens >= end:
                    kv.checkpoint(r, end)
                else:
                    left.append((r, end))          # its batch is still in flight
            self._completing = left
        if self._stash is not None:
            r, end = self._stash
            self._stash = None
            if r.status == Status.RUNNING:
                kv.checkpoint(r, end)
        if not state.pending:
            self._flight_verify = frozenset()
            return {}
        ahead = state.pending[-1]
        self._flight_verify = frozenset(ahead.drafts) if ahead.drafts else frozenset()
        return {it[0]: it[1] for it in ahead.items}

    # ---- prefill ----------------------------------------------------------------------------------
    def _prefill(self, state: SchedulerState, now_s: float, running: list[Request],
                 flight: dict[int, int]) -> list[BatchItem] | None:
        kv, waiting = state.kv, state.waiting
        if (self.batch_is_full or not waiting) and self.chunked is None:
            return None
        slots = self.max_num_seqs - len(running)
        if slots <= 0 and self.chunked is None:
            self.batch_is_full = True
            return None
        self._num_refresh_calls = order_waiting(kv, waiting, self.lpm, self._num_refresh_calls)
        mixed = len(running) if self.config.enable_mixed_chunk and self.chunk_size else 0
        adder = PrefillAdder(kv, running, self.new_token_ratio, self.config.max_prefill_tokens, self.chunk_size,
                             mixed, self.config.ignore_eos)
        if self.chunked is not None:
            r = self.chunked
            self.chunked = adder.add_chunked_req(r, r.num_computed_tokens + flight.get(r.req_id, 0))
        for r in list(waiting):
            if adder.budget_state() == OTHER:
                break
            if len(adder.admitted) >= slots:
                self.batch_is_full = True
            if self.batch_is_full:
                break
            if self.config.ignore_eos and not kv.enabled:
                res = adder.add_one_req_ignore_eos(r)
            else:
                prefix, node = kv.match(r, r.num_prompt_tokens + r.num_output_tokens - 1)
                res = adder.add_one_req(r, prefix, node)
            if res != CONTINUE:
                if res == NO_TOKEN:
                    self.batch_is_full = bool(adder.admitted) or bool(running)
                break
        if not adder.admitted:
            return None
        if adder.new_chunked is not None:
            self.chunked = adder.new_chunked
        items = []
        for r, prefix, n, node in adder.admitted:
            if node is not None:                   # a new admission: it takes its hit
                kv.hold(r, prefix, node, locked=True)     # the adder took its lock
                state.admit(r, now_s, prefix)
                kv.record_lookup(r, prefix)
            items.append(BatchItem(r.req_id, n, prefix))
        # prepare_for_extend: one allocation for the batch, evicting its shortfall at once
        need = sum(kv.num_blocks_for(it.context_len + it.num_new_tokens) - len(state.requests[it.req_id].block_ids)
                   for it in items)
        kv.evict(need * kv.block_size)
        for it in items:
            kv.allocate(state.requests[it.req_id], it.context_len + it.num_new_tokens)
        if self.pipelined:
            for it in items:
                r = state.requests[it.req_id]
                if r is self.chunked:
                    self._stash = (r, it.context_len + it.num_new_tokens)
                else:
                    self._completing.append((r, it.context_len + it.num_new_tokens))
        else:
            self._prefilled = [r for r, *_ in adder.admitted]
        if mixed:
            if flight:                             # _reqs_finishing_inflight leave the mixed decodes
                decoding = [r for r in running if not self._finishes_inflight(r, flight)]
                if len(decoding) < len(running):
                    self.batch_is_full = False
            else:
                decoding = running
            if decoding and self._decode_fits(kv, decoding, flight):
                items += self._decode_items(kv, decoding, flight)
        return items

    # ---- decode -----------------------------------------------------------------------------------
    @staticmethod
    def _finishes_inflight(r: Request, flight: dict[int, int]) -> bool:
        """``_reqs_finishing_inflight``: the batch in flight holds ``r`` and the token it samples
        is ``r``'s last by max_tokens (``next_output_finishes_by_length``, on the outputs whose
        results are in)."""
        return r.req_id in flight and r.num_output_tokens + 1 >= r.max_output_tokens

    @staticmethod
    def _decode_fits(kv: RadixCachePool, reqs: list[Request], flight: dict[int, int]) -> bool:
        """check_decode_mem: a page for each request whose next token starts one, after evicting
        (its tokens counted with those of the batch in flight: ``kv_committed_len``)."""
        bs = kv.block_size
        if flight:
            get = flight.get
            need = sum(1 for r in reqs if not (r.num_computed_tokens + get(r.req_id, 0)) % bs) * bs
        else:
            need = sum(1 for r in reqs if not r.num_computed_tokens % bs) * bs
        kv.evict(need)
        return kv.num_free_tokens >= need

    @staticmethod
    def _decode_items(kv: RadixCachePool, reqs: list[Request], flight: dict[int, int]) -> list[BatchItem]:
        items = []
        get = flight.get
        for r in reqs:
            computed = r.num_computed_tokens + get(r.req_id, 0)    # after the batch in flight's token
            kv.allocate(r, computed + 1)
            items.append(BatchItem(r.req_id, 1, computed))
        return items

    def _committed(self, r: Request, flight: dict[int, int]) -> int:
        """Rule 8's ``kv_committed_len``: the tokens whose results are in, and a prefill's in flight
        (``prepare_for_extend`` commits them when it is chosen; a verify commits at its results)."""
        if flight and r.req_id not in self._flight_verify:
            return r.num_computed_tokens + flight.get(r.req_id, 0)
        return r.num_computed_tokens

    def _spec_decode_fits(self, kv: RadixCachePool, reqs: list[Request], flight: dict[int, int]) -> bool:
        """Rule 8's check_decode_mem (``_new_tokens_required_next_decode_spec_v2``): the pages that
        bring each request's own up to its committed tokens + ``spec_reserve``, after evicting."""
        bs, reserve = kv.block_size, self.spec_reserve
        need = 0
        for r in reqs:
            pages = -(-(self._committed(r, flight) + reserve) // bs) - len(r.block_ids)
            if pages > 0:
                need += pages
        need *= bs
        kv.evict(need)
        return kv.num_free_tokens >= need

    def _spec_decode_items(self, state: SchedulerState, reqs: list[Request],
                           flight: dict[int, int]) -> list[BatchItem]:
        """Rule 8's ``eagle_prepare_for_decode``: each request's pages topped up to committed +
        ``spec_reserve``; a verify item of its last token and its k drafts."""
        kv = state.kv
        k = self.speculative.num_speculative_tokens
        reserve = self.spec_reserve
        drafts = state.speculation.drafts if state.speculation is not None else {}
        items = []
        for r in reqs:
            computed = self._committed(r, flight)
            kv.allocate(r, computed + reserve)
            items.append(BatchItem(r.req_id, 1 + k, computed))
            self._verify[r.req_id] = k
            drafts.pop(r.req_id, None)
        return items

    def _fits(self, kv: RadixCachePool, reqs: list[Request], flight: dict[int, int]) -> bool:
        if self.spec_reserve:
            return self._spec_decode_fits(kv, reqs, flight)
        return self._decode_fits(kv, reqs, flight)

    def _items(self, state: SchedulerState, reqs: list[Request], flight: dict[int, int]) -> list[BatchItem]:
        if self.spec_reserve:
            return self._spec_decode_items(state, reqs, flight)
        return self._decode_items(state.kv, reqs, flight)

    def _decode(self, state: SchedulerState, running: list[Request], now_s: float,
                flight: dict[int, int]) -> list[BatchItem]:
        if flight:                                 # update_running_batch's finishing-in-flight filter
            finishing = [r for r in running if self._finishes_inflight(r, flight)]
            if finishing:
                running = [r for r in running if r not in finishing]
                self.batch_is_full = False         # the batch shrank
        else:
            finishing = []
        if not running:
            return []
        kv = state.kv
        if self._fits(kv, running, flight):
            self.new_token_ratio = max(self.new_token_ratio - self.ratio_decay, self.min_ratio)
            return self._items(state, running, flight)
        if finishing:
            # the results in flight free the finishing requests' KV: no decode this pass, no retraction
            return []
        # retract_decode: keep-order, most preferred first; the last is retracted first
        keep = sorted(running, key=lambda r: (r.num_output_tokens, -r.num_prompt_tokens), reverse=True)
        first = True
        while first or not self._fits(kv, keep, flight):
            if len(keep) == 1:
                break
            first = False
            r = keep.pop()
            state.preempt(r)                        # its own KV freed, its prefix unlocked
            kv.evict(len(keep) * RETRACT_DECODE_STEPS)
            state.waiting.popleft()                 # preempt queued it at the front; SGLang appends it
            state.waiting.append(r)
        if len(keep) == 1 and not self._fits(kv, keep, flight):
            # even alone it does not fit (the chunked request holds the rest): SGLang aborts it; here
            # it ends with the tokens it has (cut short)
            last = keep.pop()
            state.preempt(last)
            state.cut_short(last, now_s)
        outputs = sum(r.num_output_tokens for r in keep)
        max_tokens = sum(r.max_output_tokens for r in keep)
        self.new_token_ratio = min(1.0, (outputs + RETRACT_DECODE_STEPS * len(keep)) / (max_tokens + 1))
        self.batch_is_full = False
        return self._items(state, keep, flight)

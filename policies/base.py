"""The base every policy builds on (``PolicyBase``: the contract's safe
defaults) and the helpers that several policies share.

The contract itself (``Policy``, ``PolicyContext``, ``StretchShape``) lives in
``sim.core.policy``; policies import only ``sim.base`` and ``sim.core``.
"""

from __future__ import annotations

from dataclasses import field, fields
from typing import TYPE_CHECKING, Any, Mapping, NamedTuple, Sequence

from sim.core.batch import Batch, BatchItem, Idle
from sim.core.kv import BlockManager
from sim.core.policy import EngineKnob, KvMemory, PrefixSwitch, StretchShape
from sim.core.request import Request, Status

if TYPE_CHECKING:
    from sim.core.state import SchedulerState


# The ``reserve`` knob of the policies that reserve at admission (``admit_reserved``): the one list.
RESERVE_MODES: tuple[str, ...] = ("max_tokens", "max", "pow2", "oracle")
RESERVE_DOC = ("KV reserved per request at admission: max_tokens (prompt + max_tokens; our default), max "
               "(max_model_len), pow2 or oracle (the true output; the vLLM paper's Orca variants)")


def knob(default: Any, doc: str, *, off: Any = None, below: float | None = None,
         choices: Sequence[str] | None = None) -> Any:
    """A config field with its one-line doc, which says where the default comes from
    (``policies.knob_docs`` shows it in ``sim run --help``). A number must be > 0 (>= 0
    when its default is 0, which means "off"); ``off``: another value that means
    "off" (SGLang's -1); ``below``: it must also be smaller than this;
    ``choices``: the strings it may take. ``policies.config.policy_config`` checks
    them all, for every policy alike."""
    meta: dict[str, Any] = {"doc": doc}
    if off is not None:
        meta["off"] = off
    if below is not None:
        meta["below"] = below
    if choices is not None:
        meta["choices"] = tuple(choices)
    return field(default=default, metadata=meta)


NO_WATERMARK = "it keeps no block-manager watermark"


class PolicyBase:
    """The safe default of every declaration of ``sim.core.policy.Policy``: a
    policy subclasses it and declares only what differs (as SimPy's
    ``PriorityResource`` overrides only what differs from ``Resource``). The
    one declaration without a default is ``max_num_seqs``: every policy sets
    it. A policy keeps its config as ``self.config`` (``knobs`` reads it).

    Safe means: without a declaration the policy is stepped every iteration
    (no fast path), runs on a plain paged pool of ``server.block_size``
    blocks sized by vLLM's rule, refuses nothing at arrival but what the
    context or the pool can never hold, and has no prefix cache.
    """

    token_budget: int | None = None         # no budget: the activation reserve of DEFAULT_ACTIVATION_TOKENS
    max_num_seqs: int
    holds_batch = False
    max_prompt_tokens: int | None = None
    refuses_by_prompt = False
    clamps_max_tokens = False               # prompt + max_tokens > max_model_len is refused
    num_reserved_blocks = 0
    decode_stretch = False                  # step every iteration
    chunk_stretch = False
    pipelined = False                       # a step is chosen after the one before it committed
    overlap_loop = False                    # with pipelined: vLLM's commit (commit_pipelined), not SGLang's
    pipelined_knob: str | None = None       # the config knob that turns the pipelined loop off
    pipelined_off: Any = False               # the value of pipelined_knob that turns it off (TensorRT-LLM's
    #                                         disable_overlap_scheduler says it the other way round: True)
    kv_pool_class: type = BlockManager
    block_size: int | None = None           # server.block_size
    kv_memory: KvMemory | None = None       # vLLM's rule: server.gpu_memory_utilization
    prefix_switch: PrefixSwitch | None = None
    full_batch_knob: str | None = None
    always_chunks = False
    chunked_variant: str | None = None
    # Whose measured kernel tables price this policy's steps under profile.kernels (sim.cost.kernels):
    # vLLM's, the most complete set, for every engine whose kernels the tables do not hold apart
    # (the research policies run vLLM-style paged attention; TGI and LMDeploy run the same
    # FlashAttention / FlashInfer and cuBLAS class of kernels); SGLang and TensorRT-LLM say theirs.
    kernel_tables = "vllm"
    dp_router: str | None = None            # data parallelism not modelled (refused)
    dp_pads_prefill = True
    dp_graph_tokens: int | None = None
    # server.watermark is vLLM v0's block-manager watermark: a policy reads it only by asking for it
    # (can_allocate(use_watermark=True), refuses_by_prompt), so by default it is refused, not dropped.
    server_knobs: Mapping[str, EngineKnob] = {"watermark": EngineKnob(None, NO_WATERMARK)}
    config: Any

    def knobs(self) -> dict[str, Any]:
        return config_knobs(self.config)

    def max_request_tokens(self, num_blocks: int, block_size: int) -> int:
        return num_blocks * block_size      # the whole pool, as vLLM's start-up check counts it

    @staticmethod
    def unread_knobs(config: Any) -> Mapping[str, str]:
        return {}                           # every knob is read, whatever the others say

    def stretch_shape(self, running: Sequence[Request], live_context: int, num_live: int,
                      prefilling: Request | None) -> StretchShape | None:
        return None                         # nothing repeats (read only with decode_stretch)


def config_knobs(config: Any, **resolved: Any) -> dict[str, Any]:
    """Every field of ``config`` in declaration order, with ``resolved`` (the
    values a policy filled in for defaults) in place of the config's own."""
    knobs = {f.name: getattr(config, f.name) for f in fields(config)}
    assert resolved.keys() <= knobs.keys(), f"not fields of {type(config).__name__}: {resolved.keys() - knobs.keys()}"
    knobs.update(resolved)
    return knobs


class DecodePlan(NamedTuple):
    items: list[BatchItem]        # one-token items, oldest request first
    context: int                  # sum of their context_len (the batch shape needs it)
    prefilling: list[Request]     # running requests still prefilling, oldest first


def schedule_decodes(state: SchedulerState) -> DecodePlan:
    """Give every running request that is decoding a KV slot for its next
    token and a one-token item, preempting the newest running requests
    (recompute) when the pool runs dry, as vLLM does.

    A victim is always taken from the tail of ``running``, which the pass has
    not reached yet (or is the request itself), so one pass suffices. The
    common case (no preemption) runs as a plain for loop: this is the
    simulator's hottest path.
    """
    kv = state.kv
    block_size = kv.block_size
    running = state.running
    items: list[BatchItem] = []
    prefilling: list[Request] = []
    append = items.append
    new_item = tuple.__new__          # BatchItem(...) without the NamedTuple call overhead
    context = 0
    start = len(running)
    for i, r in enumerate(running):
        computed = r.num_computed_tokens
        if r.num_prompt_tokens + r.num_output_tokens - computed != 1:
            prefilling.append(r)
            continue
        if computed >= len(r.block_ids) * block_size and not kv.append_block(r):
            start = i                                      # pool dry: slow path from here on
            break
        append(new_item(BatchItem, (r.req_id, 1, computed, 0)))
        context += computed
    i = start
    while i < len(running):                                # only after the pool ran dry
        r = running[i]
        computed = r.num_computed_tokens
        if r.num_prompt_tokens + r.num_output_tokens - computed != 1:
            prefilling.append(r)
            i += 1
            continue
        if computed >= len(r.block_ids) * block_size:
            while not kv.can_allocate(r, computed + 1):
                victim = running[-1]
                state.preempt(victim)                      # newest first; may be r itself
                if victim is r:
                    break
            else:
                kv.allocate(r, computed + 1)
            if r.status != Status.RUNNING:
                break
        append(new_item(BatchItem, (r.req_id, 1, computed, 0)))
        context += computed
        i += 1
    return DecodePlan(items, context, prefilling)


def decode_items(running: list[Request]) -> list[BatchItem]:
    """One-token items for running requests that have caught up (reserved
    memory: no slot to find)."""
    new_item = tuple.__new__
    return [new_item(BatchItem, (r.req_id, 1, r.num_computed_tokens, 0))
            for r in running if r.num_prompt_tokens + r.num_output_tokens - r.num_computed_tokens == 1]


def admit_reserved(state: SchedulerState, now_s: float, reserve: str,
                   max_requests: int) -> list[Request]:
    """Admit waiting requests FCFS while their full reservation fits.

    Used by the max-length allocators (static, dynamic, Orca): all blocks a
    request may need are taken at admission, so it is never preempted. Only
    the explicit oracle variants (``oracle``, ``pow2``) read the true length.
    """
    admitted: list[Request] = []
    kv = state.kv
    while state.waiting and len(admitted) < max_requests:
        r = state.waiting[0]
        oracle = reserve in ("oracle", "pow2")
        true_out = state.oracle_output_tokens(r) if oracle else r.max_output_tokens
        tokens = reservation_tokens(reserve, r.num_prompt_tokens, r.max_output_tokens,
                                    true_out, state.max_model_len)
        tokens = max(tokens, r.num_prompt_tokens + 1)
        if not kv.can_allocate(r, tokens):
            break
        kv.allocate(r, tokens)
        state.admit(r, now_s)
        admitted.append(r)
    return admitted


def plain_stretch_shape(policy: Any, running: Sequence[Request], live_context: int, num_live: int,
                        prefilling: Request | None) -> StretchShape | None:
    """``Policy.stretch_shape`` of a policy whose decodes attend over their own
    contexts and that has no case (c): each live request one token further
    on, so the summed context grows by their number. A policy takes it as
    its method (``stretch_shape = plain_stretch_shape``): it runs once per
    stretch, on the simulator's hottest path."""
    if prefilling is not None:
        return None
    return tuple.__new__(StretchShape, (live_context, num_live, 0))    # StretchShape(...) without its __new__


def batch_or_idle(items: list[BatchItem]) -> Batch | Idle:
    return Batch(tuple(items)) if items else Idle()


def reservation_tokens(
    mode: str, num_prompt_tokens: int, max_output_tokens: int, true_output_tokens: int,
    max_model_len: int,
) -> int:
    """Tokens a max-length allocator reserves for one request.

    The vLLM paper's Orca variants (section 6.1): ``oracle`` knows the true
    output length; ``pow2`` over-reserves the true total length to the next
    power of two (at most 2x); ``max`` always reserves the maximum sequence
    length. ``max_tokens`` (the default) reserves prompt + the client's
    ``max_tokens``, which is what a server that honours ``max_tokens`` must do.

    pow2 rounds the *output* up, not the total (the paper: "if the true output
    length is 25, it reserves 32 positions for outputs"): prompt 100 with 5
    outputs reserves 100 + 8 = 108 tokens, prompt 40 with 25 outputs 40 + 32 = 72.
    """
    if mode == "max_tokens":
        tokens = num_prompt_tokens + max_output_tokens
    elif mode == "oracle":
        tokens = num_prompt_tokens + true_output_tokens
    elif mode == "pow2":
        tokens = num_prompt_tokens + (1 << (true_output_tokens - 1).bit_length())
    elif mode == "max":
        tokens = max_model_len
    else:
        raise ValueError(f"reserve must be one of {RESERVE_MODES}, got {mode!r}")
    return min(tokens, max_model_len)

"""The policy interface and the helpers that several policies share.

A policy is pure scheduling logic: ``schedule(state, now_s) -> Batch | Idle``.
It never sleeps, reads no clock of its own and imports neither SimPy nor
torch. It may admit and preempt requests and grow their block tables through
``state`` (that is how nano-vllm and vLLM schedule too); ``state.commit``
does all token accounting after the step.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any, Mapping, NamedTuple, Protocol

from sim.batch import Batch, BatchItem, Idle
from sim.kv import reservation_tokens
from sim.request import Request, Status

if TYPE_CHECKING:
    from sim.state import SchedulerState


@dataclass(frozen=True, slots=True)
class PolicyContext:
    """What an engine's defaults depend on besides the policy's own config:
    the model's context length and the device (and, for a profile measured on
    a serving engine, that engine's knobs) from the run's profile.

    Without a profile the device is unknown (``memory_bytes_per_gpu`` 0), and
    an engine picks its defaults for the smallest devices it distinguishes.
    """

    max_model_len: int
    device: str = "unknown"                                    # the profile's device name
    memory_bytes_per_gpu: int = 0                              # 0: unknown
    world_size: int = 1                                        # tensor-parallel ranks
    engine: Mapping[str, Any] = field(default_factory=dict)    # the measured server's knobs (Profile.engine)


class Policy(Protocol):
    """Chooses the work of the next iteration, and declares what the rest of
    batchsim needs to know about it (readers never guess knob names).

    Built as ``PolicyClass(config, context)``; raises ValueError for a config
    the engine would refuse at start-up.

    schedule(state, now_s): return the Batch to run now, or Idle when nothing
    can run (Idle.wake_at_s asks to be called again at that simulated/wall
    time even if no request arrives). Raises nothing on normal input.

    knobs(): every config field, in declaration order, with the value that
    runs (defaults filled in), as a result records it.

    ``decode_stretch``: True if the policy keeps the invariant of the loop's
    fast path (``sim.stretch``, cases (a) and (b)): with nothing waiting and
    every running request caught up it decodes them all; after a decode-only
    step that admitted, preempted and finished nobody it returns the same
    requests again, one token further on; both until something arrives,
    finishes or fails to get a block. Say why beside the flag; False steps
    every iteration.

    ``chunk_stretch``: True if the policy also keeps case (c) of
    ``sim.stretch``: with one running request prefilling and every other one
    caught up, it decodes them all and gives the prefilling request a chunk of
    the rest of the token budget (the budget full, nobody admitted), step
    after step, until the chunk that completes the prompt. Say why beside
    the flag.
    """

    token_budget: int | None       # most tokens one step computes; sizes the activation reserve as vLLM's
    #                                profiling run does (None: no budget, ``DEFAULT_ACTIVATION_TOKENS``)
    max_num_seqs: int              # most requests running at once
    holds_batch: bool              # True: a batch runs to completion and nobody joins it (static, dynamic),
    #                                its rows padded (policies.static.group_step: decodes attend over the
    #                                padded length, which the fast path follows):
    #                                while any request runs, schedule() steps the running group, whatever waits
    max_prompt_tokens: int | None  # longer prompts are refused at arrival (None: only the context limits)
    refuses_by_prompt: bool        # True: refused at arrival for the pool (kv_pool) only if the prompt's blocks
    #                                exceed it above the watermark (vLLM v0's AllocStatus.NEVER); a recompute
    #                                that outgrows it later is cut short (SchedulerState.cut_short). False: if
    #                                prompt + max_tokens exceeds the whole pool (reserved at admission, or
    #                                vllm_v1, which keeps no watermark back from a lone request)
    decode_stretch: bool
    chunk_stretch: bool

    def knobs(self) -> dict[str, Any]: ...

    def schedule(self, state: SchedulerState, now_s: float) -> Batch | Idle: ...


# The ``reserve`` knob of the policies that reserve at admission (``admit_reserved``).
RESERVE_DOC = ("KV reserved per request at admission: max_tokens (prompt + max_tokens; our default), max "
               "(max_model_len), pow2 or oracle (the true output; the vLLM paper's Orca variants)")


def knob(default: Any, doc: str) -> Any:
    """A config field with its one-line doc, which says where the default comes from
    (``policies.knob_docs`` shows it in ``sim run --help``)."""
    return field(default=default, metadata={"doc": doc})


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


def batch_or_idle(items: list[BatchItem]) -> Batch | Idle:
    return Batch(tuple(items)) if items else Idle()

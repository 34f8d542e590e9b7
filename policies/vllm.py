"""vLLM (v0, chunked prefill off): iteration-level, prefill-first.

If waiting requests fit, the iteration is prefill-only: admit FCFS while the
running count stays within ``max_num_seqs``, the prompts' tokens within
``max_num_batched_tokens`` and their blocks within the pool minus the
watermark. Otherwise the iteration is decode-only: every running request gets
a slot for its next token, and when the pool runs dry the newest running
request is preempted (recompute). Prefills and decodes never mix.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from policies.base import PolicyBase, config_knobs, knob, plain_stretch_shape, schedule_decodes
from sim.core.batch import Batch, BatchItem, Idle
from sim.core.policy import PolicyContext

if TYPE_CHECKING:
    from sim.core.state import SchedulerState


@dataclass(frozen=True, slots=True)
class VllmConfig:
    kind: Literal["vllm"] = "vllm"
    max_num_seqs: int = knob(256, "most requests running at once (256: vLLM v0's EngineArgs default)")
    max_num_batched_tokens: int | None = knob(None, "most tokens per step; unset: max(max_model_len, 2048), vLLM "
                                                    "v0's default without chunked prefill")


def check_budget(max_num_batched_tokens: int, max_num_seqs: int) -> None:
    """vLLM's start-up check: every running sequence must fit one token in a step."""
    if max_num_batched_tokens < max_num_seqs:
        raise ValueError(f"max_num_batched_tokens ({max_num_batched_tokens}) must be >= max_num_seqs "
                         f"({max_num_seqs}), as vLLM requires")


def admit_prefills(state: SchedulerState, now_s: float, max_num_seqs: int,
                   token_budget: int, *, chunked: bool) -> list[BatchItem]:
    """Admit waiting requests FCFS into a prefill, within the token budget,
    the sequence limit and the pool minus the watermark. With ``chunked`` the
    last one admitted may get only part of its prompt (a chunk).

    As vLLM v0's block manager (``can_allocate`` / ``allocate``) and
    Sarathi-Serve do, a request is admitted only if the blocks of its whole
    prompt (plus, after a preemption, the outputs it recomputes) fit above
    the watermark, and all of them are allocated at once: a partly
    prefilled request never waits for memory.

    A request that needs more blocks than the pool holds above the watermark
    (one recomputing its outputs after a preemption: its prompt alone fits,
    or it was refused at arrival) can never be admitted: it is cut short
    (``SchedulerState.cut_short``), vLLM v0's FINISHED_IGNORED."""
    kv = state.kv
    most_blocks = kv.num_blocks - kv.watermark_blocks
    items: list[BatchItem] = []
    while state.waiting and len(state.running) < max_num_seqs and token_budget > 0:
        r = state.waiting[0]
        if kv.num_blocks_for(r.num_tokens) > most_blocks:
            state.cut_short(r, now_s)
            continue
        n = r.num_uncomputed_tokens
        if n > token_budget:
            if not chunked and items:
                break
            n = token_budget if chunked else n     # unchunked: a lone long prompt still runs
        if not kv.can_allocate(r, r.num_tokens, use_watermark=True):
            break
        kv.allocate(r, r.num_tokens)
        state.admit(r, now_s)
        items.append(BatchItem(r.req_id, n, r.num_computed_tokens))
        token_budget -= n
    return items


class VllmPolicy(PolicyBase):
    # Fast path (sim.loop.stretch): a decode-only step means admission failed for want of sequence
    # slots or free blocks above the watermark; slots stay, free blocks only shrink while decoding.
    decode_stretch = True
    # vLLM v0's block manager refuses a request for good (AllocStatus.NEVER) only when the blocks
    # of what it must compute now, its prompt, exceed the pool above the watermark.
    refuses_by_prompt = True
    chunked_variant = "sarathi"    # vLLM v0 with enable_chunked_prefill: Sarathi-Serve's scheduler
    server_knobs = {}              # every server field, the watermark too: it is vLLM v0's

    def __init__(self, config: VllmConfig, context: PolicyContext) -> None:
        self.config = config
        max_model_len = context.max_model_len
        self.token_budget = config.max_num_batched_tokens or max(max_model_len, 2048)
        self.max_num_seqs = config.max_num_seqs
        # vLLM v0's start-up checks (SchedulerConfig._verify_args).
        if self.token_budget < max_model_len:
            raise ValueError(f"max_num_batched_tokens ({self.token_budget}) is smaller than max_model_len "
                             f"({max_model_len}): vLLM without chunked prefill refuses this; raise "
                             f"policy.max_num_batched_tokens or lower server.max_model_len")
        check_budget(self.token_budget, config.max_num_seqs)
        # vLLM v0 ignores prompts longer than min(max_model_len, max_num_batched_tokens).
        self.max_prompt_tokens: int | None = self.token_budget

    stretch_shape = plain_stretch_shape          # its decodes attend over their own contexts; no case (c)

    def knobs(self) -> dict[str, Any]:
        return config_knobs(self.config, max_num_batched_tokens=self.token_budget)

    def schedule(self, state: SchedulerState, now_s: float) -> Batch | Idle:
        if state.waiting:
            items = admit_prefills(state, now_s, self.config.max_num_seqs,
                                   self.token_budget, chunked=False)
            if items:
                return Batch(tuple(items))
        plan = schedule_decodes(state)
        if plan.items:
            return Batch.of_decodes(plan.items, plan.context)
        # A lone request preempted itself (it outgrew the pool): as vLLM's next step, admit it
        # again, or cut it short, at once, not when something next arrives. On a prefill instance
        # whose blocks are held for the decode side to read (state.held), admission waits for a
        # release instead: the handoff wakes the server when it frees them.
        if state.waiting and not state.running and not state.held:
            return Idle(now_s)
        return Idle()

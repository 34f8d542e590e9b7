"""Sarathi-Serve: iteration-level, decode-first, stall-free chunked prefill.

Each iteration has a token budget (``max_num_batched_tokens``). Every running
decode gets its token first (no decode ever stalls behind a prefill); the
remaining budget goes to prefill chunks, partially prefilled requests first,
then new requests FCFS while fewer than ``max_num_seqs`` run. Paged memory:
a request's whole prompt is allocated when it is admitted (Sarathi-Serve and
vLLM v0 with chunked prefill), so a partly prefilled request never stalls
for memory; decodes grow one block at a time and preempt the newest running
request by recompute, as in vLLM.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, Sequence

from policies.base import PolicyBase, knob, schedule_decodes
from policies.vllm import admit_prefills, check_budget
from sim.core.batch import Batch, BatchItem, Idle
from sim.core.policy import PolicyContext, StretchShape
from sim.core.request import Request, Status

if TYPE_CHECKING:
    from sim.core.state import SchedulerState


@dataclass(frozen=True, slots=True)
class SarathiConfig:
    kind: Literal["sarathi"] = "sarathi"
    max_num_seqs: int = knob(256, "most requests running at once (256: vLLM v0's EngineArgs default)")
    max_num_batched_tokens: int = knob(512, "most tokens per step (512: vLLM v0's default with chunked prefill)")


class SarathiPolicy(PolicyBase):
    # Fast path (sim.loop.stretch): with nothing prefilling, a decode-only step means admission failed
    # for want of slots, budget left after the decodes or free blocks; none of them grows while
    # the same requests decode.
    decode_stretch = True
    # Case (c): with one request prefilling and every other decoding, the decodes take their
    # tokens first and a chunk of at least the rest of the budget fills it, so nothing is admitted
    # and the same shape repeats, the chunk moving on, until the chunk that ends the prompt.
    chunk_stretch = True
    refuses_by_prompt = True           # as vllm: Sarathi-Serve's and vLLM v0's can_allocate
    always_chunks = True
    server_knobs = {}                  # every server field, the watermark too (admit_prefills asks for it)

    def __init__(self, config: SarathiConfig, context: PolicyContext) -> None:
        self.config = config
        self.token_budget: int | None = config.max_num_batched_tokens
        self.max_num_seqs = config.max_num_seqs
        check_budget(config.max_num_batched_tokens, config.max_num_seqs)

    def stretch_shape(self, running: Sequence[Request], live_context: int, num_live: int,
                      prefilling: Request | None) -> StretchShape | None:
        """Case (c) of ``sim.loop.stretch``: the decodes take their tokens first and
        the prefilling request the rest of the budget, a chunk of at least two
        tokens (one would be a decode in its Batch) beside at least one decode."""
        if prefilling is None:
            chunk = 0
        else:
            num_decodes = len(running) - 1
            chunk = self.config.max_num_batched_tokens - num_decodes
            if not num_decodes or chunk < 2:
                return None
        return tuple.__new__(StretchShape, (live_context, num_live, chunk))    # StretchShape(...), faster

    def schedule(self, state: SchedulerState, now_s: float) -> Batch | Idle:
        plan = schedule_decodes(state)
        items: list[BatchItem] = []            # prefill chunks, after the decodes
        budget = self.config.max_num_batched_tokens - len(plan.items)
        # Partially prefilled (or recomputing) running requests continue
        # first; their blocks were all allocated at admission.
        for r in plan.prefilling:
            if budget <= 0:
                break
            if r.status != Status.RUNNING:      # preempted above to make room
                continue
            n = min(r.num_uncomputed_tokens, budget)
            items.append(BatchItem(r.req_id, n, r.num_computed_tokens))
            budget -= n
        if budget > 0 and state.waiting:
            items += admit_prefills(state, now_s, self.config.max_num_seqs, budget, chunked=True)
        if not items and not plan.items:
            return Idle()
        return Batch.of_decodes(plan.items, plan.context, items)

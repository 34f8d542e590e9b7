"""Orca: iteration-level scheduling with selective batching.

Every iteration, each running request computes its next token; a finished
request leaves and waiting requests join in FCFS order while fewer than
``max_batch_size`` run and their *reservation* fits: a joining request's whole
prompt runs in the same iteration as the others' decodes (hybrid batches).
Memory is reserved at admission (prompt + max_tokens by default; ``reserve``
selects the vLLM paper's Orca variants max / pow2 / oracle), so Orca never
preempts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from policies.base import (RESERVE_DOC, RESERVE_MODES, PolicyBase, admit_reserved, batch_or_idle, decode_items,
                           knob, plain_stretch_shape)
from sim.core.batch import Batch, BatchItem, Idle
from sim.core.policy import PolicyContext

if TYPE_CHECKING:
    from sim.core.state import SchedulerState


@dataclass(frozen=True, slots=True)
class OrcaConfig:
    kind: Literal["orca"] = "orca"
    max_batch_size: int = knob(256, "most requests running at once (256: vLLM's max_num_seqs default, for "
                                    "comparison)")
    reserve: str = knob("max_tokens", RESERVE_DOC, choices=RESERVE_MODES)


class OrcaPolicy(PolicyBase):
    # Fast path (sim.loop.stretch): decodes use reserved blocks, so the free pool and the free slots
    # that refused admission stay as they are while the same requests decode.
    decode_stretch = True
    # (no token budget: a joining request's whole prompt runs in one step)

    def __init__(self, config: OrcaConfig, context: PolicyContext) -> None:
        self.config = config
        self.max_num_seqs = config.max_batch_size

    stretch_shape = plain_stretch_shape          # its decodes attend over their own contexts; no case (c)

    def schedule(self, state: SchedulerState, now_s: float) -> Batch | Idle:
        items = decode_items(state.running)
        room = self.config.max_batch_size - len(state.running)
        for r in admit_reserved(state, now_s, self.config.reserve, room):
            items.append(BatchItem(r.req_id, r.num_uncomputed_tokens, 0))
        return batch_or_idle(items)

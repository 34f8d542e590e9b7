"""Dynamic batching: static batching whose batch launches when it is full OR
when the oldest waiting request has waited ``max_queue_delay_s`` (the
dynamic batcher of Triton-style servers). Same padding, same run-to-completion
and same reserved memory as static batching.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from policies.base import RESERVE_DOC, RESERVE_MODES, PolicyBase, knob
from policies.static import group_step, launch_group, padded_stretch_shape
from sim.core.batch import Batch, Idle
from sim.core.policy import PolicyContext

if TYPE_CHECKING:
    from sim.core.state import SchedulerState


@dataclass(frozen=True, slots=True)
class DynamicConfig:
    kind: Literal["dynamic"] = "dynamic"
    max_batch_size: int = knob(32, "most requests per batch, the most running at once (32: our choice, as "
                                   "static)")
    max_queue_delay_s: float = knob(0.1, "a batch launches once its oldest request waited this long (0.1 s: our "
                                         "choice)")
    reserve: str = knob("max_tokens", RESERVE_DOC, choices=RESERVE_MODES)


class DynamicPolicy(PolicyBase):
    # Fast path (sim.loop.stretch): a running group is stepped to its end, whatever arrives.
    decode_stretch = True
    holds_batch = True

    def __init__(self, config: DynamicConfig, context: PolicyContext) -> None:
        self.config = config
        self.max_num_seqs = config.max_batch_size

    stretch_shape = padded_stretch_shape         # a padded group, as static's

    def schedule(self, state: SchedulerState, now_s: float) -> Batch | Idle:
        if state.running:
            return group_step(state)
        if not state.waiting:
            return Idle()
        deadline_s = state.waiting[0].arrival_s + self.config.max_queue_delay_s
        full = len(state.waiting) >= self.config.max_batch_size
        if full or now_s >= deadline_s:
            return launch_group(state, now_s, self.config.reserve, self.config.max_batch_size)
        return Idle(wake_at_s=deadline_s)

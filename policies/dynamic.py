"""Dynamic batching: static batching whose batch launches when it is full OR
when the oldest waiting request has waited ``max_queue_delay_s`` (the
dynamic batcher of Triton-style servers). Same padding, same run-to-completion
and same reserved memory as static batching.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from policies.static import group_step, launch_group
from sim.batch import Batch, Idle

if TYPE_CHECKING:
    from sim.state import SchedulerState


@dataclass(frozen=True, slots=True)
class DynamicConfig:
    kind: Literal["dynamic"] = "dynamic"
    max_batch_size: int = 32
    max_queue_delay_s: float = 0.1
    reserve: str = "max_tokens"


class DynamicPolicy:
    # Fast path (sim.stretch): a running group is stepped to its end, whatever arrives.
    decode_stretch = True
    max_prompt_tokens: int | None = None
    token_budget: int | None = None

    def __init__(self, config: DynamicConfig) -> None:
        self.config = config

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

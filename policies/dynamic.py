"""Dynamic batching: static batching whose batch launches when it is full OR
when the oldest waiting request has waited ``max_queue_delay_s`` (the
dynamic batcher of Triton-style servers). Same padding, same run-to-completion
and same reserved memory as static batching.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from policies.base import RESERVE_DOC, config_knobs, knob
from policies.static import group_step, launch_group, padded_stretch_shape
from sim.core.batch import Batch, Idle
from sim.core.kv import BlockManager
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
    reserve: str = knob("max_tokens", RESERVE_DOC)


class DynamicPolicy:
    # Fast path (sim.loop.stretch): a running group is stepped to its end, whatever arrives.
    decode_stretch = True
    prefix_caching = False         # no prefix cache (vllm_v1 models vLLM's)
    kv_pool_class = BlockManager
    block_size = None              # server.block_size
    kv_memory = None               # vLLM's rule: server.gpu_memory_utilization
    chunk_stretch = False          # no case (c): see Policy
    holds_batch = True
    refuses_by_prompt = False
    num_reserved_blocks = 0
    max_prompt_tokens: int | None = None
    token_budget: int | None = None           # a batch takes its prompts whole

    def __init__(self, config: DynamicConfig, context: PolicyContext) -> None:
        self.config = config
        self.max_num_seqs = config.max_batch_size

    stretch_shape = padded_stretch_shape         # a padded group, as static's

    def knobs(self) -> dict[str, Any]:
        return config_knobs(self.config)

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

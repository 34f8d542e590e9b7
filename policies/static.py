"""Static batching: a batch of ``batch_size`` requests runs to completion.

Nothing joins until the whole batch is done; prompts are padded to the
longest one, and every decode attends over that padded length (a padded
batch tensor); a finished request keeps its slot (a wasted decode per step) and
its result returns only when the longest request finishes. Memory is reserved
per request at admission. A batch launches when ``batch_size`` requests wait,
or with whatever waits once no more requests will arrive.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, Sequence

from policies.base import RESERVE_DOC, RESERVE_MODES, PolicyBase, admit_reserved, batch_or_idle, knob
from sim.core.batch import Batch, BatchItem, Idle
from sim.core.policy import PolicyContext, StretchShape
from sim.core.request import Status

if TYPE_CHECKING:
    from sim.core.request import Request
    from sim.core.state import SchedulerState


@dataclass(frozen=True, slots=True)
class StaticConfig:
    kind: Literal["static"] = "static"
    batch_size: int = knob(32, "requests per batch, the most running at once (32: our choice; no engine "
                                "default)")
    reserve: str = knob("max_tokens", RESERVE_DOC, choices=RESERVE_MODES)


def padded_length(group: Sequence[Request]) -> int:
    """The KV length every row of a padded group attends over in its next decode: the longest
    prompt plus the tokens decoded since (one per step; the live rows have sampled them all)."""
    return max(r.num_prompt_tokens for r in group) + max(r.num_output_tokens for r in group) - 1


def group_step(state: SchedulerState) -> Batch:
    """One decode iteration of a running static group: live slots decode a
    token, finished slots burn one padded token each. Every row attends over
    the padded length (``padded_length``), as a padded batch tensor does: the
    step's decode context is rows x that, not the rows' own contexts."""
    new_item = tuple.__new__          # BatchItem(...) without the NamedTuple call overhead
    finished = Status.FINISHED
    running = state.running
    batch = Batch(tuple(new_item(BatchItem, (r.req_id, 0, r.num_computed_tokens, 1)) if r.status >= finished
                        else new_item(BatchItem, (r.req_id, 1, r.num_computed_tokens, 0))
                        for r in running))
    batch.decode_context = len(running) * padded_length(running)
    return batch


def padded_stretch_shape(policy: Any, running: Sequence[Request], live_context: int, num_live: int,
                         prefilling: Request | None) -> StretchShape:
    """``Policy.stretch_shape`` of a running padded group: every row, finished
    rows too, attends over the padded length (``padded_length``), which grows
    by one a step for all of them. A policy takes it as its method
    (``stretch_shape = padded_stretch_shape``): it runs once per stretch."""
    return tuple.__new__(StretchShape, (len(running) * padded_length(running), len(running), 0))


def launch_group(state: SchedulerState, now_s: float, reserve: str, max_size: int) -> Batch | Idle:
    """Admit up to ``max_size`` requests whose reservations fit and prefill them
    together, every prompt padded to the longest."""
    group: list[Request] = admit_reserved(state, now_s, reserve, max_size)
    if not group:
        return Idle()
    state.form_group(group)
    longest = max(r.num_uncomputed_tokens for r in group)
    return batch_or_idle([BatchItem(r.req_id, r.num_uncomputed_tokens, 0,
                                    longest - r.num_uncomputed_tokens) for r in group])


class StaticPolicy(PolicyBase):
    # Fast path (sim.loop.stretch): a running group is stepped to its end, whatever arrives.
    decode_stretch = True
    holds_batch = True
    full_batch_knob = "batch_size"         # a batch launches once batch_size wait (or nothing more arrives)

    def __init__(self, config: StaticConfig, context: PolicyContext) -> None:
        self.config = config
        self.max_num_seqs = config.batch_size

    stretch_shape = padded_stretch_shape         # a padded group: every row attends over the padded length

    def schedule(self, state: SchedulerState, now_s: float) -> Batch | Idle:
        if state.running:
            return group_step(state)
        full = len(state.waiting) >= self.config.batch_size
        if full or (state.all_arrived and state.waiting):
            return launch_group(state, now_s, self.config.reserve, self.config.batch_size)
        return Idle()

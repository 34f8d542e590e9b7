"""LMDeploy 0.18.0's waiting-queue order (``lmdeploy/pytorch/paging/prefill_scheduler.py``,
``_PrefillReorderer``), for ``policies.lmdeploy``: the queue is kept by arrival, and the
opt-TTFT turns reorder it when a prompt longer than ``max_prefill_token_num`` waits."""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from sim.core.request import Request

SHORT_TURNS = 3                 # LMDEPLOY_PT_TTFT_SHORT_TURNS: short prefills before a due long chunk
AGING_S_PER_CHUNK = 2.0         # LMDEPLOY_PT_TTFT_AGING_SEC: a long prompt's wait credit per chunk


def prefill_order(waiting: list[Request], limit: int, now_s: float, turn: str) -> list[Request]:
    """The order a prefill turn tries ``waiting`` (in arrival order) in: ``standard`` keeps it;
    ``short_only`` puts the prompts of at most ``limit`` tokens first, smallest first (ties by
    arrival), the long ones after (the turn skips them); ``long_first`` puts the long prompt
    with the fewest chunks, less one per ``AGING_S_PER_CHUNK`` waited, before those."""
    if turn == "standard":
        return waiting
    normal = sorted((r for r in waiting if r.num_uncomputed_tokens <= limit),
                    key=lambda r: (r.num_uncomputed_tokens, r.arrival_s))
    longs = [r for r in waiting if r.num_uncomputed_tokens > limit]
    if turn == "short_only" or not longs:
        return normal + longs

    def key(r: Request) -> tuple:
        chunks = -(-r.num_uncomputed_tokens // limit)
        return chunks - int(max(0.0, now_s - r.arrival_s) // AGING_S_PER_CHUNK), chunks, r.arrival_s
    longs.sort(key=key)
    return [longs[0]] + normal + longs[1:]


def requeue_by_arrival(waiting: deque[Request]) -> None:
    """Move the request at the queue's front (just preempted: ``SchedulerState.preempt`` puts it
    there) to its place by arrival, as LMDeploy orders the queue by ``arrive_time``."""
    r = waiting[0]
    i = 1
    while i < len(waiting) and (waiting[i].arrival_s, waiting[i].req_id) < (r.arrival_s, r.req_id):
        i += 1
    if i > 1:
        waiting.popleft()
        waiting.insert(i - 1, r)

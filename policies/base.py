"""The policy interface and the helpers that several policies share.

A policy is pure scheduling logic: ``schedule(state, now_s) -> Batch | Idle``.
It never sleeps, reads no clock of its own and imports neither SimPy nor
torch. It may admit and preempt requests and grow their block tables through
``state`` (that is how nano-vllm and vLLM schedule too); ``state.commit``
does all token accounting after the step.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from sim.batch import Batch, BatchItem, Idle
from sim.kv import reservation_tokens

if TYPE_CHECKING:
    from sim.request import Request
    from sim.state import SchedulerState


class Policy(Protocol):
    """Chooses the work of the next iteration.

    schedule(state, now_s): return the Batch to run now, or Idle when nothing
    can run (Idle.wake_at_s asks to be called again at that simulated/wall
    time even if no request arrives). Raises nothing on normal input.
    ``max_prompt_tokens``: prompts longer than this are refused at arrival
    (None: no limit beyond the model's context).
    """

    max_prompt_tokens: int | None

    def schedule(self, state: SchedulerState, now_s: float) -> Batch | Idle: ...


def make_room_for_decodes(state: SchedulerState) -> list[Request]:
    """Give every running request that is decoding a KV slot for its next
    token, preempting the newest running requests (recompute) when the pool
    runs dry, as vLLM does. Returns the running requests that survive, oldest
    first.
    """
    kv = state.kv
    running = state.running
    i = 0
    while i < len(running):
        r = running[i]
        need = r.num_computed_tokens + 1
        # Skip prefilling requests, and decodes whose slot is already in their last block.
        if (r.num_prompt_tokens + r.num_output_tokens - r.num_computed_tokens != 1
                or need <= len(r.block_ids) * kv.block_size):
            i += 1
            continue
        while not kv.can_allocate(r, need):
            victim = running[-1]
            state.preempt(victim)          # newest first; may be r itself
            if victim is r:
                break
        else:
            kv.allocate(r, need)
            i += 1
    return running


def decode_items(running: list[Request]) -> list[BatchItem]:
    """One-token items for every running request that has caught up."""
    return [BatchItem(r.req_id, 1, r.num_computed_tokens)
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

"""TensorRT-LLM's capacity schedulers (``capacityScheduler.cpp``): which
requests may run this step, as rules 1 and 2 of ``policies.tensorrt_llm``'s
module doc state them. Each returns the fitting requests in the order the
micro batch scheduler reads them; MAX_UTILIZATION pauses (preempts) here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Mapping

from policies.tensorrt_llm_rules import (
    blocks_one_step,
    blocks_to_completion,
    new_context_block,
    tokens_left,
)

if TYPE_CHECKING:
    from sim.core.kv import KVPool
    from sim.core.request import Request
    from sim.core.state import SchedulerState


def no_evict(state: SchedulerState, max_requests: int, static: bool, flight: Mapping[int, int],
             skip: frozenset[int] = frozenset()) -> list[Request]:
    """GUARANTEED_NO_EVICT / STATIC_BATCH: decodes, then prefills and waiting requests in order while
    their blocks to completion fit; the first misfit stops the scan. ``flight``: the tokens of each
    request in the step in flight (the overlap scheduler; empty in the synchronous loop). ``skip``:
    running requests out of the scheduler (a context server's, their context phase launched),
    their blocks held but nothing kept back for them."""
    kv = state.kv
    decoding, pending = [], []
    available = kv.num_free_blocks
    get = flight.get
    for r in state.running:
        if skip and r.req_id in skip:
            continue
        if (tokens_left(r, get(r.req_id, 0)) if flight
                else r.num_prompt_tokens + r.num_output_tokens - r.num_computed_tokens) == 1:
            decoding.append(r)
            available -= blocks_to_completion(kv, r)
        else:
            pending.append(r)          # an unfinished prefill, checked again below
    fitting = decoding
    if static and decoding:
        return fitting
    skip = kv.caching and not static
    produced = {new_context_block(kv, r) for r in pending} - {None} if skip else set()
    for r in (*pending, *state.waiting):
        if skip and not r.block_ids and passed_over(kv, r, produced):
            continue
        if len(fitting) >= max_requests:
            break
        need = blocks_to_completion(kv, r)
        if need > available:
            break
        available -= need
        fitting.append(r)
    return fitting


def max_utilization(state: SchedulerState, max_requests: int, flight: Mapping[int, int], drafts: int = 0,
                    extra: int = 0, skip: frozenset[int] = frozenset()) -> list[Request]:
    """MAX_UTILIZATION: next-step blocks only; a misfit pauses the last running request. ``flight``
    and ``skip`` as in ``no_evict``; ``drafts``, ``extra``: speculation's (``blocks_one_step``)."""
    kv = state.kv
    running = [r for r in state.running if r.req_id not in skip] if skip else state.running
    fitting: list[Request] = []
    scheduled = 0
    get = flight.get
    produced = ({new_context_block(kv, r) for r in running if tokens_left(r, get(r.req_id, 0)) > 1} - {None}
                if kv.caching else set())
    paused = False
    i = 0
    while i < len(running):
        r = running[i]
        need = blocks_one_step(kv, r, get(r.req_id, 0), drafts, extra)
        if scheduled + need <= kv.num_free_blocks:      # (running never exceeds max_batch_size)
            fitting.append(r)
            scheduled += need
            i += 1
            continue
        victim = running[-1]                           # the last started request, maybe r itself
        if kv.caching and victim.num_computed_tokens // kv.block_size > victim.num_hashed_blocks:
            kv.cache(victim, victim.num_computed_tokens)     # its computed blocks stay reusable
        state.preempt(victim)
        if running is not state.running:
            running.remove(victim)
        paused = True
    if paused:                             # the scan ended at the victim: nobody waiting is taken
        return fitting
    for r in state.waiting:
        if kv.caching and passed_over(kv, r, produced):
            continue
        need = blocks_one_step(kv, r)
        if len(fitting) >= max_requests or scheduled + need > kv.num_free_blocks:
            break
        fitting.append(r)
        scheduled += need
    return fitting


def passed_over(kv: KVPool, r: Request, produced: set[int]) -> bool:
    """The skip rule (``beneficialToSkip``): True if ``r``'s first uncached block is one another
    request of this scan produces; else ``r`` now produces it."""
    block = new_context_block(kv, r)
    if block is None:
        return False
    if block in produced:
        return True
    produced.add(block)
    return False

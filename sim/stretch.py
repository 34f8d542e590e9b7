"""The step loop's one fast path: a stretch of decode-only steps, computed at once.

Between two events (an arrival, a request's last token, a failed block
allocation) a server whose every running request decodes does the same thing
step after step: the same requests, each one token further on, at a cost that
depends only on how many they are and on their summed context. The loop
(``sim.engine.Server._serve``) then needs no policy call, no Batch and no
per-request commit per step: ``run_decode_stretch`` computes the steps' costs
as one vector, their end times as one running sum, hands out the blocks the
requests grow into in the order stepping would, and writes the steps and
their tokens to the logs in bulk. Results are those of stepping one iteration
at a time (``tests/test_fast_path.py`` compares every policy with the fast
path on and off).

The invariant it relies on is the policy's, declared by ``decode_stretch =
True`` on the policy class. As long as nothing arrives, no request finishes
and no block allocation fails:

(a) with nothing waiting and every running request caught up (its next step
    computes exactly one token and samples one), schedule() returns every
    running request, each computing one token (a static group's finished
    slots: one padded token);
(b) after a batch of that shape that admitted, preempted and finished nobody
    while requests were waiting, schedule() returns it again, each request one
    token further on: admission was refused for lack of sequence slots, token
    budget or free blocks, and within a stretch slots and budget stay as they
    are and free blocks only shrink.

Each policy states its reason beside the flag.

A stretch holds only steps that end strictly before the next scheduled
SimPy event (``horizon_s``), as coalesced steps do, and before the step that
would finish a request or find the pool dry; that step runs through the
normal path.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from sim.batch import Batch
from sim.request import Status

if TYPE_CHECKING:
    from sim.engine import Server

MIN_STEPS = 3       # shorter stretches are cheaper stepped one at a time


def run_decode_stretch(server: Server, batch: Batch, preempted: bool, now_s: float, horizon_s: float) -> float:
    """Run the decode steps that follow the committed step of ``batch`` (it
    ended at ``now_s``; ``preempted``: it preempted someone) up to the next
    event; return the time the last of them ends (``now_s`` if none ran)."""
    state = server.state
    running = state.running
    num_seqs = len(running)
    if not num_seqs:
        return now_s
    min_outputs = 1                        # sampled before: first_token_s is set
    if state.waiting:                      # case (b) of the module doc
        if (preempted or batch.decode_seqs != len(batch.items) or num_seqs != len(batch.items)):
            return now_s
        min_outputs = 2                    # none admitted in this very step (a one-token prompt)
    profile = server.executor.profile
    # Every stretch step costs at least the fixed part of a decode step of num_seqs sequences.
    max_steps = (horizon_s - now_s) / profile.decode_floor_s(num_seqs)
    max_steps = int(max_steps) if max_steps < 1e9 else 10**9     # horizon inf: nothing else scheduled
    if max_steps < MIN_STEPS:
        return now_s
    # Live requests decode; a static group's finished members (still running) burn a padded token.
    live = []
    context = 0
    to_last = max_steps + 1
    oracle = state.oracle_output_tokens
    for r in running:
        computed = r.num_computed_tokens
        context += computed
        if r.status == Status.RUNNING:
            outputs = r.num_output_tokens
            if r.num_prompt_tokens + outputs - computed != 1 or outputs < min_outputs:
                return now_s               # not caught up, or caught up this very step
            # The step that samples a request's last token finishes it: stop before it.
            left = oracle(r) - outputs
            if left < to_last:
                to_last = left
            live.append(r)
    max_steps = min(max_steps, to_last - 1)
    if max_steps < MIN_STEPS:
        return now_s
    num_live = len(live)
    contexts = context + num_live * np.arange(max_steps, dtype=np.int64)
    durations, linear_out, attn_out = profile.decode_steps_s(num_seqs, contexts)
    ends = np.add.accumulate(np.concatenate(([now_s], durations)))[1:]
    num_steps = int(np.searchsorted(ends, horizon_s, side="left"))    # ends strictly before it
    kv = state.kv
    num_steps, allocations = _block_growth(kv, live, num_steps)
    if num_steps < 1:
        return now_s
    # Blocks in use in each step: those held now plus the step's allocations and all before it.
    kv_used = kv.num_used_blocks + np.cumsum(np.bincount([j for j, _ in allocations], minlength=num_steps))
    for _, k in allocations:
        kv.append_block(live[k])
    for r in live:
        r.num_computed_tokens += num_steps
        r.num_output_tokens += num_steps
    durations = durations[:num_steps]
    ends = ends[:num_steps]
    starts = np.concatenate(([now_s], ends[:-1]))
    ints = np.empty((num_steps, 8), dtype=np.int64)
    ints[:, 0] = num_seqs                      # batch_size
    ints[:, 1] = 0                             # num_prefill_tokens
    ints[:, 2] = num_live                      # num_decode_tokens
    ints[:, 3] = num_seqs - num_live           # num_pad_tokens
    ints[:, 4] = 0                             # num_prefill_seqs
    ints[:, 5] = len(state.waiting)
    ints[:, 6] = num_seqs                      # num_running
    ints[:, 7] = kv_used
    server.log.record_stretch(starts, durations, durations, ints)
    if live:
        state.tokens.add_stretch(ends, np.fromiter((r.req_id for r in live), dtype=np.int64, count=num_live))
    profile.count_decode_lookups(num_steps, linear_out, attn_out[:num_steps])
    return float(ends[-1])


def _block_growth(kv, live: list, num_steps: int) -> tuple[int, list[tuple[int, int]]]:
    """The blocks the live requests grow into over ``num_steps`` stretch steps:
    how many steps fit before the pool runs dry, and the allocations of those
    steps as (step, index in ``live``), in the order stepping makes them (by
    step, then running order)."""
    bs = kv.block_size
    allocations = []
    for k, r in enumerate(live):
        # Stretch step j computes the token at position computed + j: it needs a new block
        # when that reaches the capacity of the blocks held, first at j = capacity - computed.
        j = len(r.block_ids) * bs - r.num_computed_tokens
        while j < num_steps:
            allocations.append((j, k))
            j += bs
    allocations.sort()
    free = kv.num_free_blocks
    if len(allocations) > free:
        # Stepping finds the pool dry at allocation number free + 1: stop before its step.
        num_steps = allocations[free][0]
        allocations = [a for a in allocations if a[0] < num_steps]
    return num_steps, allocations

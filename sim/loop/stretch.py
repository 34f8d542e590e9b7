"""The step loop's one fast path: a stretch of decode-only steps, computed at once.

Between two events (an arrival, a request's last token, a failed block
allocation) a server whose every running request decodes does the same thing
step after step: the same requests, each one token further on, at a cost that
depends only on how many they are and on their summed context. The loop
(``sim.loop.server.Server._serve``) then needs no policy call, no Batch and no
per-request commit per step: ``run_decode_stretch`` prices the steps in one
tight loop that touches no request (``Profile.decode_stretch_s``: the summed
context grows by the number of live requests each step), sums their end
times as stepping does, hands out the blocks the requests grow into in the
order stepping would, and writes the steps and their tokens to the logs in
bulk. (Stretches are short, a median of 8 steps on the conversation trace,
so a plain loop beats numpy, whose per-call overhead cost more than the
steps.) Results are those of stepping one iteration
at a time (``tests/loop/test_fast_path.py`` compares every policy with the fast
path on and off).

The invariant it relies on is the policy's, declared by ``decode_stretch =
True`` on the policy class, and the shape of the repeated step is the
policy's too (``Policy.stretch_shape``: the context its decodes attend over,
padded or not, and case (c)'s chunk); the loop keeps the pricing, the
horizon, block growth and logging. Neither is trusted: a server built with
``check_stretch`` plans every stretch as here, then steps it one iteration at
a time through the policy and raises ``StretchMismatch`` on the first step
that differs from the plan (the tests run every policy so). As long as nothing arrives, no request finishes
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

A policy that holds its batch (``holds_batch``: static, dynamic) decodes
its running group, one token further on each step, whatever waits, so for
it case (b) needs no earlier step as evidence, and a stretch goes on past a
member's finish while others of the group run.

Each policy states its reason beside the flag. A policy that also declares
``chunk_stretch = True`` (sarathi) keeps a third case:

(c) with one running request prefilling and every other caught up,
    schedule() gives each caught-up request its token and the prefilling
    one a chunk of the rest of the token budget; while that chunk does not
    complete the prompt the budget is full, nobody is admitted, and the
    next step has the same shape with the chunk moved on. The chunk that
    completes the prompt samples a token and ends the stretch; it belongs to
    it when it leaves no budget for an admission or nothing waits (else it
    runs through the normal path).

A stretch runs the steps that end strictly before the next scheduled SimPy
event (``horizon_s``) at once, as coalesced steps are, and then the step
during which that event comes (it was chosen before the event): the server
yields to SimPy until that step's end, as stepping does, and logs and
commits it after, so it sees the queues the event changed. A stretch ends
with the step that samples some request's last token, which it commits as
``SchedulerState.commit`` would (the request finishes), and before the step
that would find the KV pool dry, which runs through the normal path (it
preempts). With nothing waiting and no event reached, the next stretch
follows at once: case (a) holds again.
"""

from __future__ import annotations

from array import array
from itertools import accumulate
from typing import Any, Generator, NamedTuple, Protocol

import simpy

from sim.core.batch import Batch
from sim.core.logs import StepLog
from sim.core.policy import Policy, PolicyError
from sim.core.request import Request, Status
from sim.core.state import SchedulerState
from sim.cost.profile import Profile

MIN_STEPS = 1       # stretches as short as one step: cheaper than stepping it (measured)

# The integer columns of a step-log row, by name (``StepLog.COLUMNS[3:]``).
PREFILL_TOKENS, KV_USED = StepLog.PREFILL_TOKENS, StepLog.KV_USED_BLOCKS
NUM_INTS = StepLog.NUM_INTS


class StretchMismatch(PolicyError):
    """A policy's stepped decision differs from the step the fast path
    planned for it: its ``decode_stretch`` (or ``chunk_stretch``) declaration
    or its ``stretch_shape`` is wrong. Raised only by a ``check_stretch`` run."""


class Host(Protocol):
    """What a stretch needs of its server (``sim.loop.server.Server``)."""

    env: simpy.Environment
    state: SchedulerState
    policy: Policy
    executor: Any                   # a SimExecutor: its ``profile`` prices the steps
    log: StepLog
    check_stretch: bool
    num_stretch_steps_checked: int


def run_decode_stretch(server: Host, batch: Batch, changed: bool, now_s: float, horizon_s: float,
                       chain: bool) -> Generator:
    """Run the decode steps that follow the committed step of ``batch`` (it
    ended at ``now_s``; ``changed``: it preempted or admitted someone) up to and through
    the next event (a SimPy process fragment: use with ``yield from``);
    return the time the last of them ends (``now_s`` if none ran).

    With ``chain`` (no closed-loop client waits on a finish), after a stretch
    that finished requests or ran through an event, the next one follows at
    once if nothing waits (or the policy holds its batch): schedule() would
    return the same requests, less the finished ones.

    With ``server.check_stretch`` every planned step runs through the policy
    instead, one iteration at a time, and must match the plan
    (``StretchMismatch`` if not): the same results, checked."""
    state = server.state
    holds = server.policy.holds_batch
    check = server.check_stretch
    while True:
        plan = _plan(server, batch, changed, now_s, horizon_s)
        if plan is None:
            return now_s
        if check:
            end_s, finished, crossed = yield from _step_through(server, plan)
        else:
            end_s, finished = _apply(server, plan)
            crossed = plan.crossing_s is not None
            if crossed:
                # The step during which the next event comes: chosen (its blocks allocated)
                # before the event, logged and committed after it, as stepping does.
                env = server.env
                yield env.timeout(end_s + plan.crossing_s - env.now)
                _commit_crossing(server, plan, end_s, env.now)
                end_s = env.now            # as stepping takes it
        if crossed:
            if not chain or (state.waiting and not holds):
                return end_s
            horizon_s = server.env.peek()  # the event came and went: the next one bounds the next stretch
        elif not (finished and chain) or (state.waiting and not holds):
            return end_s
        now_s = end_s


class _Plan(NamedTuple):
    """The steps of one stretch, as planned before any of them runs: the
    ``num_steps`` steps that end before the horizon (starting at ``starts_s``,
    lasting ``durations_s``) and, if ``crossing_s`` is not None, one more that
    lasts that long, during which the next event comes."""

    start_s: float                    # when the first step starts (the committed step's end)
    starts_s: list[float]
    durations_s: list[float]
    ends_s: list[float]
    crossing_s: float | None
    live: list[Request]               # the requests that decode, in running order
    ids: array                        # ... their ids
    num_seqs: int                     # rows of every step
    kv_used: array                    # blocks in use in each step, the crossing one included
    allocations: list[tuple[int, int]]   # (step, index in live) of each block the live requests grow into
    finishing: list[Request]          # finished by the last step (the crossing one, if any)
    prefilling: Request | None        # case (c): the request that prefills a chunk a step, ...
    chunks: list[int]                 # ... this many tokens in each step, the crossing one included
    completes: bool                   # ... the last of which completes its prompt
    lookups: tuple                    # what ``Profile.count_stretch_lookups`` counts when the plan runs at once

    @property
    def num_steps(self) -> int:
        return len(self.durations_s)

    def row(self, j: int, num_waiting: int) -> tuple[int, ...]:
        """Step j's integer columns (``StepLog.COLUMNS[3:]``) with ``num_waiting`` waiting."""
        chunk = self.chunks[j] if self.chunks else 0
        prefill_seqs = 1 if chunk else 0
        num_live = len(self.live)
        return (self.num_seqs,                              # batch_size
                chunk,                                      # num_prefill_tokens
                num_live,                                   # num_decode_tokens
                self.num_seqs - num_live - prefill_seqs,    # num_pad_tokens
                prefill_seqs,                               # num_prefill_seqs
                num_waiting,                                # num_waiting
                self.num_seqs,                              # num_running
                self.kv_used[j])                            # kv_used_blocks


def _plan(server: Host, batch: Batch, changed: bool, now_s: float, horizon_s: float) -> _Plan | None:
    """The next stretch, or None when the state does not repeat. Changes nothing."""
    state = server.state
    running = state.running
    num_seqs = len(running)
    if not num_seqs:
        return None
    # Case (b) of the module doc: the step just run had the stretch's shape. A policy that
    # holds its batch decodes the running group whatever waits: no evidence needed.
    policy = server.policy
    holds = policy.holds_batch
    repeats = holds or not (state.waiting and (changed or batch.decode_seqs != len(batch.items)
                                               or num_seqs != len(batch.items)))
    chunked = policy.chunk_stretch         # case (c): one request may prefill a full-budget chunk
    if not repeats and not chunked:
        return None
    profile: Profile = server.executor.profile
    # Every stretch step costs at least the fixed part of a decode step of num_seqs sequences:
    # the steps before the horizon, plus the one that reaches it.
    max_steps = (horizon_s - now_s) / profile.decode_floor_s(num_seqs)
    max_steps = int(max_steps) + 1 if max_steps < 1e9 else 10**9     # horizon inf: nothing else scheduled
    # One pass over the running requests gathers what the stretch needs. Live requests
    # decode; a static group's finished members (still running) burn a padded token.
    live = []
    ids = array("q")
    context = 0
    prefilling = None                      # case (c)'s request
    fresh = False                          # a live request sampled its first token in the step just run
    to_last = max_steps
    last_ones: list = []                   # the live requests whose last token comes at step to_last
    near = []                              # (steps until it needs a new block, index in live)
    kv = state.kv
    block_size = kv.block_size
    true_output = state.true_output_tokens
    running_status = Status.RUNNING
    in_prefill = state.prefilling
    for r in running:
        computed = r.num_computed_tokens
        if r.status == running_status:
            outputs = r.num_output_tokens
            uncomputed = r.num_prompt_tokens + outputs - computed
            # Not caught up (outputs 0: a last prompt token; in ``prefilling``: the last token
            # of a recompute, a prefill item the step log counts apart from the decodes).
            if uncomputed != 1 or outputs < 1 or r.req_id in in_prefill:
                if chunked and prefilling is None and uncomputed > 1:
                    prefilling = r
                    continue
                return None
            context += computed
            if outputs == 1:
                fresh = True
            # Step number ``left`` samples the request's last token and finishes it: the
            # stretch ends with it (everything after it would depend on the finish).
            left = true_output[r.req_id] - outputs
            if left <= to_last:
                if left < to_last:
                    to_last = left
                    last_ones = [r]
                else:
                    last_ones.append(r)
            # Stretch step j computes the token at position computed + j: it needs a new
            # block when that reaches the capacity of the blocks held.
            room = len(r.block_ids) * block_size - computed
            if room < max_steps:
                near.append((room, len(live)))
            live.append(r)
            ids.append(r.req_id)
        else:
            context += computed
    max_steps = to_last
    # The policy's repeated step: the context its decodes attend over (a padded group's is
    # its padded length on every row) and case (c)'s chunk.
    shape = policy.stretch_shape(running, context, len(live), prefilling)
    if shape is None:
        return None
    context, growth, chunk = shape         # StretchShape(decode_context, context_growth, chunk_tokens)
    decode_seqs = num_seqs
    chunks: list[int] = []                 # case (c): each step's prefill chunk
    completes = False                      # ... the last of which completes the prompt
    pre_s = None
    chunk_out: list[bool] = []
    if prefilling is None:
        # Case (b) with nothing admitted in the step just run (a one-token prompt's first
        # token would look like a decode in its Batch).
        if state.waiting and not holds and (not repeats or fresh):
            return None
    else:
        # Case (c): the decodes take their tokens and the chunk the rest of the budget, so
        # nothing is admitted while chunks leave some of the prompt. The chunk that completes
        # it samples a token, and ends the stretch; it has the stretch's shape when it leaves
        # no budget for an admission, or nothing waits.
        decode_seqs = num_seqs - 1
        uncomputed = prefilling.num_uncomputed_tokens
        num_full = (uncomputed - 1) // chunk
        last_chunk = uncomputed - num_full * chunk
        chunks = [chunk] * num_full
        if last_chunk >= 2 and (last_chunk == chunk or not state.waiting):
            chunks.append(last_chunk)
            completes = True
        max_steps = min(max_steps, len(chunks))
        if max_steps < len(chunks):
            del chunks[max_steps:]
            completes = False
        pre_s, chunk_out = profile.chunk_steps_s(decode_seqs, chunks, prefilling.num_computed_tokens)
    if max_steps < MIN_STEPS:
        return None
    durations, ends, crossing_s, out_of_range = profile.decode_stretch_s(decode_seqs, context, growth, now_s,
                                                                         horizon_s, max_steps, pre_s)
    num_priced = len(ends) + (crossing_s is not None)
    num_steps, allocations = _block_growth(kv, near, num_priced)
    if num_steps < 1:
        return None
    # Blocks in use in each step: those held now plus the step's allocations and all before it.
    used = kv.num_used_blocks
    if allocations:
        counts = [0] * num_steps           # allocations made in each step, then summed up
        for j, _ in allocations:
            counts[j] += 1
        counts[0] += used
        kv_used = array("q", accumulate(counts))
    else:
        kv_used = array("q", (used,)) * num_steps
    if prefilling is not None:
        del chunks[num_steps:]
        completes = completes and num_steps == max_steps      # the completing chunk is the last one
    finishing = last_ones if num_steps == to_last else []
    if num_steps <= len(ends):             # else the step at the horizon fits: it runs last
        crossing_s = None
        del durations[num_steps:], ends[num_steps:]
    starts = [now_s] + ends[:-1] if ends else []

    # What the steps' lookups count when the plan runs at once, as step_time_s would one step at a time.
    if prefilling is None:
        lookups = (((num_seqs, num_steps),), out_of_range(num_steps), 0, ((num_seqs, num_steps),))
    else:
        lookups = (((decode_seqs + chunks[0], num_steps - completes), (decode_seqs + chunks[-1], int(completes))),
                   out_of_range(num_steps), sum(chunk_out[:num_steps]), ((decode_seqs + 1, num_steps),))

    return tuple.__new__(_Plan, (now_s, starts, durations, ends, crossing_s, live, ids, num_seqs, kv_used,
                                 allocations, finishing, prefilling, chunks, completes, lookups))


def _apply(server: Host, plan: _Plan) -> tuple[float, bool]:
    """Run ``plan``'s steps before the horizon at once (its blocks, logs and
    commits, the crossing step's blocks and lookups too); (end of the last of
    them, whether it changed the running requests' shape). The crossing step,
    if any, is ``_commit_crossing``'s."""
    (start_s, starts_s, durations_s, ends_s, crossing_s, live, ids, _, kv_used, allocations, finishing,
     prefilling, chunks, completes, lookups) = plan
    state = server.state
    if allocations:
        append_block = state.kv.append_block
        for _, k in allocations:
            append_block(live[k])
    server.executor.profile.count_stretch_lookups(*lookups)
    num_steps = len(durations_s)
    if not num_steps:
        return start_s, False
    crossing = crossing_s is not None
    ints = array("q", plan.row(0, len(state.waiting))) * num_steps
    ints[KV_USED::NUM_INTS] = kv_used[:num_steps]
    completes = completes and not crossing
    if completes:
        ints[NUM_INTS * (num_steps - 1) + PREFILL_TOKENS] = chunks[num_steps - 1]     # the completing chunk
    server.log.record_stretch(starts_s, durations_s, durations_s, ints)
    # After the log, which records the queues as the steps ran them.
    state.commit_decode_stretch(live, ids, ends_s, [] if crossing else finishing, prefilling,
                                sum(chunks[:num_steps]) if chunks else 0, completes)
    return ends_s[-1], bool(finishing) or completes


def _commit_crossing(server: Host, plan: _Plan, start_s: float, end_s: float) -> None:
    """Log and commit the plan's crossing step, which ran from ``start_s`` to ``end_s``."""
    state, num_steps, chunks = server.state, plan.num_steps, plan.chunks
    row = array("q", plan.row(num_steps, len(state.waiting)))
    server.log.record_stretch((start_s,), (plan.crossing_s,), (plan.crossing_s,), row)
    state.commit_decode_stretch(plan.live, plan.ids, [end_s], plan.finishing, plan.prefilling,
                                chunks[num_steps] if chunks else 0, plan.completes)


def _step_through(server: Host, plan: _Plan) -> Generator:
    """Run ``plan``'s steps one iteration at a time through the policy, as the
    server's loop does, checking each against the plan (``StretchMismatch``
    on the first that differs); returns as ``_apply``."""
    env, state, policy, executor, log = server.env, server.state, server.policy, server.executor, server.log
    crossing = plan.crossing_s is not None
    expected_ids = set(plan.ids)
    if plan.prefilling is not None:
        expected_ids.add(plan.prefilling.req_id)
    now_s = plan.start_s
    for j in range(plan.num_steps + crossing):
        last = j == plan.num_steps
        decision = policy.schedule(state, now_s)
        where = (f"policy {type(policy).__name__} at t={now_s:.9g} s, step {j + 1} of a planned stretch of "
                 f"{plan.num_steps + crossing}")
        _check_shape(where, plan, j, decision, state, expected_ids)
        result = executor.execute(decision, state)
        planned_s = plan.crossing_s if last else plan.durations_s[j]
        if result.duration_s != planned_s:
            raise StretchMismatch(f"{where}: the step costs {result.duration_s!r} s stepped, {planned_s!r} s "
                                  f"planned")
        end_s = now_s + result.duration_s
        if last:
            yield env.timeout(end_s - env.now)
            end_s = env.now
        log.record(now_s, decision, result, len(state.waiting), len(state.running), state.kv.num_used_blocks,
                   state.prefill_items(decision))
        state.commit(decision, end_s)
        server.num_stretch_steps_checked += 1
        now_s = end_s
    return now_s, bool(plan.finishing) or plan.completes, crossing


def _check_shape(where: str, plan: _Plan, j: int, decision: Any, state: SchedulerState,
                 expected_ids: set[int]) -> None:
    """``decision`` is plan step j: the same step-log row and the same requests computing tokens."""
    if not isinstance(decision, Batch):
        raise StretchMismatch(f"{where}: the fast path planned a step, the policy returned {decision!r}")
    short = state.prefill_items(decision)          # one-token prefill chunks: the step log's counts
    got = (len(decision.items), decision.num_prefill_tokens + short, decision.num_decode_tokens - short,
           decision.num_pad_tokens, decision.num_prefill_seqs + short, len(state.waiting), len(state.running),
           state.kv.num_used_blocks)
    want = plan.row(j, len(state.waiting))
    ids = {item.req_id for item in decision.items if item.num_new_tokens}
    if got == want and ids == expected_ids:
        return
    diff = [f"{name} {w} planned, {g} stepped" for name, w, g in zip(StepLog.COLUMNS[3:], want, got) if w != g]
    if ids != expected_ids:
        diff.append(f"requests {sorted(expected_ids - ids)[:5]} planned but not stepped, "
                    f"{sorted(ids - expected_ids)[:5]} stepped but not planned")
    raise StretchMismatch(f"{where}: {'; '.join(diff)}")


def _block_growth(kv, near: list[tuple[int, int]], num_steps: int) -> tuple[int, list[tuple[int, int]]]:
    """The blocks the live requests grow into over ``num_steps`` stretch steps
    (``near``: (steps until it needs a new block, index in live) of those that
    may need one): how many steps fit before the pool runs dry, and the
    allocations of those steps as (step, index in live), in the order stepping
    makes them (by step, then running order)."""
    block_size = kv.block_size
    allocations = []
    for j, k in near:
        while j < num_steps:
            allocations.append((j, k))
            j += block_size
    allocations.sort()
    free = kv.num_free_blocks
    if len(allocations) > free:
        # Stepping finds the pool dry at allocation number free + 1: stop before its step.
        num_steps = allocations[free][0]
        allocations = [a for a in allocations if a[0] < num_steps]
    return num_steps, allocations

"""The step loop's one fast path: a stretch of decode-only steps, computed at once.

Between two events (an arrival, a request's last token, a failed block
allocation) a server whose every running request decodes does the same thing
step after step: the same requests, each one token further on, at a cost that
depends only on how many they are and on their summed context. The loop
(``sim.engine.Server._serve``) then needs no policy call, no Batch and no
per-request commit per step: ``run_decode_stretch`` prices the steps in one
tight loop that touches no request (``Profile.decode_stretch_s``: the summed
context grows by the number of live requests each step), sums their end
times as stepping does, hands out the blocks the requests grow into in the
order stepping would, and writes the steps and their tokens to the logs in
bulk. (Stretches are short, a median of 8 steps on the conversation trace,
so a plain loop beats numpy, whose per-call overhead cost more than the
steps.) Results are those of stepping one iteration
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
from typing import TYPE_CHECKING, Generator, NamedTuple

from policies.static import padded_length
from sim.batch import Batch
from sim.request import Request, Status

if TYPE_CHECKING:
    from sim.engine import Server

MIN_STEPS = 1       # stretches as short as one step: cheaper than stepping it (measured)


def run_decode_stretch(server: Server, batch: Batch, preempted: bool, now_s: float, horizon_s: float,
                       chain: bool) -> Generator:
    """Run the decode steps that follow the committed step of ``batch`` (it
    ended at ``now_s``; ``preempted``: it preempted someone) up to and through
    the next event (a SimPy process fragment: use with ``yield from``);
    return the time the last of them ends (``now_s`` if none ran).

    With ``chain`` (no closed-loop client waits on a finish), after a stretch
    that finished requests or ran through an event, the next one follows at
    once if nothing waits (or the policy holds its batch): schedule() would
    return the same requests, less the finished ones."""
    state = server.state
    holds = server.policy.holds_batch
    while True:
        end_s, finished, crossing = _stretch(server, batch, preempted, now_s, horizon_s)
        if crossing is not None:
            env = server.env
            yield env.timeout(crossing.end_s - env.now)
            end_s = env.now                # as stepping takes it
            crossing.commit(server, end_s)
            if not chain or (state.waiting and not holds):
                return end_s
            horizon_s = env.peek()         # the event came and went: the next one bounds the next stretch
        elif not (finished and chain) or (state.waiting and not holds):
            return end_s
        now_s = end_s


class _Crossing(NamedTuple):
    """The stretch's last step, the one during which the next event comes:
    chosen and its blocks allocated before the event, logged and committed
    after it (``commit``), as stepping does."""

    start_s: float
    end_s: float                      # start + duration: the server yields until then
    duration_s: float
    live: list
    ids: array
    num_seqs: int
    kv_used: int
    finishing: list
    prefilling: Request | None        # case (c): the request that prefills a chunk of ``chunk`` tokens,
    chunk: int
    completes: bool                   # ... the last of its prompt

    def commit(self, server: Server, end_s: float) -> None:
        state = server.state
        row = _step_row(self.num_seqs, len(self.live), self.chunk, len(state.waiting))
        row[7] = self.kv_used
        server.log.record_stretch((self.start_s,), (self.duration_s,), (self.duration_s,), row)
        state.commit_decode_stretch(self.live, self.ids, [end_s], self.finishing, self.prefilling, self.chunk,
                                    self.completes)


def _step_row(num_seqs: int, num_live: int, chunk: int, num_waiting: int) -> array:
    """A stretch step's integer columns (``StepLog.COLUMNS[3:]``), kv_used_blocks 0."""
    prefill_seqs = 1 if chunk else 0
    return array("q", (num_seqs,                              # batch_size
                       chunk,                                 # num_prefill_tokens
                       num_live,                              # num_decode_tokens
                       num_seqs - num_live - prefill_seqs,    # num_pad_tokens
                       prefill_seqs,                          # num_prefill_seqs
                       num_waiting,                           # num_waiting
                       num_seqs,                              # num_running
                       0))                                    # kv_used_blocks


def _stretch(server: Server, batch: Batch, preempted: bool, now_s: float,
             horizon_s: float) -> tuple[float, bool, _Crossing | None]:
    """One stretch: the end time of the steps it committed, whether the last
    of them changed the running requests' shape (finished some, or completed
    case (c)'s prompt), and the step during which the next event comes, if
    the stretch reaches it (then nothing changed before it)."""
    state = server.state
    running = state.running
    num_seqs = len(running)
    if not num_seqs:
        return now_s, False, None
    # Case (b) of the module doc: the step just run had the stretch's shape. A policy that
    # holds its batch decodes the running group whatever waits: no evidence needed.
    policy = server.policy
    holds = policy.holds_batch
    repeats = holds or not (state.waiting and (preempted or batch.decode_seqs != len(batch.items)
                                               or num_seqs != len(batch.items)))
    chunked = policy.chunk_stretch         # case (c): one request may prefill a full-budget chunk
    if not repeats and not chunked:
        return now_s, False, None
    profile = server.executor.profile
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
    for r in running:
        computed = r.num_computed_tokens
        context += computed
        if r.status == running_status:
            outputs = r.num_output_tokens
            uncomputed = r.num_prompt_tokens + outputs - computed
            if uncomputed != 1 or outputs < 1:          # not caught up (outputs 0: a last prompt token)
                if chunked and prefilling is None and uncomputed > 1:
                    prefilling = r
                    context -= computed
                    continue
                return now_s, False, None
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
    max_steps = to_last
    decode_seqs = num_seqs
    growth = len(live)
    if holds:
        # A padded group (static, dynamic: policies.static.group_step): every row attends over
        # the padded length, which grows by one a step for all of them, finished rows too.
        context = num_seqs * padded_length(running)
        growth = num_seqs
    chunks: list[int] = []                 # case (c): each step's prefill chunk
    completes = False                      # ... the last of which completes the prompt
    pre_s = None
    if prefilling is None:
        # Case (b) with nothing admitted in the step just run (a one-token prompt's first
        # token would look like a decode in its Batch).
        if state.waiting and not holds and (not repeats or fresh):
            return now_s, False, None
    else:
        # Case (c): the decodes take their tokens and the chunk the rest of the budget, so
        # nothing is admitted while chunks leave some of the prompt. The chunk that completes
        # it samples a token, and ends the stretch; it has the stretch's shape when it leaves
        # no budget for an admission, or nothing waits, and computes more than one token (one
        # would be a decode in its Batch).
        decode_seqs = num_seqs - 1
        chunk = policy.token_budget - decode_seqs
        if not decode_seqs or chunk < 2:
            return now_s, False, None
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
        return now_s, False, None
    num_live = len(live)
    durations, ends, crossing_s, out_of_range = profile.decode_stretch_s(decode_seqs, context, growth, now_s,
                                                                         horizon_s, max_steps, pre_s)
    num_priced = len(ends) + (crossing_s is not None)
    num_steps, allocations = _block_growth(kv, near, num_priced)
    if num_steps < 1:
        return now_s, False, None
    # Blocks in use in each step: those held now plus the step's allocations and all before it.
    used = kv.num_used_blocks
    if allocations:
        kv_used = array("q")
        a, num_allocations = 0, len(allocations)
        for j in range(num_steps):
            while a < num_allocations and allocations[a][0] == j:
                a += 1
            kv_used.append(used + a)
        for _, k in allocations:
            kv.append_block(live[k])
    else:
        kv_used = array("q", (used,)) * num_steps
    if prefilling is None:
        profile.count_stretch_lookups(((num_seqs, num_steps),), out_of_range(num_steps))
    else:
        del chunks[num_steps:]
        completes = completes and num_steps == max_steps      # the completing chunk is the last one
        num_full_used = num_steps - completes
        profile.count_stretch_lookups(((decode_seqs + chunks[0], num_full_used),
                                       (decode_seqs + chunks[-1], int(completes))),
                                      out_of_range(num_steps), sum(chunk_out[:num_steps]))
    finishing = last_ones if num_steps == to_last else []
    crossing = None
    if num_steps > len(ends):              # the step at the horizon fits: it runs last
        start_s = ends[-1] if ends else now_s
        crossing = _Crossing(start_s, start_s + crossing_s, crossing_s, live, ids, num_seqs, kv_used[-1],
                             finishing, prefilling, chunks[-1] if chunks else 0, completes)
        finishing = []
        completes = False
        num_steps -= 1
        if chunks:
            chunks.pop()
        if not num_steps:
            return now_s, False, crossing
    elif num_steps < len(ends):
        del durations[num_steps:], ends[num_steps:]
    ints = _step_row(num_seqs, num_live, chunks[0] if chunks else 0, len(state.waiting)) * num_steps
    ints[7::8] = kv_used[:num_steps]
    if completes:
        ints[8 * num_steps - 7] = chunks[-1]       # the last step's num_prefill_tokens
    server.log.record_stretch([now_s] + ends[:-1], durations, durations, ints)
    # After the log, which records the queues as the steps ran them.
    state.commit_decode_stretch(live, ids, ends, finishing, prefilling, sum(chunks), completes)
    return ends[-1], bool(finishing) or completes, crossing


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

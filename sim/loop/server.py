"""The SimPy driver: ``schedule -> execute -> timeout -> commit``, event-driven.

A ``Server`` is one replica: a policy, its ``SchedulerState``, an ``Executor``
and a ``StepLog``. It never polls: when the policy has nothing to run, the
server waits on an arrival event (and the policy's own deadline, if any).
The executor is the only thing that differs between simulation (predicted
duration) and a live run (measured duration). Arrivals reach servers
through ``sim.loop.feed``.
"""

from __future__ import annotations

import os
from array import array
from collections import deque
from typing import Callable, Protocol

import simpy

from sim.core.batch import Batch, Idle, StepResult
from sim.core.logs import StepLog
from sim.core.policy import Policy, PolicyError
from sim.core.request import Request
from sim.core.state import SchedulerState
from sim.cost.profile import Profile
from sim.loop.stretch import run_decode_stretch


# Decode-only stretches between events run in one go (sim.loop.stretch) when the policy allows it.
# False steps every iteration: same results, used by tests/loop/test_fast_path.py to prove it.
FAST_PATH = os.environ.get("BATCHSIM_FAST_PATH", "1") != "0"


class Executor(Protocol):
    """Runs (or predicts) one step.

    execute(batch, state): the step's StepResult; ``duration_s`` is the time
    the step takes on the driving clock (seconds). Called before commit, so
    ``state`` shows the requests as they were when the batch was chosen.
    """

    def execute(self, batch: Batch, state: SchedulerState) -> StepResult: ...


class SimExecutor:
    """Simulation: the step takes what the profile predicts; where the profile separates the
    engine's host work (``Profile.host_s``), ``device_s`` is the rest of it."""

    def __init__(self, profile: Profile) -> None:
        self.profile = profile
        self._split = bool(profile.host_step_s or profile.host_per_seq_s)

    def execute(self, batch: Batch, state: SchedulerState) -> StepResult:
        t = self.profile.step_time_s(batch)
        if state.speculation is not None:
            t += proposer_time_s(self.profile, batch, state)
        if self._split:
            return StepResult(t, t, max(0.0, t - self.profile.host_s(batch)))
        return StepResult(duration_s=t, predicted_s=t)


def proposer_time_s(profile: Profile, batch: Batch, state: SchedulerState) -> float:
    """The speculative proposer's time after ``batch`` (``Profile.proposer_s``): it drafts for
    every request the step samples for (its item reaches the request's known tokens)."""
    requests = state.requests
    seqs = tokens = context = 0
    for req_id, n, ctx, _pad in batch.items:
        r = requests.get(req_id)
        if r is not None and n and ctx + n >= r.num_prompt_tokens + r.num_output_tokens:
            seqs += 1
            tokens += n
            context += ctx + n
    return profile.proposer_s(state.speculation.spec, seqs, tokens, context)


def pipelined_start_s(device_free_s: float | None, chosen_s: float, host_s: float) -> float:
    """The overlap rule of the pipelined loop: when a step starts on the device.

    vLLM 0.32's async scheduling (``EngineCore.step_with_batch_queue``, a batch queue of two,
    ``AsyncScheduler``) runs one engine-core thread that, per step, schedules step N+1,
    prepares its inputs and launches it (``execute_model`` / ``sample_tokens`` with
    ``non_block=True``: the GPU queues the kernels behind step N's), then blocks on step N's
    sampled tokens (``AsyncGPUModelRunnerOutput.get_output``: a non-blocking device-to-host
    copy on its own stream, waited for by event) and runs ``update_from_output`` of N. Step
    N+1's input tokens are N's samples, scattered on the GPU (``prev_sampled_token_ids``): no
    host round trip between the two forward passes. So the thread chooses step N+1 at
    ``chosen_s`` (step N-1's output committed, ``SchedulerState.commit_pipelined``), spends
    ``host_s`` on it (the profile's host work of a step: that update, the scheduling and the
    input preparation; ``Profile.host_s``), and the device starts it when both it has ended
    step N (``device_free_s``; None: idle) and the host is done:

        start(N+1) = max(end(N), chosen(N+1) + host(N+1))

    so a steady stream of steps runs at max(device, host) a step, not their sum. The thread
    then commits step N's output and chooses N+2 at start(N+1) (it is done with N+1 and N has
    ended). Off the critical path: all of the host work above while the device is busy, and
    the API server's output processing (detokenizing, streaming: another process; charged per
    request by the profile's request overhead). On it: only the device's own work, the
    profile's step less its host part (kernels, and what terms fitted on async runs left
    unhidden), and the host work whenever it exceeds the device's step."""
    ready_s = chosen_s + host_s
    return ready_s if device_free_s is None or ready_s > device_free_s else device_free_s


CACHE_SAMPLE_S = 0.25         # the prefix cache time line's sampling interval (simulated seconds)

# The no-progress guard (``ProgressGuard``): decisions that compute no token while requests wait or
# run, with nothing changed in between (no request admitted, finished, preempted or arrived), end
# the run once MAX_IDLE_DECISIONS of them come in a row, or SPIN_DECISIONS of them within SPIN_S
# of simulated time (a policy asking to be woken ever again a moment later: no engine's step or
# deadline is that short, and float rounding of a deadline repeats it twice at most).
MAX_IDLE_DECISIONS = 100_000
SPIN_DECISIONS = 100
SPIN_S = 1e-6


class ProgressGuard:
    """Counts a server's decisions that make no progress (the constants above) and raises
    ``PolicyError`` naming the policy and its last decisions when they run on."""

    __slots__ = ("policy", "count", "mark", "since_s", "recent")

    def __init__(self, policy: Policy) -> None:
        self.policy = policy
        self.count = 0                     # decisions in a row with nothing changed
        self.mark: tuple | None = None     # the state's fingerprint when the run of them began
        self.since_s = 0.0
        self.recent: deque[tuple[float, object]] = deque(maxlen=3)

    def check(self, state: SchedulerState, now_s: float, decision: object) -> None:
        mark = state.fingerprint()
        if mark != self.mark:
            self.mark, self.count, self.since_s = mark, 0, now_s
            self.recent.clear()
        self.count += 1
        self.recent.append((now_s, decision))
        if self.count >= MAX_IDLE_DECISIONS or (self.count >= SPIN_DECISIONS and now_s - self.since_s < SPIN_S):
            last = "; ".join(f"{d!r} at t={t:.9g} s" for t, d in self.recent)
            raise PolicyError(f"policy {type(self.policy).__name__} made no progress in {self.count:,} decisions "
                              f"in a row, from t={self.since_s:.9g} s to t={now_s:.9g} s (no token computed, no "
                              f"request admitted, finished or arrived; {len(state.waiting)} waiting, "
                              f"{len(state.running)} running); the last: {last}. It must return work, or Idle "
                              f"with a wake_at_s more than {SPIN_S:g} s ahead, or Idle() to wait for an arrival")

    def reset(self) -> None:
        self.count = 0
        self.mark = None

class Server:
    """One replica driven by SimPy. ``submit`` hands it an arrived request.

    ``coalesce``: run steps that end before the next event back to back
    without a SimPy timeout each, and decode stretches in one go (the fast
    path); True in simulation, False on a wall clock.

    ``check_stretch``: step every iteration of a stretch the fast path
    would run at once, checking each against its plan (``sim.loop.stretch.
    StretchMismatch`` on the first that differs): the policy's
    ``decode_stretch`` and ``stretch_shape`` under test.

    ``on_finish(end_s, req_ids)``, if set before the run starts, is called
    after each step that finished requests, with the step's end time (which
    may lie ahead of ``env.now``: see ``_serve``) and the ids of those it
    finished (a list the callee keeps), and when choosing a step cut requests
    short (``SchedulerState.cut_short``), with its start.
    """

    def __init__(self, env: simpy.Environment, policy: Policy, state: SchedulerState,
                 executor: Executor, replica: int = 0,
                 on_step: Callable[[float, Batch, StepResult], None] | None = None, *,
                 coalesce: bool = True, check_stretch: bool = False, start: bool = True) -> None:
        self.env = env
        self.policy = policy
        self.state = state
        self.executor = executor
        self.replica = replica
        self.dp_size = 1          # the data-parallel ranks of its deployment (sim.loop.feed.vllm_dp_pick)
        # A router's load counts the requests held in ``state.remote.holding`` too (SGLang's
        # bootstrap and prealloc queues: sim.loop.handoff_sglang, whose router counts every
        # request in flight).
        self.counts_held = False
        self.log = StepLog()
        self.on_step = on_step
        self.on_finish: Callable[[float, list[int]], None] | None = None
        # ``on_launch(start_s, batch)``, if set before the run starts: called as each step starts
        # (SGLang's disaggregated prefill sends a cached prefix then: sim.loop.handoff_sglang).
        self.on_launch: Callable[[float, Batch], None] | None = None
        self._wake: simpy.Event | None = None
        self.coalesce = coalesce
        self.check_stretch = check_stretch
        self.num_stretch_steps_checked = 0   # with check_stretch: planned steps stepped and found as planned
        # With a prefix cache: (time, blocks in use, free blocks still cached) after a step, at most
        # one sample per CACHE_SAMPLE_S of simulated time (a million requests stay a few MB).
        self.cache_samples = array("d") if state.kv.caching else None
        self._next_sample_s = 0.0
        # A pipelined loop's commit: vLLM's async scheduling, or SGLang's overlap loop (the policy's
        # ``overlap_loop``), whose results drop what a request retracted since sampled.
        self._commit_pipelined = state.commit_overlap if getattr(policy, "overlap_loop", False) \
            else state.commit_pipelined
        # ``start`` False: another process drives this server's steps (sim.loop.dp's DpGroup).
        self.process = (env.process(self._serve_pipelined() if getattr(policy, "pipelined", False)
                                    else self._serve()) if start else None)

    def _sample_cache(self, now_s: float) -> None:
        if now_s >= self._next_sample_s:
            kv = self.state.kv
            self.cache_samples.extend((now_s, kv.num_used_blocks, kv.num_cached_free_blocks))
            self._next_sample_s = now_s + CACHE_SAMPLE_S

    def submit(self, req: Request, true_output_tokens: int) -> bool:
        accepted = self.state.add_arrival(req, true_output_tokens, self.env.now)
        self.wake()
        return accepted

    def wake(self) -> None:
        if self._wake is not None and not self._wake.triggered:
            self._wake.succeed()

    @property
    def num_outstanding_requests(self) -> int:
        n = len(self.state.waiting) + len(self.state.running)
        return n + len(self.state.remote.holding) if self.counts_held else n

    @property
    def num_outstanding_tokens(self) -> int:
        """Tokens still to compute for queued and running requests (prompt + max_tokens)."""
        queues = (self.state.waiting, self.state.running)
        if self.counts_held:
            queues += (self.state.remote.holding,)
        return sum(r.num_prompt_tokens + r.max_output_tokens - r.num_computed_tokens for q in queues for r in q)

    def _idle(self, decision: Idle, now_s: float, guard: ProgressGuard):
        """The policy chose to wait (a SimPy process fragment: use with ``yield from``): catch
        SimPy up to ``now_s`` if the loop ran ahead on its local clock, else wait for an arrival
        (or the policy's deadline). Returns the time to schedule at, or None when the run is done."""
        env, state = self.env, self.state
        if now_s > env.now:
            yield env.timeout(now_s - env.now)       # catch SimPy up first (now_s stays exact: env.now
            return now_s                             # after the timeout may be an ulp off)
        if state.done:
            return None
        if state.waiting or state.running:
            guard.check(state, now_s, decision)
        elif guard.count:
            guard.reset()
        self._wake = env.event()
        if decision.wake_at_s is not None:
            yield env.any_of([self._wake, env.timeout(max(0.0, decision.wake_at_s - env.now))])
        else:
            yield self._wake
        self._wake = None
        return env.now

    def _not_a_batch(self, decision: object, now_s: float) -> PolicyError:
        return PolicyError(f"policy {type(self.policy).__name__} returned {decision!r} at t={now_s:.9g} s: "
                           f"schedule() returns a Batch or an Idle")

    def _no_progress(self, decision: Batch, now_s: float, guard: ProgressGuard) -> None:
        """A batch that computes nothing (only padding): refused if empty, else counted by the guard."""
        state = self.state
        if not decision.items:
            raise PolicyError(f"policy {type(self.policy).__name__} returned an empty Batch at t={now_s:.9g} s "
                              f"({len(state.waiting)} waiting, {len(state.running)} running): "
                              f"a Batch holds work; return Idle when nothing can run")
        guard.check(state, now_s, decision)

    def _serve(self):  # SimPy process
        env, state, policy, executor, log = self.env, self.state, self.policy, self.executor, self.log
        on_step, on_finish, on_launch = self.on_step, self.on_finish, self.on_launch
        if on_finish is not None:
            state.finished_ids = []        # the state collects the finished requests' ids for it
        # Steps that end before the next scheduled event (an arrival, another
        # replica's step, a deadline) cannot be interleaved with anything, so
        # they run back to back on a local clock without a SimPy timeout each;
        # the server yields to SimPy before anything else can happen. Same
        # results, a fraction of the events. ``coalesce`` is False for a live
        # run (sim.run.runner.drive says which): there the clock is the wall clock.
        coalesce = self.coalesce
        # The fast path (sim.loop.stretch): decode-only stretches up to the next event in one go.
        stretch = (coalesce and (FAST_PATH or self.check_stretch) and on_step is None
                   and type(executor) is SimExecutor and policy.decode_stretch)
        now_s = env.now
        guard = ProgressGuard(policy)
        while True:
            num_preempted, num_admitted = state.num_preemptions, state.num_admissions
            decision = policy.schedule(state, now_s)
            if on_finish is not None and state.finished_ids:
                on_finish(now_s, state.take_finished_ids())                # cut short (SchedulerState.cut_short)
            if type(decision) is Idle:
                now_s = yield from self._idle(decision, now_s, guard)
                if now_s is None:
                    return
                continue
            if type(decision) is not Batch and not isinstance(decision, Batch):
                raise self._not_a_batch(decision, now_s)
            if decision.num_tokens == decision.num_pad_tokens:         # nothing computed: no progress
                self._no_progress(decision, now_s, guard)
            elif guard.count:
                guard.reset()
            start_s = now_s
            result = executor.execute(decision, state)
            if on_launch is not None:
                on_launch(start_s, decision)
            end_s = start_s + result.duration_s
            coalesced = coalesce and end_s < env.peek()
            if not coalesced:
                yield env.timeout(end_s - env.now)
                end_s = env.now
            now_s = end_s
            # The queues and KV the step ran with.
            log.record(start_s, decision, result, len(state.waiting), len(state.running), state.kv.num_used_blocks,
                       state.prefill_items(decision))
            state.commit(decision, end_s)
            if on_step is not None:
                on_step(start_s, decision, result)
            if on_finish is not None and state.finished_ids:
                on_finish(end_s, state.take_finished_ids())
            if self.cache_samples is not None:
                self._sample_cache(end_s)
            # (Only after a step that did not yield: nothing has arrived since it was chosen.)
            if stretch and coalesced:
                # A step that admitted someone may look like a decode step (a prompt found cached
                # but one token computes one token): it is no evidence that the next step repeats.
                changed = state.num_preemptions != num_preempted or state.num_admissions != num_admitted
                now_s = yield from run_decode_stretch(self, decision, changed, now_s, env.peek(),
                                                      chain=on_finish is None)
                if on_finish is not None and state.finished_ids:
                    on_finish(now_s, state.take_finished_ids())
                if self.cache_samples is not None:
                    self._sample_cache(now_s)

    def _serve_pipelined(self):  # SimPy process
        """The loop of a policy that schedules a step while the one before it runs (its
        ``pipelined``: vLLM's async scheduling, ``EngineCore.step_with_batch_queue`` with a queue
        of two; SGLang's ``event_loop_overlap``, its ``overlap_loop``). At each step's end its
        outputs are committed (``SchedulerState.commit_pipelined``, or ``commit_overlap``),
        the step chosen during it starts, and the policy chooses the next one, with that one in
        flight (``state.pending``); with nothing in flight a chosen step starts once its host
        work is done and the next is chosen then. When a step starts, and so when the one before
        it is committed, is the overlap rule (``pipelined_start_s``): the host work of a step
        (``StepResult.duration_s - device_s``) runs beside the device's step before it. The step
        log's rows are the device's: start and device seconds. Steps that end before the next
        event run on a local clock, as in ``_serve``; no decode stretches."""
        env, state, policy, executor = self.env, self.state, self.policy, self.executor
        on_finish = self.on_finish
        if on_finish is not None:
            state.finished_ids = []
        now_s = env.now
        guard = ProgressGuard(policy)
        running = None            # (batch, start_s, end_s, result, log row) of the step on the device
        while True:
            decision = policy.schedule(state, now_s)
            if on_finish is not None and state.finished_ids:
                on_finish(now_s, state.take_finished_ids())
            if type(decision) is Idle:
                if running is not None:            # nothing to queue: let the running step end
                    now_s = yield from self._end_pipelined(running, running[2])
                    running = None
                    continue
                now_s = yield from self._idle(decision, now_s, guard)
                if now_s is None:
                    return
                continue
            if not isinstance(decision, Batch):
                raise self._not_a_batch(decision, now_s)
            if decision.num_tokens == decision.num_pad_tokens:
                self._no_progress(decision, now_s, guard)
            elif guard.count:
                guard.reset()
            # The queues and KV the step is chosen with, and its one-token prefill items, counted now:
            # a request the next choice preempts leaves ``prefilling`` before this step ends.
            row = (len(state.waiting), len(state.running), state.kv.num_used_blocks,
                   state.prefill_items(decision, state.pending[-1] if state.pending else None))
            state.pending.append(decision)
            result = executor.execute(decision, state)
            # The profile's host part of the step (0 where it separates none: the step as before).
            device_s = result.duration_s if result.device_s is None else result.device_s
            start_s = pipelined_start_s(None if running is None else running[2], now_s,
                                        result.duration_s - device_s)
            if running is not None:                # the one before ends, its output is committed
                now_s = yield from self._end_pipelined(running, start_s)
            elif start_s > now_s:                  # the host prepares it, the device idle
                now_s = yield from self._wait_until(start_s)
            if device_s != result.duration_s:      # the log's row: the device's start and seconds
                result = result._replace(duration_s=device_s, predicted_s=device_s)
            running = (decision, now_s, now_s + device_s, result, row)   # starts now; the next is chosen now
            if self.on_launch is not None:
                self.on_launch(now_s, decision)

    def _wait_until(self, t_s: float):
        """Move the clock to ``t_s`` (a SimPy process fragment): on the local clock when
        nothing can happen before it, else by a timeout; returns the time reached."""
        if not (self.coalesce and t_s < self.env.peek()):
            yield self.env.timeout(t_s - self.env.now)
            return self.env.now
        return t_s

    def _end_pipelined(self, running, at_s: float):
        """Wait until ``at_s`` (the running step's end, or later where the host is still busy
        with the step after it: ``pipelined_start_s``), log and commit the step then; return
        that time."""
        batch, start_s, _, result, (num_waiting, num_running, kv_used, prefill_items) = running
        end_s = yield from self._wait_until(at_s)
        self.log.record(start_s, batch, result, num_waiting, num_running, kv_used, prefill_items)
        self._commit_pipelined(batch, end_s)
        if self.on_step is not None:
            self.on_step(start_s, batch, result)
        if self.on_finish is not None and self.state.finished_ids:
            self.on_finish(end_s, self.state.take_finished_ids())
        if self.cache_samples is not None:
            self._sample_cache(end_s)
        return end_s

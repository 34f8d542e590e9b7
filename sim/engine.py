"""The SimPy driver: ``schedule -> execute -> timeout -> commit``, event-driven.

A ``Server`` is one replica: a policy, its ``SchedulerState``, an ``Executor``
and a ``StepLog``. It never polls: when the policy has nothing to run, the
server waits on an arrival event (and the policy's own deadline, if any).
The executor is the only thing that differs between simulation (predicted
duration) and a live run (measured duration). A ``Router`` spreads arrivals
over several servers for fleet simulation. ``feed`` releases open-loop
arrivals at their times; ``feed_capped`` runs a closed-loop client
population, whose send times follow the servers' replies.
"""

from __future__ import annotations

import os
from array import array
from heapq import heappop, heappush
from typing import TYPE_CHECKING, Callable, Collection, Generator, Iterable, Protocol, Sequence

import simpy

from sim.batch import Batch, Idle, StepResult
from sim.logs import StepLog
from sim.request import Request
from sim.stretch import run_decode_stretch

if TYPE_CHECKING:
    from policies.base import Policy
    from sim.profile import Profile
    from sim.state import SchedulerState


# Decode-only stretches between events run in one go (sim.stretch) when the policy allows it.
# False steps every iteration: same results, used by tests/test_fast_path.py to prove it.
FAST_PATH = os.environ.get("BATCHSIM_FAST_PATH", "1") != "0"


class Executor(Protocol):
    """Runs (or predicts) one step.

    execute(batch, state): the step's StepResult; ``duration_s`` is the time
    the step takes on the driving clock (seconds). Called before commit, so
    ``state`` shows the requests as they were when the batch was chosen.
    """

    def execute(self, batch: Batch, state: SchedulerState) -> StepResult: ...


class SimExecutor:
    """Simulation: the step takes what the profile predicts."""

    def __init__(self, profile: Profile) -> None:
        self.profile = profile

    def execute(self, batch: Batch, state: SchedulerState) -> StepResult:
        t = self.profile.step_time_s(batch)
        return StepResult(duration_s=t, predicted_s=t)


class Server:
    """One replica driven by SimPy. ``submit`` hands it an arrived request.

    ``coalesce``: run steps that end before the next event back to back
    without a SimPy timeout each, and decode stretches in one go (the fast
    path); True in simulation, False on a wall clock.

    ``on_finish(end_s, num_finished)``, if set, is called after each step that
    finished requests, with the step's end time (which may lie ahead of
    ``env.now``: see ``_serve``) and how many it finished, and when choosing a
    step cut requests short (``SchedulerState.cut_short``), with its start.
    """

    def __init__(self, env: simpy.Environment, policy: Policy, state: SchedulerState,
                 executor: Executor, replica: int = 0,
                 on_step: Callable[[float, Batch, StepResult], None] | None = None, *,
                 coalesce: bool = True) -> None:
        self.env = env
        self.policy = policy
        self.state = state
        self.executor = executor
        self.replica = replica
        self.log = StepLog()
        self.on_step = on_step
        self.on_finish: Callable[[float, int], None] | None = None
        self._wake: simpy.Event | None = None
        self.coalesce = coalesce
        self.process = env.process(self._serve())

    def submit(self, req: Request, true_output_tokens: int) -> bool:
        accepted = self.state.add_arrival(req, true_output_tokens, self.env.now)
        self.wake()
        return accepted

    def wake(self) -> None:
        if self._wake is not None and not self._wake.triggered:
            self._wake.succeed()

    @property
    def num_outstanding_requests(self) -> int:
        return len(self.state.waiting) + len(self.state.running)

    @property
    def num_outstanding_tokens(self) -> int:
        """Tokens still to compute for queued and running requests (prompt + max_tokens)."""
        return sum(r.num_prompt_tokens + r.max_output_tokens - r.num_computed_tokens
                   for q in (self.state.waiting, self.state.running) for r in q)

    def _serve(self):  # SimPy process
        env, state, policy, executor, log = self.env, self.state, self.policy, self.executor, self.log
        on_step, on_finish = self.on_step, self.on_finish
        # Steps that end before the next scheduled event (an arrival, another
        # replica's step, a deadline) cannot be interleaved with anything, so
        # they run back to back on a local clock without a SimPy timeout each;
        # the server yields to SimPy before anything else can happen. Same
        # results, a fraction of the events. ``coalesce`` is False for a live
        # run (sim.runner.drive says which): there the clock is the wall clock.
        coalesce = self.coalesce
        # The fast path (sim.stretch): decode-only stretches up to the next event in one go.
        stretch = (coalesce and FAST_PATH and on_step is None and type(executor) is SimExecutor
                   and policy.decode_stretch)
        now_s = env.now
        while True:
            num_preempted = state.num_preemptions
            num_finished = state.num_finished if on_finish is not None else 0   # closed loops only
            decision = policy.schedule(state, now_s)
            if on_finish is not None and state.num_finished > num_finished:
                on_finish(now_s, state.num_finished - num_finished)         # cut short (SchedulerState.cut_short)
            if type(decision) is Idle:
                if now_s > env.now:
                    yield env.timeout(now_s - env.now)       # catch SimPy up first
                    continue
                if state.done:
                    return
                self._wake = env.event()
                if decision.wake_at_s is not None:
                    yield env.any_of([self._wake, env.timeout(max(0.0, decision.wake_at_s - env.now))])
                else:
                    yield self._wake
                self._wake = None
                now_s = env.now
                continue
            start_s = now_s
            result = executor.execute(decision, state)
            end_s = start_s + result.duration_s
            coalesced = coalesce and end_s < env.peek()
            if not coalesced:
                yield env.timeout(end_s - env.now)
                end_s = env.now
            now_s = end_s
            log.record(start_s, decision, result, state)     # the queues and KV the step ran with
            num_finished = state.num_finished if on_finish is not None else 0   # closed loops only
            state.commit(decision, end_s)
            if on_step is not None:
                on_step(start_s, decision, result)
            if on_finish is not None and state.num_finished > num_finished:
                on_finish(end_s, state.num_finished - num_finished)
            # (Only after a step that did not yield: nothing has arrived since it was chosen.)
            if stretch and coalesced:
                num_finished = state.num_finished
                now_s = yield from run_decode_stretch(self, decision, state.num_preemptions != num_preempted,
                                                      now_s, env.peek(), chain=on_finish is None)
                if on_finish is not None and state.num_finished > num_finished:
                    on_finish(now_s, state.num_finished - num_finished)


ROUTERS = ("round_robin", "least_requests", "least_tokens")


def pick_replica(router: str, servers: Sequence[Server], counter: int) -> Server:
    """The server that gets the next request."""
    if router == "round_robin" or len(servers) == 1:
        return servers[counter % len(servers)]
    if router == "least_requests":
        return min(servers, key=lambda s: s.num_outstanding_requests)
    if router == "least_tokens":
        return min(servers, key=lambda s: s.num_outstanding_tokens)
    raise ValueError(f"router must be one of {ROUTERS}, got {router!r}")


def feed(env: simpy.Environment, servers: Sequence[Server], requests: Iterable[Request],
         true_output_tokens: Iterable[int], router: str = "round_robin",
         lag_s: float = 0.0):  # SimPy process
    """Release ``requests`` (sorted by arrival; any iterable, such as
    ``sim.runner.RequestStream``, which makes each one as it is released) at
    their arrival times; ``true_output_tokens`` in the same order.

    ``lag_s``: each request reaches its server that long after its arrival,
    which stays the origin of its TTFT: a serving engine's per-request
    overhead (client send to the engine's queue plus the engine's output
    back to the client) when simulating a measured server."""
    for i, (req, true_output) in enumerate(zip(requests, true_output_tokens)):
        delay = req.arrival_s + lag_s - env.now
        if delay > 0:
            yield env.timeout(delay)
        pick_replica(router, servers, i).submit(req, true_output)
    for s in servers:
        s.state.all_arrived = True
        s.wake()


class ClientPool:
    """``num_clients`` closed-loop clients: each sends one request, waits for
    its reply, pauses ``think_time_s`` and may send again.

    ``ready_s`` is a heap of the times at which idle clients may send; a
    client that gets its reply at ``t`` (``release``) is ready at
    ``t + think_time_s``.
    """

    def __init__(self, env: simpy.Environment, num_clients: int, think_time_s: float = 0.0) -> None:
        self.env = env
        self.think_time_s = think_time_s
        self.ready_s = [0.0] * num_clients
        self._released: simpy.Event | None = None
        # Each request's wait for a free client, send - drawn arrival, in release order (vLLM's
        # client_queue_time: the time it waited on the benchmark's semaphore).
        self.waits_s = array("d")

    def release(self, reply_s: float, num_clients: int = 1) -> None:
        """``num_clients`` got their reply at ``reply_s``."""
        for _ in range(num_clients):
            heappush(self.ready_s, reply_s + self.think_time_s)
        if self._released is not None and not self._released.triggered:
            self._released.succeed()

    def acquire(self):  # SimPy process fragment, use with ``yield from``
        """Wait until some client is idle; return the time it may send."""
        while not self.ready_s:
            self._released = self.env.event()
            yield self._released
        return heappop(self.ready_s)


def feed_capped(env: simpy.Environment, servers: Sequence[Server], requests: Collection[Request],
                true_output_tokens: Iterable[int], clients: ClientPool, router: str = "round_robin",
                lag_s: float = 0.0) -> Generator:
    """The SimPy process that releases ``requests`` in order with at most
    ``max_concurrency`` in flight over all ``servers``: a closed-loop client
    population (``vllm bench serve --max-concurrency``, GuideLLM's concurrent
    mode), ``clients`` (``ClientPool(env, min(max_concurrency, len(requests)),
    think_time_s)``; its ``waits_s`` collects each request's wait for a client).
    Hooks the servers' ``on_finish`` now, before the run starts.

    On entry a request's ``arrival_s`` is the earliest it may be sent (0 in a
    closed loop; its drawn arrival when a rate is capped, as vLLM's benchmark
    holds each drawn request on a semaphore). It is sent, in order, at the
    later of that and the time the first client is free (the reply to its
    last request, a finish or a refusal, plus ``think_time_s``), and its
    ``arrival_s`` becomes that send time: TTFT counts from the send, as in
    vLLM's benchmark. ``lag_s`` as in ``feed``.

    A request sent at the very end of a step misses the step that starts
    then: the server picks its next batch before the client has its reply.
    """
    for s in servers:
        s.on_finish = clients.release
    return _release_capped(env, servers, requests, true_output_tokens, clients, router, lag_s)


def _release_capped(env: simpy.Environment, servers: Sequence[Server], requests: Iterable[Request],
                    true_output_tokens: Iterable[int], clients: ClientPool, router: str,
                    lag_s: float):  # SimPy process
    for i, (req, true_output) in enumerate(zip(requests, true_output_tokens)):
        ready_s = yield from clients.acquire()
        send_s = max(ready_s, req.arrival_s)
        delay = send_s + lag_s - env.now
        if delay > 0:
            yield env.timeout(delay)
        clients.waits_s.append(send_s - req.arrival_s)
        req.arrival_s = send_s
        if not pick_replica(router, servers, i).submit(req, true_output):
            clients.release(env.now)          # refused at once: the client has its reply
    for s in servers:
        s.state.all_arrived = True
        s.wake()

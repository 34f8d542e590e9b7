"""Arrivals and routers: ``feed`` releases open-loop arrivals at their times,
``feed_capped`` runs a closed-loop client population (``ClientPool``) whose
send times follow the servers' replies, ``SessionFeed`` runs multi-turn
sessions (each closed, open across), and a router (``ROUTERS``) picks the
server of each request.
"""

from __future__ import annotations

from array import array
from heapq import heappop, heappush
from typing import Callable, Collection, Generator, Iterable, Sequence

import simpy

from sim.core.request import Request
from sim.loop.server import Server


ROUTERS = ("round_robin", "least_requests", "least_tokens", "prefix_aware", "vllm_dp", "sglang_dp")
PREFIX_LOAD_SLACK = 1.25      # prefix_aware's load guard: candidates carry at most this x the least load, + 1


def pick_replica(router: str, servers: Sequence[Server], counter: int, req: Request | None = None) -> Server:
    """The server that gets the next request (``req``: the request, which
    ``prefix_aware`` reads).

    ``prefix_aware`` sends a request to the replica whose prefix cache holds
    the longest prefix of its prompt (whole cached blocks, in use or free,
    ``PrefixCachePool.cached_prefix_blocks``), among the replicas whose
    outstanding requests are at most ``PREFIX_LOAD_SLACK`` times the least
    loaded one's, plus one: the load guard, so a hot prefix does not pile
    its traffic onto one replica. Ties, and a request no replica has cached,
    go to the least loaded candidate (then the lowest index). This is the
    shape of llm-d's precise prefix-cache scorer combined with a load scorer,
    and of vLLM production-stack's prefix-aware routing with its
    load check; their weights and thresholds differ and are not modelled."""
    if router == "round_robin" or len(servers) == 1:
        return servers[counter % len(servers)]
    if router == "vllm_dp":
        return vllm_dp_pick(servers, counter)
    if router == "sglang_dp":
        return sglang_dp_pick(servers, counter)
    if router == "least_requests":
        return min(servers, key=lambda s: s.num_outstanding_requests)
    if router == "least_tokens":
        return min(servers, key=lambda s: s.num_outstanding_tokens)
    if router == "prefix_aware":
        least = min(s.num_outstanding_requests for s in servers)
        cap = PREFIX_LOAD_SLACK * least + 1
        best, best_key = servers[0], None
        for s in servers:
            load = s.num_outstanding_requests
            if load > cap:
                continue
            key = (s.state.kv.cached_prefix_blocks(req) if req is not None else 0, -load)
            if best_key is None or key > best_key:
                best, best_key = s, key
        return best
    raise ValueError(f"router must be one of {ROUTERS}, got {router!r}")


def vllm_dp_pick(servers: Sequence[Server], counter: int) -> Server:
    """vLLM 0.32's data-parallel load balancer (``DPLBAsyncMPClient.get_core_engine_for_request``,
    one API server): each rank scores its requests in flight (waiting + running), plus 6 x its
    waiting ones x how far its KV cache is past half full; the lowest score wins, the scan
    starting one rank further for each request (``eng_start_index``), so ties go round robin.
    NOTE: vLLM scores from the coordinator's snapshot of the ranks (every 100 ms) and its own
    in-flight counts; here from the ranks' state at the request's arrival.

    Several deployments (``servers`` in groups of their ranks' ``dp_size``, each its own API
    server): the deployment with the fewest requests in flight takes it (ties: round robin from
    the request's counter), then its balancer picks the rank."""
    size = getattr(servers[0], "dp_size", 1)
    if 1 < size < len(servers):
        groups = [servers[i:i + size] for i in range(0, len(servers), size)]
        loads = [sum(s.num_outstanding_requests for s in g) for g in groups]
        least = min(loads)
        start = counter % len(groups)
        g = next(groups[(start + i) % len(groups)] for i in range(len(groups))
                 if loads[(start + i) % len(groups)] == least)
        return vllm_dp_pick(g, counter // len(groups))
    n = len(servers)
    best, best_score = servers[counter % n], None
    for i in range(n):
        s = servers[(counter + i) % n]
        state = s.state
        waiting = len(state.waiting)
        score = float(waiting + len(state.running))
        if waiting:
            kv = state.kv
            score += waiting * 6.0 * max(0.0, kv.num_used_blocks / kv.num_blocks - 0.5)
        if best_score is None or score < best_score:
            best, best_score = s, score
    return best


def sglang_dp_pick(servers: Sequence[Server], counter: int) -> Server:
    """SGLang 0.5.23's data-parallel controller (``DataParallelController.round_robin_scheduler``,
    ``load_balance_method`` auto: round robin without disaggregation): the ranks in turn, one
    counter a controller. Several deployments (``servers`` in groups of their ranks' ``dp_size``,
    each its own server): round robin over them (a round-robin load balancer in front, stated:
    SGLang's own router is a separate program), then the deployment's controller's turn, the
    requests it has had so far."""
    size = getattr(servers[0], "dp_size", 1)
    if 1 < size < len(servers):
        groups = len(servers) // size
        g = counter % groups
        return servers[g * size + (counter // groups) % size]
    return servers[counter % len(servers)]


def feed(env: simpy.Environment, servers: Sequence[Server], requests: Iterable[Request],
         true_output_tokens: Iterable[int], router: str = "round_robin",
         lag_s: float = 0.0):  # SimPy process
    """Release ``requests`` (sorted by arrival; any iterable, such as
    ``sim.run.runner.RequestStream``, which makes each one as it is released) at
    their arrival times; ``true_output_tokens`` in the same order.

    ``lag_s``: each request reaches its server that long after its arrival,
    which stays the origin of its TTFT: a serving engine's per-request
    overhead (client send to the engine's queue plus the engine's output
    back to the client) when simulating a measured server."""
    for i, (req, true_output) in enumerate(zip(requests, true_output_tokens)):
        delay = req.arrival_s + lag_s - env.now
        if delay > 0:
            yield env.timeout(delay)
        pick_replica(router, servers, i, req).submit(req, true_output)
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
    def replied(end_s: float, req_ids: list[int]) -> None:
        clients.release(end_s, len(req_ids))

    for s in servers:
        s.on_finish = replied
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
        if not pick_replica(router, servers, i, req).submit(req, true_output):
            clients.release(env.now)          # refused at once: the client has its reply
    for s in servers:
        s.state.all_arrived = True
        s.wake()


class SessionFeed:
    """Multi-turn sessions over ``servers``: closed per session, open across.

    Session s is requests ``sessions[s] .. sessions[s + 1] - 1``, its turns in
    order; ``make(i)`` builds request i and gives its true output length.
    A first turn's ``arrival_s`` on entry is its session's start: it is sent
    then (``release_first_turns``, the SimPy process), or, with ``clients``
    (a ``ClientPool`` of ``max_concurrency`` clients, no think time), at the
    later of that and the moment a client is free: a client runs one session
    at a time and is free at its last turn's reply (vLLM's multi-turn
    benchmark's clients, one conversation each); ``waits_s[i]``, if given,
    gets that wait. Turn k + 1 is sent ``think_time_s`` after turn k's
    reply, never before: the servers' ``on_finish`` (hooked here, before the
    run starts) reports the finish, and a refusal at arrival is a reply too
    (a turn refused for its length is followed by longer ones, refused in
    their turn). Every turn's ``arrival_s`` becomes its send time, which
    TTFT counts from; it reaches its server ``lag_s`` later (as ``feed``'s).
    ``router`` picks each turn's server, in send order.

    As in ``feed_capped``, a turn sent at the very end of a step misses the
    step that starts then.
    """

    def __init__(self, env: simpy.Environment, servers: Sequence[Server],
                 make: Callable[[int], tuple[Request, int]], sessions: Sequence[int], think_time_s: float,
                 router: str = "round_robin", lag_s: float = 0.0, clients: ClientPool | None = None,
                 waits_s: array | None = None) -> None:
        self.env, self.servers, self.make = env, servers, make
        self.first_ids = sessions[:-1]
        self.num_requests = sessions[-1]
        self.think_time_s, self.router, self.lag_s = think_time_s, router, lag_s
        self.clients, self.waits_s = clients, waits_s
        self.is_last = bytearray(self.num_requests)     # the last turn of its session
        for end in sessions[1:]:
            self.is_last[end - 1] = 1
        self.num_sent = 0
        for s in servers:
            s.on_finish = self.replied

    def release_first_turns(self) -> Generator:  # SimPy process
        """Send each session's first turn at its start (or when a client is free)."""
        env, clients, lag_s = self.env, self.clients, self.lag_s
        for i in self.first_ids:
            req, true_output = self.make(i)
            send_s = req.arrival_s
            if clients is not None:
                ready_s = yield from clients.acquire()
                if ready_s > send_s:
                    send_s = ready_s
                if self.waits_s is not None:
                    self.waits_s[i] = send_s - req.arrival_s
            delay = send_s + lag_s - env.now
            if delay > 0:
                yield env.timeout(delay)
            req.arrival_s = send_s
            self._submit(req, true_output)

    def replied(self, reply_s: float, req_ids: list[int]) -> None:
        """Requests ``req_ids`` got their replies at ``reply_s`` (a server's ``on_finish``)."""
        for i in req_ids:
            if not self.is_last[i]:
                self._send_at(i + 1, reply_s + self.think_time_s)
            elif self.clients is not None:
                self.clients.release(reply_s)     # its client takes the next session

    def _send_at(self, i: int, send_s: float) -> None:
        """Send request i (a later turn) at ``send_s`` (>= now), by a timeout's callback."""
        def send(_event: simpy.Event) -> None:
            req, true_output = self.make(i)
            req.arrival_s = send_s
            self._submit(req, true_output)
        self.env.timeout(max(0.0, send_s + self.lag_s - self.env.now)).callbacks.append(send)

    def _submit(self, req: Request, true_output: int) -> None:
        server = pick_replica(self.router, self.servers, self.num_sent)
        self.num_sent += 1
        if not server.submit(req, true_output):
            self.replied(self.env.now, [req.req_id])      # refused at once: its reply
        if self.num_sent == self.num_requests:           # every turn sent: the servers may finish
            for s in self.servers:
                s.state.all_arrived = True
                s.wake()

"""Disaggregated prefill and decode: the KV handoff between a prefill pool and a decode pool,
and the link it crosses.

The handoff is vLLM 0.32's with its NixlConnector (source-first: the decode side pulls), as
its example proxy (``toy_proxy_server.py``) drives it:

1. The proxy sends the request to a prefill instance with ``max_tokens`` 1 (``Handoff.send``).
   The prefill instance runs it as any request: its policy queues, prefills (chunked, prefix
   cached) and samples the one token, which the proxy drops.
2. When it finishes, the prefill instance keeps its blocks (NixlConnector's
   ``request_finished`` answers ``delay_free_blocks``: ``SchedulerState.held``), and the proxy
   sends the request, with its ``max_tokens``, to a decode instance (``proxy_s`` later).
3. The decode instance's scheduler admits it as vLLM's does with an asynchronous KV load
   (``policies.vllm_v1`` rule 9): its local prefix hit is kept, blocks for the rest are
   allocated when they fit, and it waits (WAITING_FOR_REMOTE_KVS) while others run.
4. The blocks allocated, the decode instance reads the KV from the prefill instance
   (``Link``); when the read ends, the decode side sees it at its next scheduling pass
   (``finished_recving``) and the prefill side frees the blocks (``finished_sending``).
5. The decode instance computes the prompt's last token again, samples the first output
   token, and streams the rest: the client's first token comes from the decode side, so TTFT
   is prefill queue + prefill + proxy + decode admission + transfer + the decode's first step.
6. A prefill instance frees KV nobody read within ``abort_timeout_s`` of its finish
   (``VLLM_NIXL_ABORT_REQUEST_TIMEOUT``, 480 s); a decode instance that had not yet taken
   blocks for that request then computes its prompt itself.

The link (``Link``): each instance's GPUs have a NIC (or NVLink port) of ``bandwidth_gbps``
each way; a transfer between a prefill instance of TP p and a decode instance of TP d moves
``tokens x kv_bytes_per_token`` (the decode side's layout, all ranks) over min(p, d) ports in
parallel, so alone it takes ``latency + bytes / (min(p, d) x bandwidth)``. Transfers that share
an instance share its ports: each runs at the least of its two ends' capacity divided by the
transfers at that end (an equal share at each end, recomputed whenever a transfer starts or
ends; not max-min fair, which would hand a transfer's unused share to the others).

Not modelled: layer-by-layer transfer overlapping the prefill (NixlConnector reads after it),
a failed read, KV offload tiers, multi-hop networks, KV converted between precisions.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import simpy

from sim.core.request import Request, RequestRecords, Status
from sim.core.state import RemoteKv
from sim.loop.feed import ClientPool, pick_replica
from sim.loop.server import Server


@dataclass(frozen=True, slots=True)
class LinkSpec:
    """Each GPU's port: gigabits per second each way, and the latency before the data flows."""

    bandwidth_gbps: float
    latency_us: float

    @property
    def bytes_per_s(self) -> float:
        return self.bandwidth_gbps * 1e9 / 8


class Link:
    """The transfers in flight between instances, sharing each instance's ports.

    ``start(t_s, key, src, dst, num_bytes, lanes)`` begins a transfer at ``t_s`` (not before
    ``env.now``) from instance ``src`` to instance ``dst`` (any hashable ids), over ``lanes``
    ports each way; ``on_done(key, end_s)`` is called when its last byte is in. ``capacity``
    maps an instance to its ports' bytes per second in all (ports x bandwidth)."""

    def __init__(self, env: simpy.Environment, spec: LinkSpec, capacity: dict, on_done) -> None:
        self.env, self.spec, self.capacity, self.on_done = env, spec, capacity, on_done
        self.active: dict[object, list] = {}    # key -> [src, dst, bytes left, rate, lanes]
        self._updated_s = 0.0
        self._version = 0
        self.bytes_moved: dict = {}             # instance -> bytes sent or received
        self.busy_s: dict = {}                  # instance -> seconds with a transfer at it
        self.samples = array("d")               # (time, transfers in flight) at each change

    def start(self, t_s: float, key: object, src: object, dst: object, num_bytes: float, lanes: int) -> None:
        delay = t_s - self.env.now + self.spec.latency_us * 1e-6
        ev = self.env.timeout(max(0.0, delay))
        ev.callbacks.append(lambda _ev: self._begin(key, src, dst, num_bytes, lanes))

    def _advance(self) -> None:
        now = self.env.now
        dt = now - self._updated_s
        if dt > 0 and self.active:
            ends = set()
            for t in self.active.values():
                t[2] -= t[3] * dt
                ends.add(t[0])
                ends.add(t[1])
            for e in ends:
                self.busy_s[e] = self.busy_s.get(e, 0.0) + dt
        self._updated_s = now

    def _rates(self) -> None:
        count: dict = {}
        for src, dst, *_ in self.active.values():
            count[src] = count.get(src, 0) + 1
            count[dst] = count.get(dst, 0) + 1
        per_port = self.spec.bytes_per_s
        for t in self.active.values():
            src, dst, lanes = t[0], t[1], t[4]
            t[3] = min(per_port * lanes, self.capacity[src] / count[src], self.capacity[dst] / count[dst])
        self.samples.extend((self.env.now, float(len(self.active))))

    def _begin(self, key, src, dst, num_bytes: float, lanes: int) -> None:
        self._advance()
        for end in (src, dst):
            self.bytes_moved[end] = self.bytes_moved.get(end, 0.0) + num_bytes
        if num_bytes <= 0:
            self.on_done(key, self.env.now)
            return
        self.active[key] = [src, dst, float(num_bytes), 0.0, lanes]
        self._reschedule()

    def _reschedule(self) -> None:
        self._rates()
        self._version += 1
        if not self.active:
            return
        wait = min(t[2] / t[3] for t in self.active.values())
        version = self._version
        ev = self.env.timeout(max(0.0, wait))
        ev.callbacks.append(lambda _ev: self._tick(version))

    def _tick(self, version: int) -> None:
        if version != self._version:
            return                          # a start or end since rescheduled it
        self._advance()
        done = [k for k, t in self.active.items() if t[2] <= 1e-6 * max(1.0, t[3])]
        if not done:                        # float rounding: the least left ends now
            done = [min(self.active, key=lambda k: self.active[k][2])]
        for k in done:
            del self.active[k]
        self._reschedule()
        for k in done:
            self.on_done(k, self.env.now)


class HandoffBase:
    """What every handoff holds and gives ``sim.run.disagg``: the pools, the link between them
    (each instance's ports: ``link.bytes_per_s`` x its TP), per request (by id, NaN where none
    happened) the prefill's end, the decode side's send, the transfer's start and end, its
    tokens and prefill replica, the requests the prefill side refused, the KV held for transfer
    (``held_samples``: time, prefill replica, blocks) and a closed loop's replies."""

    kind = "vllm"                 # which engine's handoff (sim.run.disagg reads its phases by it)

    def __init__(self, env: simpy.Environment, prefill: Sequence[Server], decode: Sequence[Server],
                 routers: tuple[str, str], link: LinkSpec, kv_bytes_per_token: int, tp: tuple[int, int],
                 num_requests: int, clients: ClientPool | None, on_done) -> None:
        self.env, self.prefill, self.decode = env, list(prefill), list(decode)
        self.routers = routers
        self.kv_bytes_per_token = kv_bytes_per_token
        self.lanes = min(tp)
        self.clients = clients
        capacity = {("p", s.replica): link.bytes_per_s * tp[0] for s in self.prefill}
        capacity.update({("d", s.replica): link.bytes_per_s * tp[1] for s in self.decode})
        self.link = Link(env, link, capacity, on_done)
        nan = np.full(num_requests, np.nan)
        self.prefill_done_s, self.decode_sent_s = nan.copy(), nan.copy()
        self.transfer_start_s, self.transfer_end_s = nan.copy(), nan.copy()
        self.transfer_tokens = np.zeros(num_requests, np.int64)
        self.prefill_replica = np.full(num_requests, -1, np.int64)
        self.failed = RequestRecords()           # refused by the prefill side: the client's reply
        self.num_timeouts = 0
        self.held_samples = array("d")           # (time, prefill replica, blocks held) at each change
        self._held_blocks = {s.replica: 0 for s in self.prefill}
        self.num_requests = num_requests

    def _replied(self, end_s: float, ids: list[int]) -> None:
        for _ in ids:
            self.clients.release(end_s)

    def held_timeline(self) -> np.ndarray:
        return np.frombuffer(self.held_samples, dtype=np.float64).reshape(-1, 3)

    def link_timeline(self) -> np.ndarray:
        return np.frombuffer(self.link.samples, dtype=np.float64).reshape(-1, 2)


class Handoff(HandoffBase):
    """The proxy and the KV handoff between ``prefill`` and ``decode`` servers (the module
    doc's steps). ``kv_bytes_per_token``: the decode side's KV per token, all ranks;
    ``tp``: (prefill TP, decode TP). Per request it records (by id): the prefill instance's
    finish, the decode submission, the transfer's start and end (NaN where none happened)."""

    # The prefill copy's max_tokens: 1 (vLLM's proxy), or the client's, the copy still ending
    # after its first token (TensorRT-LLM's context_only request: sim.loop.handoff_trtllm).
    prefill_keeps_max_tokens = False

    def __init__(self, env: simpy.Environment, prefill: Sequence[Server], decode: Sequence[Server],
                 routers: tuple[str, str], link: LinkSpec, kv_bytes_per_token: int, tp: tuple[int, int],
                 num_requests: int, *, proxy_s: float = 0.0, abort_timeout_s: float = 480.0,
                 clients: ClientPool | None = None) -> None:
        super().__init__(env, prefill, decode, routers, link, kv_bytes_per_token, tp, num_requests, clients,
                         self._received)
        self.proxy_s, self.abort_timeout_s = proxy_s, abort_timeout_s
        self.originals: dict[int, tuple[Request, int]] = {}      # id -> (decode copy, true output)
        self.source: dict[int, Server] = {}                       # id -> prefill server holding its KV
        self.target: dict[int, Server] = {}                       # id -> decode server pulling it
        self._num_prefill_sent = 0
        self._num_decode_sent = 0
        for s in self.prefill:
            s.state.held = {}
            s.on_finish = self._prefilled_at(s)
        for s in self.decode:
            s.state.remote = RemoteKv(self._allocated_at(s))
            s.policy.decode_stretch = False      # a received transfer may admit at any step
            if clients is not None:
                s.on_finish = self._replied

    # ---- 1: the proxy sends the prefill -------------------------------------------------------
    def send(self, req: Request, true_output: int, index: int) -> None:
        """Send ``req`` (the client's request) to a prefill instance, with max_tokens 1."""
        copy = Request(req.req_id, req.arrival_s, req.num_prompt_tokens,
                       req.max_output_tokens if self.prefill_keeps_max_tokens else 1, content=req.content)
        self.originals[req.req_id] = (req, true_output)
        server = pick_replica(self.routers[0], self.prefill, index, copy)
        self.prefill_replica[req.req_id] = server.replica
        self._num_prefill_sent += 1
        if not server.submit(copy, 1):
            # Refused (its length): the client's reply is the refusal, as the prefill side gave it.
            orig, out = self.originals.pop(req.req_id)
            orig.status, orig.reject_reason, orig.finished_s = Status.REJECTED, copy.reject_reason, self.env.now
            self.failed.add(orig, min(out, orig.max_output_tokens))
            self._num_decode_sent += 1
            if self.clients is not None:
                self.clients.release(self.env.now)
            self._maybe_all_sent()

    def all_prefills_sent(self) -> None:
        for s in self.prefill:
            s.state.all_arrived = True
            s.wake()
        self._maybe_all_sent()

    def _maybe_all_sent(self) -> None:
        if self._num_decode_sent == self.num_requests:
            for s in self.decode:
                s.state.all_arrived = True
                s.wake()

    # ---- 2: the prefill finished, the proxy sends the decode ----------------------------------
    def _prefilled_at(self, server: Server):
        def done(end_s: float, ids: list[int]) -> None:
            state = server.state
            for req_id in ids:
                self.prefill_done_s[req_id] = end_s
                self.source[req_id] = server
                held = state.held.get(req_id)
                if held is not None:
                    self._held_blocks[server.replica] += len(held.block_ids)
                ev = self.env.timeout(max(0.0, end_s + self.proxy_s - self.env.now))
                ev.callbacks.append(lambda _ev, i=req_id: self._send_decode(i))
                if self.abort_timeout_s is not None:
                    ev2 = self.env.timeout(max(0.0, end_s + self.abort_timeout_s - self.env.now))
                    ev2.callbacks.append(lambda _ev, i=req_id: self._abort(i))
            self.held_samples.extend((end_s, float(server.replica), float(self._held_blocks[server.replica])))
        return done

    def _send_decode(self, req_id: int) -> None:
        orig, true_output = self.originals.pop(req_id)
        orig.remote_kv = req_id in self.source        # its KV still held (not timed out)
        server = pick_replica(self.routers[1], self.decode, self._num_decode_sent, orig)
        self.target[req_id] = server
        self.decode_sent_s[req_id] = self.env.now
        self._num_decode_sent += 1
        server.submit(orig, true_output)
        self._maybe_all_sent()

    # ---- 3-4: the decode side allocated, the transfer runs ------------------------------------
    def _allocated_at(self, server: Server):
        def allocated(req: Request, num_tokens: int, now_s: float) -> None:
            src = self.source.get(req.req_id)
            if src is None:                      # timed out meanwhile: nothing to read
                server.state.remote.received.add(req.req_id)
                return
            self.transfer_tokens[req.req_id] = num_tokens
            self.transfer_start_s[req.req_id] = now_s
            self.link.start(now_s, req.req_id, ("p", src.replica), ("d", server.replica),
                            num_tokens * self.kv_bytes_per_token, self.lanes)
        return allocated

    def _received(self, req_id: int, end_s: float) -> None:
        self.transfer_end_s[req_id] = end_s
        dst = self.target[req_id]
        dst.state.remote.received.add(req_id)
        dst.wake()
        src = self.source.pop(req_id, None)
        if src is not None:
            self._release(src, req_id, end_s)

    def _release(self, src: Server, req_id: int, t_s: float) -> None:
        held = src.state.held.get(req_id)
        if held is None:
            return
        self._held_blocks[src.replica] -= len(held.block_ids)
        src.state.release_held(req_id)
        self.held_samples.extend((t_s, float(src.replica), float(self._held_blocks[src.replica])))
        src.wake()

    # ---- 6: nobody read it in time ------------------------------------------------------------
    def _abort(self, req_id: int) -> None:
        if not np.isnan(self.transfer_start_s[req_id]):
            return                                 # read (or being read)
        src = self.source.pop(req_id, None)
        if src is None:
            return
        self.num_timeouts += 1
        self._release(src, req_id, self.env.now)
        pending = self.originals.get(req_id)
        if pending is not None:                    # not yet sent to the decode side
            return
        target = self.target.get(req_id)
        if target is not None:                     # queued there without blocks: compute it
            for r in target.state.waiting:
                if r.req_id == req_id:
                    r.remote_kv = False
                    break
            target.wake()



def feed_prefills(env: simpy.Environment, handoff: Handoff, requests, true_outputs,
                  lag_s: float = 0.0):  # SimPy process
    """Release the client's requests at their arrival times to the proxy (``Handoff.send``)."""
    for i, (req, out) in enumerate(zip(requests, true_outputs)):
        delay = req.arrival_s + lag_s - env.now
        if delay > 0:
            yield env.timeout(delay)
        handoff.send(req, out, i)
    handoff.all_prefills_sent()


def feed_prefills_capped(env: simpy.Environment, handoff: Handoff, requests, true_outputs,
                         clients: ClientPool, lag_s: float = 0.0):  # SimPy process
    """As ``feed_prefills`` under a client cap: a request is sent when a client is free (its
    reply is the decode side's last token, or a refusal)."""
    for i, (req, out) in enumerate(zip(requests, true_outputs)):
        ready_s = yield from clients.acquire()
        send_s = max(ready_s, req.arrival_s)
        delay = send_s + lag_s - env.now
        if delay > 0:
            yield env.timeout(delay)
        clients.waits_s.append(send_s - req.arrival_s)
        req.arrival_s = send_s
        handoff.send(req, out, i)
    handoff.all_prefills_sent()

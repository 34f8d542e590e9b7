"""Disaggregated prefill and decode as SGLang 0.5.23 hands a request over (destination-first:
the decode side reserves the KV before the prefill starts). ``sim.loop.handoff`` is vLLM's
(source-first); both pools here run ``policies.sglang``.

The rules, and the SGLang file and function each follows (``sglang/srt/disaggregation/``
unless said):

1. The router sends the request to a prefill instance and a decode instance at once, with the
   same bootstrap room (SGLang's router, sgl-model-gateway, in PD mode; the client's stream is
   the decode instance's). ``SglangHandoff.send``.
2. The prefill instance holds it in its bootstrap queue (``prefill.py``:
   ``PrefillBootstrapQueue``, ``pop_bootstrapped``) until the decode instance has sent the KV
   indices it reserved (``KVPoll.WaitingForInput``); meanwhile it holds no KV. The copy it
   runs has ``max_new_tokens`` 1 (``_process_req``). ``optimistic_prefill_attempts`` is 0 and
   ``disaggregation_decode_allocation_policy`` is ``early`` (their defaults,
   ``arg_groups/fields/disagg.py``): nothing prefills before its reservation.
3. The decode instance's prealloc queue (``decode.py``: ``DecodePreallocQueue.pop_preallocated``,
   at the start of every scheduler pass: ``process_decode_queue``) reserves the prompt's KV
   for the requests in arrival order, stopping at the first that does not fit
   (``DecodeQueues._pop_preallocated``; the headroom rules: ``_allocatable_token_budgets``,
   ``_need_space_for_single_req``, ``_active_req_count``, ``_required_admission_tokens``,
   ``_required_alloc_tokens``, ``BaseTokenToKVPoolAllocator.prealloc_fits`` in
   ``mem_cache/allocator/base.py``), with R = ``num_reserved_decode_tokens`` (512):

   - retractable = the running requests' prompt + output tokens;
   - single = max over the running requests of prompt + min(max_tokens, 4096), less
     retractable (0 with none running);
   - allocatable = the free tokens - max(R x active, single), active = running + in
     transfer + received but not yet running + those reserved earlier in this pass;
   - a request needs max(its prompt in whole pages + R, prompt + min(max_tokens, 4096) -
     retractable), and is reserved if that is at most allocatable;
   - a request slot must be free: max_running_requests, plus
     ``disaggregation_decode_extra_slots`` (2 x max_running_requests when that is given and
     at most 32, else 0: ``arg_groups/pd_disaggregation_hook.py``), less the requests running,
     in transfer or received (``DecodeReqToTokenPool``);
   - while a retracted request waits, nothing is reserved (``process_decode_queue``).

   The decode instance's radix cache is off (``handle_pd_disaggregation`` sets
   ``disable_radix_cache`` unless ``disaggregation_decode_enable_radix_cache``): the whole
   prompt is reserved and sent.
4. The prefill instance runs it as ``policies.sglang`` runs any request (its queue, radix
   cache, chunked prefill, overlap loop). After each chunk it sends the KV computed so far in
   whole pages (``send_kv_chunk``: the last partial page waits for the next send; in
   ``process_prefill_chunk``, or with the overlap loop in
   ``process_batch_result_disagg_prefill``: at the chunk's end here), so the transfer of
   early chunks overlaps the later chunks' compute. A prefix found in its radix cache is sent
   as the step that computes the rest starts (``maybe_send_cached_prefix_chunk``, from
   ``Scheduler.run_batch``; ``SGLANG_DISAGG_PREFILL_EARLY_SEND_CACHED_PREFIX`` is on by
   default). The last chunk samples the first output
   token, and the rest of the prompt's KV goes with the metadata holding that token
   (``set_buf``). Each send is a transfer over ``sim.loop.handoff.Link``.
5. The prefill instance keeps the request's KV until every send is in
   (``process_disagg_prefill_inflight_queue``: ``KVPoll.Success``, then ``release_kv_cache``,
   into its radix tree).
6. The decode instance's transfer queue (``DecodeTransferQueue.pop_transferred``) sees the
   transfer done at its next pass; the request gets the prefill's first token
   (``_commit_transfer_to_req``) and joins the running batch as a prebuilt batch
   (``_get_new_prebuilt_batch``, at most max_running_requests running; the others wait with
   their KV), whose result streams that token at once (``process_batch_result_prebuilt``):
   the client's first token comes from the decode instance at that pass, with no step of its
   own; the prompt's last token is not computed again. Its next decode step computes the
   second token.

So TTFT = decode reservation (bootstrap) + prefill queue + prefill + the transfer after the
prefill's end + the wait for the decode's next pass.

Not modelled: the bootstrap handshake's own messages (no time), the prefill side's poll of its
inflight queue (once a pass in SGLang: here its KV is freed when the last send is in), metadata buffers
(``req_to_metadata_buffer_idx_allocator``), a failed or aborted transfer, the decode radix
cache and HiCache, host-side receive, the ``prefill_complete`` allocation policy, optimistic
prefill; a retracted decode request is recomputed locally (SGLang backs its KV up to host
memory and restores it: ``resume_retracted_reqs``).
"""

from __future__ import annotations

from collections import deque
from typing import Sequence

import numpy as np
import simpy

from sim.core.request import Request, Status
from sim.core.state import RemoteKv, SchedulerState
from sim.loop.feed import ClientPool, pick_replica
from sim.loop.handoff import HandoffBase, LinkSpec
from sim.loop.server import Server

NUM_RESERVED_DECODE_TOKENS = 512        # --num-reserved-decode-tokens (arg_groups/fields/disagg.py)
# SGLANG_CLIP_MAX_NEW_TOKENS_ESTIMATION, decode.py's CLIP_MAX_NEW_TOKEN (policies.sglang_adder has
# the same for the PrefillAdder; sim.loop imports no policy).
CLIP_MAX_NEW_TOKENS = 4096


def extra_decode_slots(max_running_requests: int | None) -> int:
    """``disaggregation_decode_extra_slots`` unset (``handle_pd_disaggregation``): 2 x the
    per-worker max_running_requests when it is given and at most 32, else 0."""
    if max_running_requests is not None and max_running_requests <= 32:
        return 2 * max_running_requests
    return 0


class DecodeQueues:
    """A decode instance's prealloc and transfer queues (rules 3 and 6 of the module doc), run
    by ``policies.sglang`` at the start of each pass (its ``pd_decode``). The requests queued
    here sit in ``state.remote.holding`` (not in ``waiting``: the decode side prefills nothing);
    ``state.remote.received`` holds those whose KV is in."""

    def __init__(self, handoff: SglangHandoff, server: Server, reserved_tokens: int) -> None:
        self.handoff, self.server = handoff, server
        self.reserved_tokens = reserved_tokens
        policy = server.policy
        self.extra_slots = extra_decode_slots(policy.config.max_running_requests)
        self.prealloc: deque[Request] = deque()     # DecodePreallocQueue.queue
        self.transfer: list[Request] = []           # DecodeTransferQueue.queue
        self.ready: list[Request] = []              # received, not yet running (its waiting_queue)

    def required_tokens(self, req: Request, retractable: int) -> int:
        """``_required_admission_tokens`` of a request of no outputs yet, no decode prefix."""
        bs = self.server.state.kv.block_size
        alloc = -(-req.num_prompt_tokens // bs) * bs                      # _required_alloc_tokens
        return max(alloc + self.reserved_tokens,
                   req.num_prompt_tokens + min(req.max_output_tokens, CLIP_MAX_NEW_TOKENS) - retractable)

    def never_fits(self, req: Request) -> bool:
        """Whether ``req`` could not be reserved even on an empty pool (SGLang would wait for
        ever: it is refused here instead)."""
        return self.required_tokens(req, 0) > self.server.state.kv.capacity_tokens

    def process_decode_queue(self, state: SchedulerState, now_s: float) -> None:
        if not any(r.status == Status.PREEMPTED for r in state.waiting):    # retracted: none reserved
            self._pop_preallocated(state, now_s)
        self._pop_transferred(state, now_s)

    def _pop_preallocated(self, state: SchedulerState, now_s: float) -> None:
        if not self.prealloc:
            return
        kv, running, policy = state.kv, state.running, self.server.policy
        retractable = sum(r.num_prompt_tokens + r.num_output_tokens for r in running)
        single = (max(min(r.max_output_tokens, CLIP_MAX_NEW_TOKENS) + r.num_prompt_tokens for r in running)
                  - retractable) if running else 0
        active = len(running) + len(self.transfer) + len(self.ready) + len(state.waiting)
        slots = policy.max_num_seqs + self.extra_slots
        reserved = 0
        while self.prealloc:
            if active + reserved >= slots:
                break                                     # req_to_token_pool.available_size() <= 0
            req = self.prealloc[0]
            allocatable = kv.num_free_tokens - max(self.reserved_tokens * (active + reserved), single)
            if self.required_tokens(req, retractable) > allocatable:
                break
            self.prealloc.popleft()
            kv.allocate(req, req.num_prompt_tokens)       # _pre_alloc: fill_len = the prompt
            self.transfer.append(req)
            reserved += 1
            self.handoff.reserved(req, self.server, now_s)

    def _pop_transferred(self, state: SchedulerState, now_s: float) -> None:
        received = state.remote.received
        if received and self.transfer:
            done = [r for r in self.transfer if r.req_id in received]
            if done:
                self.transfer = [r for r in self.transfer if r.req_id not in received]
                self.ready.extend(done)
                for r in done:
                    received.discard(r.req_id)
        if not self.ready:
            return
        room = self.server.policy.max_num_seqs - len(state.running)      # _get_new_prebuilt_batch
        if room <= 0:
            return
        joining, self.ready = self.ready[:room], self.ready[room:]
        for r in joining:
            state.admit_prebuilt(r, now_s)


class SglangHandoff(HandoffBase):
    """The router and the KV handoff between SGLang ``prefill`` and ``decode`` servers (the
    module doc's rules). ``kv_bytes_per_token``: the decode side's KV per token, all ranks;
    ``tp``: (prefill TP, decode TP); ``reserved_tokens``: SGLang's
    ``num_reserved_decode_tokens``. Per request it records (by id, NaN where none happened):
    the decode reservation (``reserved_s``), the prefill's end, the first send's start and the
    last send's end, as ``sim.loop.handoff.Handoff`` does for what ``sim.run.disagg`` reads."""

    kind = "sglang"

    def __init__(self, env: simpy.Environment, prefill: Sequence[Server], decode: Sequence[Server],
                 routers: tuple[str, str], link: LinkSpec, kv_bytes_per_token: int, tp: tuple[int, int],
                 num_requests: int, *, reserved_tokens: int = NUM_RESERVED_DECODE_TOKENS,
                 clients: ClientPool | None = None) -> None:
        super().__init__(env, prefill, decode, routers, link, kv_bytes_per_token, tp, num_requests, clients,
                         self._chunk_in)
        # decode_sent_s: the router's send to the decode side (its arrival); no timeouts: the KV is
        # always read (sim.run.disagg reports num_timeouts all the same)
        self.reserved_s = np.full(num_requests, np.nan)
        self.num_chunks = np.zeros(num_requests, np.int64)
        self._copies: dict[int, tuple[Request, Server]] = {}    # id -> (prefill copy, its instance)
        self._target: dict[int, Server] = {}                    # id -> decode instance
        self._sent: dict[int, int] = {}                         # id -> prompt tokens sent so far
        self._in_flight: dict[int, int] = {}                    # id -> sends not yet in
        self._last_sent: set[int] = set()                       # ids whose last send left
        for s in self.prefill:
            s.state.held = {}
            s.state.remote = RemoteKv(_no_alloc)  # its bootstrap queue (remote.holding)
            s.counts_held = True                  # the router's load counts it
            s.on_step = self._stepped_at(s)
            s.on_launch = self._launched_at(s)
            s.on_finish = self._prefilled_at(s)
        self.queues: dict[int, DecodeQueues] = {}
        for s in self.decode:
            s.state.remote = RemoteKv(_no_alloc)
            s.counts_held = True
            s.policy.decode_stretch = False      # a received transfer may join at any pass
            q = DecodeQueues(self, s, reserved_tokens)
            s.policy.pd_decode = q
            self.queues[s.replica] = q
            if clients is not None:
                s.on_finish = self._replied

    # ---- 1: the router sends the request to both sides ---------------------------------------
    def send(self, req: Request, true_output: int, index: int) -> None:
        now = self.env.now
        copy = Request(req.req_id, req.arrival_s, req.num_prompt_tokens, 1, content=req.content)
        p = pick_replica(self.routers[0], self.prefill, index, copy)
        self.prefill_replica[req.req_id] = p.replica
        if not p.submit(copy, 1):
            # Refused (its length): the client's reply is the prefill side's refusal.
            req.status, req.reject_reason, req.finished_s = Status.REJECTED, copy.reject_reason, now
            self.failed.add(req, min(true_output, req.max_output_tokens))
            self._release_client()
            return
        p.state.waiting.remove(copy)                 # PrefillBootstrapQueue: no KV, not schedulable
        p.state.remote.holding.append(copy)
        d = pick_replica(self.routers[1], self.decode, index, req)
        self._target[req.req_id] = d
        self.decode_sent_s[req.req_id] = now
        q = self.queues[d.replica]
        if q.never_fits(req):
            req.status, req.reject_reason, req.finished_s = Status.REJECTED, "kv_pool", now
            d.state.num_rejected += 1
            d.state.records.add(req, min(true_output, req.max_output_tokens))
            p.state.withdraw(copy, "kv_pool", now)
            self._release_client()
            return
        if not d.submit(req, true_output):
            p.state.withdraw(copy, req.reject_reason, now)
            self._release_client()
            return
        d.state.waiting.remove(req)                  # DecodePreallocQueue
        d.state.remote.holding.append(req)
        q.prealloc.append(req)
        self._copies[req.req_id] = (copy, p)

    def _release_client(self) -> None:
        if self.clients is not None:
            self.clients.release(self.env.now)

    def all_prefills_sent(self) -> None:
        for s in (*self.prefill, *self.decode):
            s.state.all_arrived = True
            s.wake()

    # ---- 2-3: the decode side reserved; the prefill side's bootstrap ends --------------------
    def reserved(self, req: Request, decode: Server, now_s: float) -> None:
        """Called by ``DecodeQueues`` when ``req``'s KV is reserved at ``now_s`` (the decode's
        pass, which may lie ahead of ``env.now``)."""
        self.reserved_s[req.req_id] = now_s
        ev = self.env.timeout(max(0.0, now_s - self.env.now))
        ev.callbacks.append(lambda _ev, i=req.req_id: self._bootstrapped(i))

    def _bootstrapped(self, req_id: int) -> None:
        copy, p = self._copies[req_id]
        p.state.remote.holding.remove(copy)
        p.state.waiting.append(copy)                 # pop_bootstrapped: into its waiting queue
        self._sent[req_id] = 0
        self._in_flight[req_id] = 0
        p.wake()

    # ---- 4: chunk by chunk, the prefill side sends ---------------------------------------------
    def _stepped_at(self, server: Server):
        page = server.state.kv.block_size

        def stepped(start_s: float, batch, result) -> None:
            end_s = start_s + result.duration_s
            sent = self._sent
            for req_id, n, context_len, _pad in batch.items:
                if req_id not in sent or req_id in self._last_sent:
                    continue
                copy = self._copies[req_id][0]
                done = context_len + n
                if n == 0 or done >= copy.num_prompt_tokens:
                    continue                         # the last chunk: sent at its finish
                upto = done // page * page           # whole pages; the partial one waits
                if upto > sent[req_id]:
                    self._send(server, req_id, upto - sent[req_id], end_s)
                    sent[req_id] = upto
        return stepped

    def _launched_at(self, server: Server):
        page = server.state.kv.block_size

        def launched(start_s: float, batch) -> None:
            # maybe_send_cached_prefix_chunk (SGLANG_DISAGG_PREFILL_EARLY_SEND_CACHED_PREFIX, on by
            # default), from run_batch: the prefix found in the prefill's radix cache is sent as the
            # step that computes the rest starts, in whole pages.
            sent = self._sent
            for req_id, n, context_len, _pad in batch.items:
                if req_id in sent and req_id not in self._last_sent and n:
                    upto = context_len // page * page
                    if upto > sent[req_id]:
                        self._send(server, req_id, upto - sent[req_id], start_s)
                        sent[req_id] = upto
        return launched

    def _send(self, server: Server, req_id: int, num_tokens: int, t_s: float) -> None:
        k = int(self.num_chunks[req_id])
        if k == 0:
            self.transfer_start_s[req_id] = t_s
        self.num_chunks[req_id] = k + 1
        self.transfer_tokens[req_id] += num_tokens
        self._in_flight[req_id] += 1
        self.link.start(t_s, (req_id, k), ("p", server.replica), ("d", self._target[req_id].replica),
                        num_tokens * self.kv_bytes_per_token, self.lanes)

    def _prefilled_at(self, server: Server):
        def done(end_s: float, ids: list[int]) -> None:
            state = server.state
            for req_id in ids:
                copy = self._copies[req_id][0]
                self.prefill_done_s[req_id] = end_s
                held = state.held.get(req_id)
                if held is not None:
                    self._held_blocks[server.replica] += len(held.block_ids)
                rest = copy.num_prompt_tokens - self._sent[req_id]
                self._last_sent.add(req_id)
                self._send(server, req_id, rest, end_s)
            self.held_samples.extend((end_s, float(server.replica), float(self._held_blocks[server.replica])))
        return done

    # ---- 5-6: the sends are in ----------------------------------------------------------------
    def _chunk_in(self, key: tuple[int, int], end_s: float) -> None:
        req_id = key[0]
        self._in_flight[req_id] -= 1
        if self._in_flight[req_id] or req_id not in self._last_sent:
            return
        self.transfer_end_s[req_id] = end_s
        copy, p = self._copies.pop(req_id)
        del self._in_flight[req_id], self._sent[req_id]
        self._last_sent.discard(req_id)
        if p.state.held is not None and req_id in p.state.held:
            self._held_blocks[p.replica] -= len(p.state.held[req_id].block_ids)
            p.state.release_held(req_id)
            self.held_samples.extend((end_s, float(p.replica), float(self._held_blocks[p.replica])))
            p.wake()
        d = self._target.pop(req_id)
        d.state.remote.received.add(req_id)
        d.wake()



def _no_alloc(req: Request, num_tokens: int, now_s: float) -> None:
    raise RuntimeError("SGLang's handoff allocates through DecodeQueues, not RemoteKv.on_alloc")

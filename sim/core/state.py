"""SchedulerState: the queues, the KV pool and the one shared ``commit()``.

Policies read the state and call its small set of mutators (``admit``,
``preempt``, ``form_group`` and the block manager's ``allocate``) from inside
``schedule()``; the driver calls ``add_arrival`` and ``commit``. No policy
re-implements token accounting.
"""

from __future__ import annotations

from collections import deque
from typing import Callable, Iterable, Sequence

import numpy as np

from sim.core.batch import Batch
from sim.core.kv import BlockManager
from sim.core.logs import TokenLog
from sim.core.request import Request, RequestRecords, Status
from sim.core.speculative import Speculation


class RemoteKv:
    """A decode instance's requests whose prompt KV another instance computed (disaggregated
    serving, ``sim.loop.handoff``): the scheduler side of vLLM 0.32's KV connector.

    ``holding``: vLLM's ``kv_holding_waiting`` queue, the requests that hold blocks but are
    not running, in order: those whose KV is on its way (``loading``: WAITING_FOR_REMOTE_KVS)
    and those it has reached, promoted but not yet scheduled. ``received``: the loading ones
    whose KV is in (vLLM's ``finished_recving_kv_req_ids``, set by the link when the transfer
    ends). ``on_alloc(req, num_tokens, now_s)``: called when a request's blocks for the
    remote tokens are allocated (the connector's ``update_state_after_alloc``); the transfer
    of ``num_tokens`` tokens may start then."""

    __slots__ = ("holding", "loading", "received", "on_alloc")

    def __init__(self, on_alloc: Callable[[Request, int, float], None]) -> None:
        self.holding: deque[Request] = deque()
        self.loading: set[int] = set()
        self.received: set[int] = set()
        self.on_alloc = on_alloc


class SchedulerState:
    """Everything a policy may look at, plus the bookkeeping of a run.

    ``waiting``: arrived requests not holding KV, FCFS; preempted ones go back
    to the front. ``running``: admitted requests, oldest admission first.
    """

    def __init__(self, kv: BlockManager, max_model_len: int,
                 max_prompt_tokens: int | None = None, *, refuse_by_prompt: bool = False,
                 clamp_max_tokens: bool = False) -> None:
        self.kv = kv
        self.max_model_len = max_model_len
        self.max_prompt_tokens = max_prompt_tokens
        self.refuse_by_prompt = refuse_by_prompt      # the policy's ``refuses_by_prompt``
        self.clamp_max_tokens = clamp_max_tokens      # the policy's ``clamps_max_tokens``
        self.num_clamped = 0                          # requests whose max_tokens the context cut
        # The requests in flight (arrived, not done): the only Request objects a run holds.
        self.requests: dict[int, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.all_arrived = False
        self.num_finished = 0
        self.num_rejected = 0
        self.num_cut_short = 0
        self.num_preemptions = 0
        self.num_admissions = 0              # admit() calls: a resumed request counts again
        # Running requests that have not caught up since their (re)admission: a prompt or a
        # recompute in progress. A one-token item of one is a prefill chunk, as vLLM counts it,
        # though it costs what a decode costs (the step log's counts: prefill_items).
        self.prefilling: set[int] = set()
        # A pipelined loop (a policy's ``pipelined``: vLLM's async scheduling): the batches chosen
        # whose outputs are not yet committed, oldest first; ``commit_pipelined`` takes the oldest.
        self.pending: deque[Batch] = deque()
        # Speculative decoding (sim.core.speculative; the policy's ``speculative``, set by the
        # runner): each request's drafts for its next step, the acceptance draws, the counters.
        self.speculation: Speculation | None = None
        self.num_steps = 0                  # steps committed, a stretch's included (a policy's own clock)
        self._true_output: dict[int, int] = {}
        # The true output length of each request in flight, for the simulator's own
        # bookkeeping (sim.loop.stretch); policies use the explicit oracle_output_tokens.
        self.true_output_tokens = self._true_output
        self._group_of: dict[int, list[Request]] = {}
        # The request of every sampled output token, in time order (sim.core.logs).
        self.tokens = TokenLog()
        # The requests done with, finished or rejected, compact (they leave ``requests``).
        self.records = RequestRecords()
        # The ids of the requests finished (cut short included) since ``take_finished_ids``, for a
        # closed-loop client that waits on them (sim.loop.server.Server.on_finish); None keeps none.
        self.finished_ids: list[int] | None = None
        # Disaggregated serving (sim.loop.handoff). A prefill instance's finished requests whose
        # KV waits to be pulled, by id (``held``: their blocks stay taken until ``release_held``;
        # None: blocks are freed at the finish); a decode instance's requests whose KV comes over
        # the link (``remote``: vLLM's KV connector, scheduler side).
        self.held: dict[int, Request] | None = None
        self.remote: RemoteKv | None = None

    # ---- arrivals -----------------------------------------------------------
    def add_arrival(self, req: Request, true_output_tokens: int, now_s: float) -> bool:
        """Queue an arrived request, or reject it as a real server would.

        A request is rejected (status REJECTED, counted as failed, with its
        ``reject_reason``, see ``sim.core.request.REJECT_REASONS``) when prompt +
        max_tokens exceeds the model's context (vLLM v0's validation; with
        ``clamp_max_tokens``, vLLM 0.32's server, max_tokens is cut to what the
        context leaves and only a prompt that leaves nothing or a max_tokens
        above the context is refused), when its
        prompt exceeds the policy's prompt limit (vLLM v0 ignores such
        prompts), or when it could never fit in the KV pool: with
        ``refuse_by_prompt`` (vLLM v0), when its prompt's blocks exceed the
        pool above the watermark (the block manager's AllocStatus.NEVER);
        else when prompt + max_tokens exceeds the whole pool (the policy
        reserves it at admission, or, vllm_v1, keeps no watermark back from a
        lone request). Returns False if rejected.
        """
        total = req.num_prompt_tokens + req.max_output_tokens
        reason = None
        if self.clamp_max_tokens and total > self.max_model_len:
            # vLLM 0.32's OpenAI server: a prompt that leaves no room for one output token, or a
            # max_tokens above the whole context, is refused (TokenizeParams, the input processor's
            # prompt-length check); any other max_tokens is cut to what the context leaves
            # (get_max_tokens), and the reply ends there with finish_reason "length".
            if req.num_prompt_tokens >= self.max_model_len or req.max_output_tokens > self.max_model_len:
                reason = "model_len"
            else:
                req.max_output_tokens = self.max_model_len - req.num_prompt_tokens
                total = self.max_model_len
                self.num_clamped += 1
        if reason is None:
            if total > self.max_model_len:
                reason = "context"
            elif self.max_prompt_tokens is not None and req.num_prompt_tokens > self.max_prompt_tokens:
                reason = "prompt_limit"
            elif (self.kv.num_blocks_for(req.num_prompt_tokens) > self.kv.num_blocks - self.kv.watermark_blocks
                  if self.refuse_by_prompt else self.kv.num_blocks_for(total) > self.kv.num_blocks):
                reason = "kv_pool"
            else:
                self.requests[req.req_id] = req
                self._true_output[req.req_id] = min(true_output_tokens, req.max_output_tokens)
                self.waiting.append(req)
                return True
        req.status = Status.REJECTED
        req.reject_reason = reason
        req.finished_s = now_s
        self.num_rejected += 1
        self.records.add(req, min(true_output_tokens, req.max_output_tokens))
        return False

    def prefill_items(self, batch: Batch, ahead: Batch | None = None) -> int:
        """The one-token items of ``batch`` that are prefill chunks (of a request in
        ``prefilling``: the last token of a budget, a prompt found cached but its last token,
        the end of a recompute), which ``Batch`` counts as decodes: it sees no request.
        ``ahead``: the batch in flight when ``batch`` was chosen (a pipelined loop), whose item
        for a request may complete its prompt: then the request decodes in ``batch``."""
        prefilling = self.prefilling
        if not prefilling or not batch.decode_seqs:
            return 0
        short = [it[0] for it in batch.items if it[1] == 1 and it[3] == 0 and it[0] in prefilling]
        if short and ahead is not None and ahead.items:
            requests = self.requests
            completes = {it[0] for it in ahead.items if it[0] in requests and it[2] + it[1]
                         == requests[it[0]].num_prompt_tokens + requests[it[0]].num_output_tokens}
            return sum(1 for rid in short if rid not in completes)
        return len(short)

    def take_finished_ids(self) -> list[int]:
        """The ids of the requests finished since the last call, in finish
        order, and a fresh list for the next (``finished_ids`` must be one)."""
        ids, self.finished_ids = self.finished_ids, []
        return ids

    def oracle_output_tokens(self, req: Request) -> int:
        """The true output length. Only oracle options may call this."""
        return self._true_output[req.req_id]

    def fingerprint(self) -> tuple:
        """What a scheduling decision can depend on, in counts: two equal ones at the
        same time mean nothing changed in between (the loop's stall guard)."""
        remote = self.remote
        return (len(self.waiting), len(self.running), self.num_finished, self.num_rejected, self.num_preemptions,
                self.all_arrived, self.kv.num_free_blocks,
                (len(remote.holding), len(remote.received)) if remote is not None else None)

    @property
    def done(self) -> bool:
        return (self.all_arrived and not self.waiting and not self.running
                and (self.remote is None or not self.remote.holding))

    @property
    def num_waiting(self) -> int:
        """Requests waiting to run: the queue, and on a decode instance the held ones (vLLM's
        ``get_request_counts``: ``waiting`` + ``kv_holding_waiting``)."""
        return len(self.waiting) + (len(self.remote.holding) if self.remote is not None else 0)

    def release_held(self, req_id: int) -> None:
        """Free the blocks of a finished request held for a KV transfer (``held``)."""
        self.kv.free(self.held.pop(req_id))

    def admit_remote(self, req: Request, now_s: float) -> None:
        """Move ``req``, whose KV came over the link, from ``remote.holding`` to the running
        list (vLLM: a request promoted from WAITING_FOR_REMOTE_KVS, then scheduled)."""
        holding = self.remote.holding
        if holding and holding[0] is req:
            holding.popleft()
        else:
            holding.remove(req)
        req.status = Status.RUNNING
        if req.first_scheduled_s is None:
            req.first_scheduled_s = now_s
        self.running.append(req)
        self.num_admissions += 1
        self.prefilling.add(req.req_id)

    def park_remote(self, req: Request) -> None:
        """Move waiting ``req``, its blocks allocated for a KV transfer, to ``remote.holding``
        (the caller puts it back in order): vLLM's WAITING_FOR_REMOTE_KVS, its computed tokens
        all it knows. Its transfer is asked once: a later recompute computes locally."""
        if self.waiting and self.waiting[0] is req:
            self.waiting.popleft()
        else:
            self.waiting.remove(req)
        req.num_computed_tokens = req.num_prompt_tokens + req.num_output_tokens
        req.remote_kv = False
        self.remote.loading.add(req.req_id)

    def admit_prebuilt(self, req: Request, now_s: float) -> None:
        """Move ``req``, held (``remote.holding``) with its prompt's KV received and its first
        output token sampled by the prefill instance, into the running list with that token
        streamed now (SGLang's decode side: ``_get_new_prebuilt_batch`` and
        ``process_batch_result_prebuilt``; ``sim.loop.handoff_sglang``). Its next step decodes
        the second token; a request of one output token finishes here."""
        self.remote.holding.remove(req)
        req.status = Status.RUNNING
        if req.first_scheduled_s is None:
            req.first_scheduled_s = now_s
        req.num_computed_tokens = req.num_prompt_tokens
        self.running.append(req)
        self.num_admissions += 1
        self.deliver_first_tokens([req], now_s)

    def deliver_first_tokens(self, reqs: list[Request], now_s: float) -> None:
        """The first output token of each of ``reqs`` (running, their prompt computed and their
        first token sampled by another instance: TensorRT-LLM's ``first_gen_tokens``,
        ``policies.tensorrt_llm_disagg``; SGLang's prebuilt batch, ``admit_prebuilt``), streamed
        now in one chunk; a request whose output is
        that token alone finishes here (the engine, not the policy, knows its length)."""
        if not reqs:
            return
        true_output = self._true_output
        finished: list[Request] = []
        for r in reqs:
            self._sample(r, r.req_id, now_s)
            if r.num_output_tokens >= true_output[r.req_id]:
                r.last_token_s = now_s
                finished.append(r)
        self.tokens.end_step(now_s, len(reqs))
        for r in finished:
            self._finish(r, now_s)

    def withdraw(self, req: Request, reason: str, now_s: float) -> None:
        """Refuse ``req``, accepted but not yet run (in ``waiting`` or ``remote.holding``), as
        ``add_arrival`` refuses one: the other side of a disaggregated pair refused it."""
        for q in (self.waiting, self.remote.holding if self.remote is not None else ()):
            if req in q:
                q.remove(req)
        del self.requests[req.req_id]
        true_output = self._true_output.pop(req.req_id)
        req.status = Status.REJECTED
        req.reject_reason = reason
        req.finished_s = now_s
        self.num_rejected += 1
        self.records.add(req, true_output)

    def rewind_remote(self, req: Request, num_computed_tokens: int) -> None:
        """A received request's computed tokens set back (its last prompt token recomputed)."""
        req.num_computed_tokens = num_computed_tokens

    # ---- mutators for policies ---------------------------------------------
    def admit(self, req: Request, now_s: float, num_cached_tokens: int = 0) -> None:
        """Move ``req`` from the waiting queue to the running list, the first
        ``num_cached_tokens`` of its tokens found in the prefix cache (their
        blocks already taken: ``sim.core.prefix.PrefixCachePool.touch``)."""
        if num_cached_tokens:
            if num_cached_tokens > len(req.block_ids) * self.kv.block_size or req.num_computed_tokens:
                raise RuntimeError(f"request {req.req_id}: {num_cached_tokens} cached tokens admitted beyond "
                                   f"its blocks or on top of computed ones")
            req.num_computed_tokens = num_cached_tokens
        if self.waiting and self.waiting[0] is req:
            self.waiting.popleft()
        else:
            self.waiting.remove(req)
        req.status = Status.RUNNING
        if req.first_scheduled_s is None:
            req.first_scheduled_s = now_s
        self.running.append(req)
        self.num_admissions += 1
        self.prefilling.add(req.req_id)

    def preempt(self, req: Request) -> None:
        """Evict ``req`` by recompute: free its KV, put it at the queue's front."""
        self.kv.free(req)
        self.running.remove(req)
        self.prefilling.discard(req.req_id)
        if self.speculation is not None:
            self.speculation.drafts.pop(req.req_id, None)      # vLLM clears its spec_token_ids
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        req.status = Status.PREEMPTED
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    def cut_short(self, req: Request, now_s: float) -> None:
        """End waiting ``req`` now with the output tokens it has: vLLM v0's
        FINISHED_IGNORED for a request that can never be admitted again (after
        a preemption, prompt + the outputs it must recompute need more blocks
        than the pool holds above the watermark). The client gets its response,
        shorter (finish_reason "length"): it counts as finished, its last
        streamed token before ``now_s``."""
        self.waiting.remove(req)
        req.status = Status.FINISHED
        req.finished_s = now_s
        self.num_finished += 1
        self.num_cut_short += 1
        del self._true_output[req.req_id]
        self.records.add(req, req.num_output_tokens)
        del self.requests[req.req_id]
        if self.finished_ids is not None:
            self.finished_ids.append(req.req_id)

    def form_group(self, reqs: Iterable[Request]) -> None:
        """Static batching: members finish and free KV together, when the last
        of them has produced its last token (nothing returns before)."""
        group = list(reqs)
        for r in group:
            self._group_of[r.req_id] = group

    # ---- the shared commit --------------------------------------------------
    def commit(self, batch: Batch, now_s: float) -> None:
        """Advance every request in ``batch`` after a step that ended at ``now_s``.

        Adds each item's new tokens to ``num_computed_tokens``; a request that
        has caught up samples one output token (stamped ``now_s`` in the token
        log; ``last_token_s`` is set when the last one is sampled); a request
        with all its output tokens finishes and frees its blocks (for a static
        group: when the whole group is done).
        """
        if self.speculation is not None:
            return self._commit_speculative(batch, now_s)
        self.num_steps += 1
        requests = self.requests
        true_output = self._true_output
        tokens = self.tokens
        tok_ids = tokens.ids
        tok_ids_append = tok_ids.append
        num_logged = len(tok_ids)
        prefilling = self.prefilling
        finished: list[Request] | None = None
        for req_id, n, context_len, _pad in batch.items:
            if n == 0:
                continue
            r = requests[req_id]
            if context_len != r.num_computed_tokens:
                raise RuntimeError(f"batch item for request {req_id} has context_len {context_len}, "
                                   f"but {r.num_computed_tokens} tokens are computed")
            computed = context_len + n
            r.num_computed_tokens = computed
            known = r.num_prompt_tokens + r.num_output_tokens
            if computed < known:
                continue
            if computed > known:
                raise RuntimeError(f"request {req_id} computed past its known tokens")
            r.num_output_tokens += 1
            tok_ids_append(req_id)
            if prefilling and req_id in prefilling:
                prefilling.discard(req_id)
            if r.first_token_s is None:
                r.first_token_s = now_s
            if r.num_output_tokens >= true_output[req_id]:
                r.last_token_s = now_s
                if finished is None:
                    finished = []
                finished.append(r)
        if len(tok_ids) > num_logged:
            tokens.end_step(now_s, len(tok_ids) - num_logged)
        if finished:
            for r in finished:
                self._finish(r, now_s)

    def _commit_speculative(self, batch: Batch, now_s: float) -> None:
        """``commit`` with speculative decoding (vLLM's ``Scheduler.update_from_output`` with
        drafts). An item that verifies d drafts (``batch.drafts``) computed the request's next
        token and the d drafts: the step accepts a of them (``Speculation.accepted``), the
        request samples a + 1 tokens (the accepted drafts and the bonus token; fewer if its
        output ends among them, as vLLM's stop check trims them) and its computed tokens roll
        back by the d - a rejected; their KV slots stay allocated, as in vLLM. An item padded with
        vLLM's placeholder drafts (``Speculation.padded``) accepts none. Every request that
        sampled and still runs gets k drafts for its next step."""
        spec = self.speculation
        k = spec.k
        full = spec.spec.ngram_match_rate >= 1.0
        drafts_next = spec.drafts
        self.num_steps += 1
        requests = self.requests
        true_output = self._true_output
        tok_ids = self.tokens.ids
        num_logged = len(tok_ids)
        prefilling = self.prefilling
        verified = batch.drafts or {}
        padded = spec.padded
        finished: list[Request] = []
        for req_id, n, context_len, _pad in batch.items:
            if n == 0:
                continue
            r = requests[req_id]
            if context_len != r.num_computed_tokens:
                raise RuntimeError(f"batch item for request {req_id} has context_len {context_len}, "
                                   f"but {r.num_computed_tokens} tokens are computed")
            known = r.num_prompt_tokens + r.num_output_tokens
            d = verified.get(req_id, 0)
            computed = context_len + n
            if computed - d > known or (d and computed != known + d):
                raise RuntimeError(f"request {req_id} computed past its known tokens and drafts")
            if computed < known:
                r.num_computed_tokens = computed
                continue
            a = spec.accepted(req_id, r.num_output_tokens, d, padded=req_id in padded) if d else 0
            r.num_computed_tokens = known + a
            self._deliver(r, req_id, a, now_s)
            prefilling.discard(req_id)
            if r.num_output_tokens >= true_output[req_id]:
                r.last_token_s = now_s
                finished.append(r)
            else:
                drafts_next[req_id] = k if full else spec.num_new_drafts()
        padded.clear()
        if len(tok_ids) > num_logged:
            self.tokens.end_step(now_s, len(tok_ids) - num_logged)
        for r in finished:
            drafts_next.pop(r.req_id, None)
            self._finish(r, now_s)

    def commit_pipelined(self, batch: Batch, now_s: float) -> None:
        """``commit`` of the oldest of ``pending`` (``batch``), whose outputs come back while the
        batch chosen after it runs (vLLM's async scheduling: ``AsyncScheduler.update_from_output``).

        Beyond ``commit``: an item of a request that has finished since the batch was chosen (it
        stopped on EOS one step earlier, which the scheduler could not know) was computed and is
        thrown away; an item of a request preempted since (its output is stale) still delivers
        the token it sampled, which the recompute then includes, and may finish the request in
        the waiting queue; a request that sampled registers the full blocks of its tokens whose
        ids are known (computed, the batch after this one's included, less the token that batch
        is sampling) in the prefix cache before it may finish, as ``AsyncScheduler`` does.
        """
        if not self.pending or self.pending[0] is not batch:
            raise RuntimeError("commit_pipelined: the batch is not the oldest pending one")
        if self.speculation is not None:
            return self._commit_pipelined_speculative(batch, now_s)
        self.pending.popleft()
        self.num_steps += 1
        requests = self.requests
        true_output = self._true_output
        tok_ids = self.tokens.ids
        tok_ids_append = tok_ids.append
        num_logged = len(tok_ids)
        prefilling = self.prefilling
        kv = self.kv
        caching = kv.caching
        later: dict[int, int] = {it[0]: it[1] for it in self.pending[0].items} if caching and self.pending else {}
        finished: list[Request] = []
        running = Status.RUNNING
        block_size = kv.block_size
        for req_id, n, context_len, _pad in batch.items:
            if n == 0:
                continue
            r = requests.get(req_id)
            if r is None:
                continue                                   # finished a step earlier: a slot thrown away
            known = r.num_prompt_tokens + r.num_output_tokens
            if (n == 1 and context_len == known - 1 and context_len == r.num_computed_tokens
                    and r.num_output_tokens and r.status == running and req_id not in prefilling):
                r.num_computed_tokens = known              # the hot path: a decode
                r.num_output_tokens += 1
                tok_ids_append(req_id)
                if caching:                                # as below
                    m = later.get(req_id, 0)
                    upto = known + m - (1 if m == 1 else 0)    # less the placeholder of its next token
                    if upto // block_size > r.num_hashed_blocks:
                        kv.cache(r, upto)
                if r.num_output_tokens >= true_output[req_id]:
                    r.last_token_s = now_s
                    finished.append(r)
                continue
            if r.status != running:                        # preempted since: a stale output
                if context_len + n == known:
                    self._sample(r, req_id, now_s)
                    if r.num_output_tokens >= true_output[req_id]:
                        r.last_token_s = now_s
                        self._finish_waiting(r, now_s)
                continue
            if context_len != r.num_computed_tokens:
                raise RuntimeError(f"batch item for request {req_id} has context_len {context_len}, "
                                   f"but {r.num_computed_tokens} tokens are computed")
            computed = context_len + n
            r.num_computed_tokens = computed
            if computed > known:
                raise RuntimeError(f"request {req_id} computed past its known tokens")
            if computed == known:
                self._sample(r, req_id, now_s)
                prefilling.discard(req_id)
                if caching:                                # only where a token came back
                    m = later.get(req_id, 0)
                    ahead = computed + m
                    placeholder = 1 if m and ahead == r.num_prompt_tokens + r.num_output_tokens else 0
                    kv.cache(r, ahead - placeholder)
                if r.num_output_tokens >= true_output[req_id]:
                    r.last_token_s = now_s
                    finished.append(r)
        if len(tok_ids) > num_logged:
            self.tokens.end_step(now_s, len(tok_ids) - num_logged)
        for r in finished:
            self._finish(r, now_s)

    def _commit_pipelined_speculative(self, batch: Batch, now_s: float) -> None:
        """``commit_pipelined`` with drafts (``AsyncScheduler.update_from_output``): a request's
        item that samples accepts a of its d drafts and gets a + 1 tokens; its computed tokens
        roll back by the d - a rejected, whatever its step in flight assumed (the model runner
        places that step's tokens after the accepted ones). A preempted request's stale
        output is still delivered, without the rollback; a finished one's is thrown away. A
        request that sampled registers the full blocks of its known tokens in the prefix
        cache, less the step in flight's placeholders."""
        self.pending.popleft()
        self.num_steps += 1
        spec = self.speculation
        sampled_for, padded = spec.sampling.pop(id(batch), (frozenset(), frozenset()))
        requests = self.requests
        true_output = self._true_output
        tok_ids = self.tokens.ids
        num_logged = len(tok_ids)
        prefilling = self.prefilling
        kv = self.kv
        later = self.pending[0] if self.pending else None
        later_items = {it[0]: it[1] for it in later.items} if later is not None else {}
        later_drafts = (later.drafts or {}) if later is not None else {}
        verified = batch.drafts or {}
        finished: list[Request] = []
        running = Status.RUNNING
        for req_id, n, _context, _pad in batch.items:
            if n == 0:
                continue
            r = requests.get(req_id)
            if r is None:
                continue                                   # finished a step earlier: thrown away
            d = verified.get(req_id, 0)
            if r.status != running:                        # preempted since: a stale output
                if req_id in sampled_for:
                    a = spec.accepted(req_id, r.num_output_tokens, d, padded=req_id in padded) if d else 0
                    self._deliver(r, req_id, a, now_s)
                    if r.num_output_tokens >= true_output[req_id]:
                        r.last_token_s = now_s
                        self._finish_waiting(r, now_s)
                continue
            if req_id not in sampled_for:                  # a prefill chunk
                r.num_computed_tokens += n
                continue
            a = spec.accepted(req_id, r.num_output_tokens, d, padded=req_id in padded) if d else 0
            r.num_computed_tokens += n - (d - a)
            new = self._deliver(r, req_id, a, now_s)
            prefilling.discard(req_id)
            if kv.caching:
                m = later_items.get(req_id, 0)
                known = r.num_prompt_tokens + r.num_output_tokens
                ahead = r.num_computed_tokens + m
                d_l = later_drafts.get(req_id, 0)
                placeholders = 1 + d_l if m and ahead - d_l >= known else 0
                # vLLM counts the tokens its stop check trimmed as placeholders still
                kv.cache(r, min(ahead - placeholders - (a + 1 - new), known))
            if r.num_output_tokens >= true_output[req_id]:
                r.last_token_s = now_s
                finished.append(r)
        if len(tok_ids) > num_logged:
            self.tokens.end_step(now_s, len(tok_ids) - num_logged)
        for r in finished:
            spec.drafts.pop(r.req_id, None)
            self._finish(r, now_s)

    def commit_overlap(self, batch: Batch, now_s: float) -> None:
        """``commit`` of the oldest of ``pending`` (``batch``) in an overlap loop (a policy's
        ``overlap_loop``: SGLang's ``event_loop_overlap``, whose ``process_batch_result`` runs
        after the next batch was launched).

        Beside ``commit``: an item of a request that finished since the batch was chosen (it
        stopped on EOS, which the scheduler could not know) was computed and is thrown away; an
        item of a request retracted since is thrown away too (SGLang skips a retracted request's
        output, ``is_retracted``; the recompute samples that token again); a request that
        finishes while the batch after this one holds an item of it (its wasted token) gives
        back the KV of that item too, and its tokens up to there enter the prefix cache (SGLang's
        ``release_kv_cache`` keeps ``kv_committed_len``, which counts what that batch allocated).
        """
        pending = self.pending
        if not pending or pending[0] is not batch:
            raise RuntimeError("commit_overlap: the batch is not the oldest pending one")
        if self.speculation is not None:
            return self._commit_overlap_speculative(batch, now_s)
        pending.popleft()
        self.num_steps += 1
        requests = self.requests
        true_output = self._true_output
        tok_ids = self.tokens.ids
        tok_ids_append = tok_ids.append
        num_logged = len(tok_ids)
        prefilling = self.prefilling
        finished: list[Request] = []
        running = Status.RUNNING
        for req_id, n, context_len, _pad in batch.items:
            if n == 0:
                continue
            r = requests.get(req_id)
            if r is None or r.status != running:
                continue                                   # finished or retracted since: thrown away
            if context_len != r.num_computed_tokens:
                raise RuntimeError(f"batch item for request {req_id} has context_len {context_len}, "
                                   f"but {r.num_computed_tokens} tokens are computed")
            computed = context_len + n
            r.num_computed_tokens = computed
            known = r.num_prompt_tokens + r.num_output_tokens
            if computed < known:
                continue
            if computed > known:
                raise RuntimeError(f"request {req_id} computed past its known tokens")
            r.num_output_tokens += 1
            tok_ids_append(req_id)
            if prefilling and req_id in prefilling:
                prefilling.discard(req_id)
            if r.first_token_s is None:
                r.first_token_s = now_s
            if r.num_output_tokens >= true_output[req_id]:
                r.last_token_s = now_s
                finished.append(r)
        if len(tok_ids) > num_logged:
            self.tokens.end_step(now_s, len(tok_ids) - num_logged)
        if finished:
            later = {it[0]: it[1] for it in pending[0].items} if pending else {}
            for r in finished:
                r.num_computed_tokens += later.get(r.req_id, 0)   # its wasted item's KV (kv_committed_len)
                self._finish(r, now_s)

    def _commit_overlap_speculative(self, batch: Batch, now_s: float) -> None:
        """``commit_overlap`` with drafts (SGLang's overlap loop with speculative decoding, spec v2:
        ``process_batch_result_decode`` commits ``accept_lens``). A verify item (``batch.drafts``)
        was chosen over the tokens committed then, its request's step before it still in flight,
        so its context is not checked: it verifies the request's last token and d drafts over
        what is committed now (the model places them after the accepted ones), accepts a and
        commits a + 1 tokens (the accepted drafts and the bonus, fewer where the output ends).
        An item of a request finished or retracted since is thrown away, uncounted; a finished
        request's KV is its committed tokens (the batch after this one's slots are over-allocation,
        freed with it). A prefill item is ``commit_overlap``'s."""
        self.pending.popleft()
        self.num_steps += 1
        spec = self.speculation
        requests = self.requests
        true_output = self._true_output
        tok_ids = self.tokens.ids
        num_logged = len(tok_ids)
        prefilling = self.prefilling
        verified = batch.drafts or {}
        finished: list[Request] = []
        running = Status.RUNNING
        for req_id, n, context_len, _pad in batch.items:
            if n == 0:
                continue
            r = requests.get(req_id)
            if r is None or r.status != running:
                continue                                   # finished or retracted since: thrown away
            known = r.num_prompt_tokens + r.num_output_tokens
            d = verified.get(req_id)
            if d is not None:
                if r.num_computed_tokens != known - 1:
                    raise RuntimeError(f"verify item for request {req_id}: {r.num_computed_tokens} tokens "
                                       f"computed, not its {known} known less its last")
                a = spec.accepted(req_id, r.num_output_tokens, d)
                r.num_computed_tokens += a + 1
                self._deliver(r, req_id, a, now_s)
            else:
                if context_len != r.num_computed_tokens:
                    raise RuntimeError(f"batch item for request {req_id} has context_len {context_len}, "
                                       f"but {r.num_computed_tokens} tokens are computed")
                computed = context_len + n
                if computed > known:
                    raise RuntimeError(f"request {req_id} computed past its known tokens")
                r.num_computed_tokens = computed
                if computed < known:
                    continue
                self._sample(r, req_id, now_s)
            prefilling.discard(req_id)
            if r.num_output_tokens >= true_output[req_id]:
                r.last_token_s = now_s
                finished.append(r)
        if len(tok_ids) > num_logged:
            self.tokens.end_step(now_s, len(tok_ids) - num_logged)
        for r in finished:
            spec.drafts.pop(r.req_id, None)
            self._finish(r, now_s)

    def _deliver(self, r: Request, req_id: int, accepted: int, now_s: float) -> int:
        """A verify step's tokens for ``r``: its ``accepted`` drafts and the bonus token, fewer
        where its output ends among them (vLLM's stop check trims the rest); how many."""
        new = min(accepted + 1, self._true_output[req_id] - r.num_output_tokens)
        r.num_output_tokens += new
        self.tokens.ids.extend([req_id] * new)
        if r.first_token_s is None:
            r.first_token_s = now_s
        return new

    def _sample(self, r: Request, req_id: int, now_s: float) -> None:
        r.num_output_tokens += 1
        self.tokens.ids.append(req_id)
        if r.first_token_s is None:
            r.first_token_s = now_s

    def _finish_waiting(self, req: Request, now_s: float) -> None:
        """A preempted request that its stale output finished: it leaves the waiting queue done."""
        self.waiting.remove(req)
        req.status = Status.FINISHED
        req.finished_s = now_s
        self.num_finished += 1
        self.records.add(req, self._true_output.pop(req.req_id))
        del self.requests[req.req_id]
        if self.finished_ids is not None:
            self.finished_ids.append(req.req_id)

    def commit_decode_stretch(self, live: list[Request], ids: Sequence[int], end_times_s: list[float],
                              finishing: list[Request], prefilling: Request | None = None,
                              prefill_tokens: int = 0, completes: bool = False) -> None:
        """``commit`` of ``len(end_times_s)`` consecutive steps, ending at
        those times, that give each of ``live`` (running requests that have
        caught up, in running order; ``ids`` their ids) one token per step:
        the fast path's (``sim.loop.stretch``). The caller ends the stretch no
        later than the step that samples some request's last token;
        ``finishing``, those whose last token the last step samples, finish as
        ``commit`` would finish them. ``prefilling``, if given, computes
        ``prefill_tokens`` of its prompt over the steps, after the decodes of
        each; with ``completes`` the last step completes it, and it samples
        a token then (and finishes if that was its last)."""
        num_steps = len(end_times_s)
        self.num_steps += num_steps
        for r in live:
            r.num_computed_tokens += num_steps
            r.num_output_tokens += num_steps
        p = prefilling
        if p is not None:
            p.num_computed_tokens += prefill_tokens
            known = p.num_prompt_tokens + p.num_output_tokens
            if p.num_computed_tokens != known if completes else p.num_computed_tokens >= known:
                raise RuntimeError(f"request {p.req_id}: a stretch's chunks do not end its prefill as announced")
        kv = self.kv
        if kv.caching:          # the blocks the steps filled, registered as each step's allocation would
            bs = kv.block_size
            for r in (*live, p) if p is not None else live:
                if r.num_computed_tokens // bs > r.num_hashed_blocks:
                    kv.cache(r, r.num_computed_tokens)
        if not completes:
            self.tokens.add_stretch(end_times_s, ids)
        else:
            self.tokens.add_stretch(end_times_s[:-1], ids)
            self.tokens.add_stretch(end_times_s[-1:], [*ids, p.req_id])   # the chunk's item comes last
            p.num_output_tokens += 1
            self.prefilling.discard(p.req_id)
            if p.first_token_s is None:
                p.first_token_s = end_times_s[-1]
            if p.num_output_tokens >= self._true_output[p.req_id]:
                finishing = [*finishing, p]
        if finishing:
            end_s = end_times_s[-1]
            for r in finishing:
                if r.num_output_tokens != self._true_output[r.req_id]:
                    raise RuntimeError(f"request {r.req_id} finished a stretch short of its last token")
                r.last_token_s = end_s
            for r in finishing:
                self._finish(r, end_s)

    def _finish(self, req: Request, now_s: float) -> None:
        req.status = Status.FINISHED
        group = self._group_of.get(req.req_id)
        if group is not None:
            if any(m.status < Status.FINISHED for m in group):
                return                     # hold KV and the result until the last one
            members = group
            for m in members:
                del self._group_of[m.req_id]
        else:
            members = [req]
        held = self.held
        for m in members:
            m.finished_s = now_s
            if held is None:
                self.kv.free(m)
            else:
                held[m.req_id] = m         # its KV waits to be pulled (release_held)
            self.running.remove(m)
            self.prefilling.discard(m.req_id)
            self.num_finished += 1
            self.records.add(m, self._true_output.pop(m.req_id))
            del self.requests[m.req_id]
            if self.finished_ids is not None:
                self.finished_ids.append(m.req_id)

    def token_log(self) -> tuple[np.ndarray, np.ndarray]:
        """(request id, time in s) of every output token so far, in time order."""
        return self.tokens.arrays()

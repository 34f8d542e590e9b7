"""SGLang's ``PrefillAdder`` (``sglang/srt/managers/schedule_policy.py`` and
``mem_cache/prefill_budget.py``'s ``PrefillBudget``, SGLang 0.5.23): the
budgets one prefill pass admits requests under. ``policies.sglang`` drives it.

Budgets, in tokens:

- ``rem_input``: ``max_prefill_tokens`` less the pass's extends (page-ceiled);
- ``rem_chunk``: ``chunked_prefill_size`` likewise (None: chunked prefill off);
  with mixed chunks both start short of the running decodes;
- memory: ``remaining_total`` = free + evictable tokens less ``total_offset``,
  which holds each running request's reservation, ``min(max_tokens - outputs,
  CLIP_MAX_NEW_TOKENS) x new_token_ratio``, and each admitted request's page-
  ceiled extend + one page + its ``min(max_tokens, CLIP_MAX_NEW_TOKENS)`` (none
  for a chunk that leaves part of its prompt); ``remaining_current`` leaves out
  the reservations of outputs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

from sim.core.request import Request

if TYPE_CHECKING:
    from sim.core.radix import Node, RadixCachePool

CLIP_MAX_NEW_TOKENS = 4096          # SGLANG_CLIP_MAX_NEW_TOKENS_ESTIMATION

CONTINUE, NO_TOKEN, OTHER = "continue", "no_token", "other"     # AddReqResult


class Admitted(NamedTuple):
    req: Request
    prefix_tokens: int              # cached tokens (a continuing chunk: those computed)
    extend_tokens: int              # tokens to compute this step
    node: Node | None               # its match's last node, locked (None: a continuing chunk)


class PrefillAdder:
    def __init__(self, kv: RadixCachePool, running: list[Request], new_token_ratio: float,
                 max_prefill_tokens: int, chunk_size: int | None, num_mixed_decode_tokens: int,
                 ratio_one: bool) -> None:
        self.kv = kv
        self.page = kv.block_size
        self.rem_input = max_prefill_tokens - num_mixed_decode_tokens
        self.rem_chunk = None if chunk_size is None else chunk_size - num_mixed_decode_tokens
        ratio = 1.0 if ratio_one else new_token_ratio     # ignore_eos requests reserve in full
        self.total_offset = num_mixed_decode_tokens + sum(
            min(r.max_output_tokens - r.num_output_tokens, CLIP_MAX_NEW_TOKENS) * ratio for r in running)
        self.current_offset = num_mixed_decode_tokens
        self.admitted: list[Admitted] = []
        self.new_chunked: Request | None = None
        self.running = running
        self.req_states: list[tuple[float, int]] | None = None    # add_one_req_ignore_eos's

    def _available(self) -> int:
        kv = self.kv
        return kv.num_free_tokens + kv.tree.evictable_tokens

    @property
    def remaining_total(self) -> float:
        return self._available() - self.total_offset

    def ceil_paged(self, tokens: int) -> int:
        return -(-tokens // self.page) * self.page

    def budget_state(self) -> str:
        available = self._available()
        if available - self.total_offset <= 0 or available - self.current_offset <= 0:
            return NO_TOKEN
        if self.rem_input <= 0 or (self.rem_chunk is not None and self.rem_chunk <= 0):
            return OTHER
        return CONTINUE

    def _reserve(self, extend_tokens: int, max_new_tokens: int) -> None:
        """``_update_prefill_budget`` with ``PrefillBudget.reserve``."""
        extend_tokens = self.ceil_paged(extend_tokens)
        immediate = extend_tokens + self.page
        self.total_offset += immediate + max_new_tokens
        self.current_offset += immediate
        self.rem_input -= extend_tokens
        if self.rem_chunk is not None:
            self.rem_chunk -= extend_tokens

    def add_chunked_req(self, req: Request, prefix: int | None = None) -> Request | None:
        """The next chunk of the request in progress, after its ``prefix`` tokens (default: those
        computed; an overlap loop counts the chunk in flight too); returns it while chunks remain."""
        rem = min(self.rem_chunk, int(self.remaining_total))
        if rem <= 0:
            rem = self.rem_chunk              # it must make progress to give its KV back
        if prefix is None:
            prefix = req.num_computed_tokens
        todo = req.num_prompt_tokens + req.num_output_tokens - prefix
        truncated = todo > rem
        n = min(todo, rem)
        self.admitted.append(Admitted(req, prefix, n, None))
        self._reserve(n, 0 if truncated else min(req.max_output_tokens, CLIP_MAX_NEW_TOKENS))
        return req if truncated else None

    def add_one_req(self, req: Request, prefix: int, node: Node) -> str:
        """Admit waiting ``req`` with ``prefix`` tokens cached up to ``node`` if the budgets allow."""
        tree = self.kv.tree
        max_new = min(max(req.max_output_tokens - req.num_output_tokens, 0), CLIP_MAX_NEW_TOKENS)
        extend = req.num_prompt_tokens + req.num_output_tokens - prefix
        total_tokens = extend + max_new + self.page
        tree.lock(node)                      # the hit is no longer evictable while it is weighed
        try:
            if not total_tokens < self.remaining_total:
                return NO_TOKEN
            if self.rem_chunk is None and self.admitted and self.ceil_paged(extend) >= self.rem_input:
                return OTHER                 # without chunking only the first request may pass the cap
            reserve = min(req.max_output_tokens, CLIP_MAX_NEW_TOKENS)
            chunked = self.rem_chunk is not None and self.ceil_paged(extend) > self.rem_chunk
            if chunked:
                end = (prefix + self.rem_chunk // self.page * self.page) // self.page * self.page
                extend, reserve = end - prefix, 0
                if extend <= 0:
                    return OTHER
                self.new_chunked = req
            tree.lock(node)                  # the request's own lock (req.lock)
            self.admitted.append(Admitted(req, prefix, extend, node))
            self._reserve(extend, reserve)
        finally:
            tree.unlock(node)
        return self.budget_state()

    def add_one_req_ignore_eos(self, req: Request) -> str:
        """SGLang's admission for an ignore_eos request with the cache off: besides the page-ceiled
        prompt + one page, every request's outputs to come (max_tokens - outputs) must fit as the
        requests finish, shortest remaining first, with one token per request to spare."""
        extend = req.num_prompt_tokens + req.num_output_tokens
        paged = self.ceil_paged(extend) + self.page
        available = self._available()
        if paged > min(available - self.current_offset, available - self.total_offset):
            return NO_TOKEN

        def state_of(r: Request) -> tuple[float, int] | None:
            left = r.max_output_tokens * 1.0 - r.num_output_tokens    # ratio 1: ignore_eos
            return (left, r.num_prompt_tokens + r.num_output_tokens) if left > 0 else None

        if self.req_states is None:
            states = [state_of(r) for r in (req, *self.running, *(a.req for a in self.admitted))]
            self.req_states = sorted((s for s in states if s is not None), key=lambda s: s[0])
        elif (new := state_of(req)) is not None:
            states = self.req_states
            i = 0                                  # SGLang's insertion: before the first with as
            for i in range(len(states)):           # many left, else before the last one
                if new[0] <= states[i][0]:
                    break
            states.insert(i, new)
        rem = available - self.current_offset - paged
        freed = 0
        for i, (left, occupied) in enumerate(self.req_states):
            bs = len(self.req_states) - i
            if rem + freed - left * bs <= bs:        # IGNORE_EOS_RESERVE_TOKENS = 1 per request
                return NO_TOKEN
            freed += occupied
        if self.rem_chunk is None or extend <= self.rem_chunk:
            self.admitted.append(Admitted(req, 0, extend, self.kv.tree.root))
            self._reserve(extend, min(req.max_output_tokens, CLIP_MAX_NEW_TOKENS))
        else:
            if self.rem_chunk <= 0:
                return OTHER
            self.admitted.append(Admitted(req, 0, self.rem_chunk, self.kv.tree.root))
            self.new_chunked = req
            self._reserve(self.rem_chunk, 0)
        return self.budget_state()


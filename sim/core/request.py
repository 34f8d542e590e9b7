"""A request and its lifecycle.

Token accounting follows vLLM v1: ``num_tokens = num_prompt_tokens +
num_output_tokens`` are the tokens the request knows; ``num_computed_tokens``
are those whose KV is in the cache. A step computes ``num_new_tokens`` of the
uncomputed ones; when the request has caught up (``num_computed_tokens ==
num_tokens``) a new output token is sampled. A decode step therefore computes
exactly one token (the last sampled one) and samples the next. A request with
N output tokens computes P + N - 1 tokens in all: prefill(P) + (N - 1) decodes.

Preemption by recompute sets ``num_computed_tokens`` back to 0 and frees the
blocks; the request then re-prefills prompt + outputs so far, and samples its
next token when it has caught up, so no token is produced twice.

Only ``SchedulerState.commit`` (and ``preempt``) mutate the counters.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass, field
from enum import IntEnum
from math import nan

import numpy as np


class Status(IntEnum):
    """Ordered: ``status >= Status.FINISHED`` means the request is done."""

    WAITING = 1      # arrived, never scheduled
    RUNNING = 2      # holds KV, is prefilling (num_computed < num_tokens) or decoding
    PREEMPTED = 3    # evicted by recompute, back in the waiting queue
    FINISHED = 4     # produced all its output tokens
    REJECTED = 5     # refused at arrival (longer than the model's context)


# Why a request was refused at arrival, as a real server refuses it.
# (Templates take max_model_len and the policy's prompt limit.)
REJECT_REASONS: dict[str, str] = {
    "context": "prompt + max_tokens > max_model_len {max_model_len}",
    "prompt_limit": "prompt > the policy's prompt limit of {limit} tokens (no chunked prefill: vLLM v0, TensorRT-LLM)",
    "kv_pool": "more KV blocks than the pool holds above the watermark",
    # vLLM 0.32's OpenAI server (a policy's ``clamps_max_tokens``): it cuts a max_tokens that the
    # context cannot hold to what it leaves, and refuses only these.
    "model_len": "prompt >= max_model_len {max_model_len}, or max_tokens > it",
}


@dataclass(slots=True, eq=False)
class Request:
    """One request. Policies read it; only ``SchedulerState`` writes it.

    The true output length is deliberately *not* a field: it lives in the
    ``SchedulerState`` and policies see only ``max_output_tokens`` (the
    client's ``max_tokens``), unless they use the explicit oracle accessor.
    """

    req_id: int
    arrival_s: float
    num_prompt_tokens: int
    max_output_tokens: int
    num_computed_tokens: int = 0
    num_output_tokens: int = 0
    num_preemptions: int = 0
    status: Status = Status.WAITING
    block_ids: list[int] = field(default_factory=list)
    first_scheduled_s: float | None = None
    first_token_s: float | None = None
    last_token_s: float | None = None
    finished_s: float | None = None
    reject_reason: str | None = None     # set when REJECTED: one of REJECT_REASONS
    # Prefix caching (sim.core.prefix): what the prompt holds, (output key, key_0, len_0, ...), None:
    # nothing shared; the chained hashes of its full blocks so far; how many of its blocks are
    # registered in the cache; the prompt tokens its first admission found cached.
    content: tuple[int, ...] | None = None
    block_hashes: list[int] | None = None
    num_hashed_blocks: int = 0
    num_cached_tokens: int = 0
    # Disaggregated serving (sim.loop.handoff): the decode side's copy of a request whose prompt a
    # prefill instance computed; its KV is pulled over the link instead of computed (vLLM's
    # kv_transfer_params with do_remote_prefill, cleared once its blocks are allocated).
    remote_kv: bool = False

    @property
    def num_tokens(self) -> int:
        """Tokens the request knows: prompt plus outputs sampled so far."""
        return self.num_prompt_tokens + self.num_output_tokens

    @property
    def num_uncomputed_tokens(self) -> int:
        """Tokens still to compute before the next token can be sampled."""
        return self.num_prompt_tokens + self.num_output_tokens - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status >= Status.FINISHED


# The reject-reason codes of RequestRecords (0: none; the status column holds the Status).
REASON_CODES = {reason: k for k, reason in enumerate(REJECT_REASONS, start=1)}


class RequestRecords:
    """The requests a server is done with (finished or rejected), one compact
    row each (``array.array`` columns, 62 bytes a request), appended as they
    end. The server then drops the Request object: a run holds objects only
    for the requests in flight, so a million requests fit in memory. A column
    grows in chunks of at most ``CHUNK`` rows: one array grown row by row to
    millions would be moved by ``realloc`` again and again, each move leaving
    a larger hole behind in the heap (a million-request run's loop peaked
    ~30 MB higher); a chunk's holes are small and soon reused. ``pop`` hands
    the columns over to the requests table.
    """

    COLUMNS = (("req_id", "q"), ("arrival_s", "d"), ("prompt_tokens", "i"), ("max_tokens", "i"),
               ("output_tokens", "i"), ("status", "b"), ("reason", "b"), ("first_scheduled_s", "d"),
               ("first_token_s", "d"), ("finished_s", "d"), ("num_preemptions", "i"), ("cached_tokens", "i"))
    CHUNK = 65_536

    def __init__(self) -> None:
        self._columns = {name: array(code) for name, code in self.COLUMNS}    # the chunks being filled
        self._full: dict[str, list[array]] = {name: [] for name, _ in self.COLUMNS}
        self._bind()

    def _bind(self) -> None:
        """The columns' bound ``append``s, which ``add`` calls (each holds its column)."""
        c = self._columns
        self._appends = (c["req_id"].append, c["arrival_s"].append, c["prompt_tokens"].append,
                         c["max_tokens"].append, c["output_tokens"].append, c["status"].append,
                         c["reason"].append, c["first_scheduled_s"].append, c["first_token_s"].append,
                         c["finished_s"].append, c["num_preemptions"].append,
                         c["cached_tokens"].append)

    def __len__(self) -> int:
        return sum(map(len, self._full["req_id"])) + len(self._columns["req_id"])

    def add(self, req: Request, output_tokens: int) -> None:
        """Record ``req`` (FINISHED or REJECTED, ``finished_s`` set); ``output_tokens``
        is its true output length (the oracle's)."""
        (a_id, a_arrival, a_prompt, a_max, a_out, a_status, a_reason,
         a_sched, a_first, a_fin, a_pre, a_cached) = self._appends
        a_id(req.req_id)
        a_arrival(req.arrival_s)
        a_prompt(req.num_prompt_tokens)
        a_max(req.max_output_tokens)
        a_out(output_tokens)
        a_status(req.status)
        a_reason(REASON_CODES[req.reject_reason] if req.reject_reason else 0)
        a_sched(nan if req.first_scheduled_s is None else req.first_scheduled_s)
        a_first(nan if req.first_token_s is None else req.first_token_s)
        a_fin(req.finished_s)
        a_pre(req.num_preemptions)
        a_cached(req.num_cached_tokens)
        if len(self._columns["req_id"]) >= self.CHUNK:
            self._next_chunk()

    def _next_chunk(self) -> None:
        """Put the filled chunks aside and start new ones."""
        for name, code in self.COLUMNS:
            self._full[name].append(self._columns[name])
            self._columns[name] = array(code)
        self._bind()

    def pop(self, name: str) -> np.ndarray:
        """Hand column ``name`` over as one array (its ``array`` typecode's
        dtype) and drop it from the records (an empty one takes its place):
        the requests table takes the columns one at a time, so no column's
        copy sits beside all the others."""
        chunks = [*self._full[name], self._columns[name]]
        self._full[name] = []
        self._columns[name] = array(chunks[0].typecode)
        self._bind()                # else the old append would keep the column alive here
        return np.concatenate([np.frombuffer(c, dtype=np.dtype(c.typecode)) for c in chunks])

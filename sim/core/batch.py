"""The work of one iteration, the same type for every policy.

A prefill, a prefill chunk, a decode and a mixed iteration are all a ``Batch``
of ``BatchItem(req_id, num_new_tokens, context_len)``. The cost model and the
live engine read only this shape; neither ever sees the policy's name.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Sequence


class BatchItem(NamedTuple):
    """Work for one request in one iteration.

    num_new_tokens: tokens computed for the request in this step (>1 prefill
        or chunk, 1 decode, 0 for a finished slot of a static batch).
    context_len: KV tokens present before this step (tokens attended to
        besides the new ones).
    num_pad_tokens: tokens computed and thrown away: a static batch pads every
        prompt to the longest one and keeps decoding finished slots. They cost
        time and occupy no KV beyond the request's reservation.
    """

    req_id: int
    num_new_tokens: int
    context_len: int
    num_pad_tokens: int = 0


class Batch:
    """The items of one iteration, in the order the policy chose.

    The shape the cost model and the step log read is computed once, here:
    an item computing exactly one token (padding included) is a decode, one
    computing more is a prefill chunk. Treat a Batch as immutable. (A plain
    slotted class rather than a frozen dataclass: one is built per simulated
    step, and frozen attribute writes cost several times more.)
    """

    __slots__ = ("items", "num_tokens", "num_prefill_tokens", "num_prefill_seqs", "num_decode_tokens",
                 "num_pad_tokens", "decode_seqs", "decode_context", "prefill_chunks", "drafts", "num_spec_tokens")

    items: tuple[BatchItem, ...]
    num_tokens: int                  # through the token-parallel layers, padding included
    num_prefill_tokens: int          # real prompt/recompute tokens in chunks
    num_prefill_seqs: int
    num_decode_tokens: int           # real decodes
    num_pad_tokens: int
    decode_seqs: int                 # one-token items, padded ones included
    decode_context: int              # sum of their context_len (a padded static group: rows x padded length)
    prefill_chunks: tuple[tuple[int, int], ...]  # (tokens incl. pad, context_len) per chunk
    # Speculative decoding: {request id: drafts verified} for the items that verify drafts (an
    # item of 1 + d tokens: its next token and d drafts; None: no item does). Such an item is a
    # decode (decode_seqs, decode_context; num_decode_tokens counts its 1 + d tokens,
    # num_spec_tokens its d): its 1 + d tokens go through the token-parallel layers and the LM
    # head, and its attention is its decode's, one pass over its KV (decode attention is
    # memory-bound: the d more queries ride along; a profile measured from outside keeps the
    # decode step's fixed cost there, which pricing it as a prefill chunk would drop).
    drafts: dict[int, int] | None
    num_spec_tokens: int

    def __init__(self, items: tuple[BatchItem, ...], drafts: dict[int, int] | None = None) -> None:
        num_tokens = num_prefill = num_decode = num_pad = decode_seqs = decode_context = 0
        chunks = []
        num_spec = 0
        plain = items
        if drafts:                        # verify items: decodes of 1 + d tokens (see ``drafts``)
            plain = [it for it in items if it.req_id not in drafts]
            for it in items:
                d = drafts.get(it.req_id)
                if d is not None:
                    num_tokens += it.num_new_tokens + it.num_pad_tokens
                    num_pad += it.num_pad_tokens
                    decode_seqs += 1
                    decode_context += it.context_len
                    num_decode += it.num_new_tokens
                    num_spec += d
        for it in plain:
            n = it.num_new_tokens
            pad = it.num_pad_tokens
            total = n + pad
            num_tokens += total
            num_pad += pad
            if total == 1:
                decode_seqs += 1
                decode_context += it.context_len
                num_decode += n
            elif total > 1:
                chunks.append((total, it.context_len))
                num_prefill += n
        self.items = tuple(items)
        self.num_tokens = num_tokens
        self.num_prefill_tokens = num_prefill
        self.num_prefill_seqs = len(chunks)
        self.num_decode_tokens = num_decode
        self.num_pad_tokens = num_pad
        self.decode_seqs = decode_seqs
        self.decode_context = decode_context
        self.prefill_chunks = tuple(chunks)
        self.drafts = drafts or None
        self.num_spec_tokens = num_spec

    @classmethod
    def of_decodes(cls, decodes: list[BatchItem], decode_context: int,
                   others: Sequence[BatchItem] = ()) -> Batch:
        """``Batch(decodes + others)`` for plain one-token ``decodes`` (no
        padding) whose summed context is known: only ``others`` are re-read."""
        n = len(decodes)
        if others:
            batch = cls(tuple(others))
            batch.items = tuple(decodes) + batch.items
        else:
            batch = object.__new__(cls)
            batch.items = tuple(decodes)
            batch.num_tokens = batch.num_prefill_tokens = batch.num_prefill_seqs = 0
            batch.num_decode_tokens = batch.num_pad_tokens = batch.decode_seqs = batch.decode_context = 0
            batch.prefill_chunks = ()
            batch.drafts = None
            batch.num_spec_tokens = 0
        batch.num_tokens += n
        batch.num_decode_tokens += n
        batch.decode_seqs += n
        batch.decode_context += decode_context
        return batch

    def __len__(self) -> int:
        return len(self.items)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Batch) and self.items == other.items

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"Batch({self.items!r})"


@dataclass(frozen=True, slots=True)
class Idle:
    """Nothing to run now. ``wake_at_s``: call schedule() again at this time
    even if nothing arrives (dynamic batching's queue-delay deadline)."""

    wake_at_s: float | None = None


class StepResult(NamedTuple):
    """What an executor reports for one step (immutable; a NamedTuple because
    one is made per simulated step).

    duration_s: the step's time on the clock that drives the run (predicted
        in simulation, measured wall time live).
    predicted_s: the cost model's prediction for the same batch, if known.
    device_s: device-side time: measured live (CUDA events); in simulation the
        part of ``duration_s`` that is not the engine's host work, where the
        profile separates it (``Profile.host_s``), else None. A pipelined loop
        runs the rest, ``duration_s - device_s``, beside the step before it
        (sim.loop.server.pipelined_start_s); a synchronous one adds it.
    """

    duration_s: float
    predicted_s: float | None = None
    device_s: float | None = None

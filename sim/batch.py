"""The work of one iteration, the same type for every policy.

A prefill, a prefill chunk, a decode and a mixed iteration are all a ``Batch``
of ``BatchItem(req_id, num_new_tokens, context_len)``. The cost model and the
live engine read only this shape; neither ever sees the policy's name.
"""

from __future__ import annotations

from dataclasses import dataclass, field
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


@dataclass(frozen=True, slots=True)
class Batch:
    """The items of one iteration, in the order the policy chose.

    The shape the cost model and the step log read is computed once, here:
    an item computing exactly one token (padding included) is a decode, one
    computing more is a prefill chunk.
    """

    items: tuple[BatchItem, ...]
    num_tokens: int = field(init=False)           # through the token-parallel layers, padding included
    num_prefill_tokens: int = field(init=False)   # real prompt/recompute tokens in chunks
    num_prefill_seqs: int = field(init=False)
    num_decode_tokens: int = field(init=False)    # real decodes
    num_pad_tokens: int = field(init=False)
    decode_seqs: int = field(init=False)          # one-token items, padded ones included
    decode_context: int = field(init=False)       # sum of their context_len
    prefill_chunks: tuple[tuple[int, int], ...] = field(init=False)  # (tokens incl. pad, context_len)

    def __post_init__(self) -> None:
        num_tokens = num_prefill = num_decode = num_pad = decode_seqs = decode_context = 0
        chunks = []
        for it in self.items:
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
        setattr_ = object.__setattr__
        setattr_(self, "num_tokens", num_tokens)
        setattr_(self, "num_prefill_tokens", num_prefill)
        setattr_(self, "num_prefill_seqs", len(chunks))
        setattr_(self, "num_decode_tokens", num_decode)
        setattr_(self, "num_pad_tokens", num_pad)
        setattr_(self, "decode_seqs", decode_seqs)
        setattr_(self, "decode_context", decode_context)
        setattr_(self, "prefill_chunks", tuple(chunks))

    @classmethod
    def of_decodes(cls, decodes: list[BatchItem], decode_context: int,
                   others: Sequence[BatchItem] = ()) -> Batch:
        """``Batch(decodes + others)`` for plain one-token ``decodes`` (no
        padding) whose summed context is known: only ``others`` are re-read."""
        batch = cls(tuple(others))
        n = len(decodes)
        setattr_ = object.__setattr__
        setattr_(batch, "items", tuple(decodes) + batch.items if others else tuple(decodes))
        setattr_(batch, "num_tokens", batch.num_tokens + n)
        setattr_(batch, "num_decode_tokens", batch.num_decode_tokens + n)
        setattr_(batch, "decode_seqs", batch.decode_seqs + n)
        setattr_(batch, "decode_context", batch.decode_context + decode_context)
        return batch

    def __len__(self) -> int:
        return len(self.items)


@dataclass(frozen=True, slots=True)
class Idle:
    """Nothing to run now. ``wake_at_s``: call schedule() again at this time
    even if nothing arrives (dynamic batching's queue-delay deadline)."""

    wake_at_s: float | None = None


@dataclass(frozen=True, slots=True)
class StepResult:
    """What an executor reports for one step.

    duration_s: the step's time on the clock that drives the run (predicted
        in simulation, measured wall time live).
    predicted_s: the cost model's prediction for the same batch, if known.
    device_s: device-side time (CUDA events) when measured live.
    """

    duration_s: float
    predicted_s: float | None = None
    device_s: float | None = None

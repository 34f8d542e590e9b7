"""The work of one iteration, the same type for every policy.

A prefill, a prefill chunk, a decode and a mixed iteration are all a ``Batch``
of ``BatchItem(req_id, num_new_tokens, context_len)``. The cost model and the
live engine read only this shape; neither ever sees the policy's name.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple


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
    """The items of one iteration, in the order the policy chose."""

    items: tuple[BatchItem, ...]

    @property
    def num_tokens(self) -> int:
        """Tokens through the token-parallel layers, padding included."""
        return sum(it.num_new_tokens + it.num_pad_tokens for it in self.items)

    @property
    def num_prefill_tokens(self) -> int:
        return sum(it.num_new_tokens for it in self.items if it.num_new_tokens > 1)

    @property
    def num_decode_tokens(self) -> int:
        return sum(1 for it in self.items if it.num_new_tokens == 1)

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

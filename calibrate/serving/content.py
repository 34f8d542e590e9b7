"""Token ids for prompts described by content (``workloads.generate.Contents``); torch-free.

A replay against a real server needs token ids where the simulator has only
(key, offset) pairs (``sim.core.prefix``). The rules:

- ``token_ids(keys, offsets, ...)``: token ``(key, offset)`` becomes one id
  in ``[0, vocab_size)`` outside ``avoid`` (the special tokens), a fixed
  function of (key, offset, salt): two splitmix64 rounds, then the remainder
  over the allowed ids. Equal pairs give equal ids, so prompts share exactly
  the blocks their runs share. Different pairs give independent uniform ids,
  so two different blocks of ``b`` tokens get the same ids with probability
  ``(vocab_size - len(avoid)) ** -b`` (4093 ids, 16-token blocks: 10^-57):
  never in practice.
- ``salt``: a replay draws a fresh one (``fresh_salt``), so no replay hits
  the KV blocks an earlier one left in the server's cache: the server starts
  each replay as the simulator starts a run, with nothing of it cached.
- A run whose key is an earlier request's output key (a multi-turn session's
  next turn holds the previous reply) takes the ids the server actually
  generated for that request (``ReplayPlan.prompt``): the server's cache
  holds those, not the map's. Where they are missing (that request failed,
  or was asked for fewer tokens than the run holds, or comes later in the
  order), the map's ids stand in and ``ReplayPlan.fallbacks`` counts it.
- A request without content (``contents`` None) is a run of its own:
  ``sim.core.prefix.own_content``, which shares nothing.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np

from sim.core.prefix import own_content

_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser on a uint64 array (wrapping arithmetic)."""
    x = (x ^ (x >> np.uint64(30))) * _M1
    x = (x ^ (x >> np.uint64(27))) * _M2
    return x ^ (x >> np.uint64(31))


def allowed_ids(vocab_size: int, avoid: Iterable[int] = ()) -> np.ndarray:
    """The ids a prompt may hold: ``0 .. vocab_size - 1`` without ``avoid``; ValueError if none is left."""
    banned = np.array(sorted({int(t) for t in avoid if 0 <= int(t) < vocab_size}), dtype=np.int64)
    ids = np.setdiff1d(np.arange(vocab_size, dtype=np.int64), banned)
    if len(ids) == 0:
        raise ValueError(f"avoid covers the whole vocabulary of {vocab_size} tokens")
    return ids


def token_ids(key: int, offsets: np.ndarray, allowed: np.ndarray, salt: int) -> np.ndarray:
    """The ids of tokens ``(key, offset)`` for ``offsets`` (module doc), as int64."""
    with np.errstate(over="ignore"):
        k = np.array([key], dtype=np.int64).view(np.uint64) ^ np.array([salt], dtype=np.int64).view(np.uint64)
        h = _mix(_mix(k * _GOLDEN) + np.asarray(offsets, dtype=np.int64).view(np.uint64) * _GOLDEN)
    return allowed[(h % np.uint64(len(allowed))).astype(np.int64)]


def fresh_salt() -> int:
    """A salt no earlier replay used (from the OS's random source)."""
    return int.from_bytes(os.urandom(7), "little")


def runs(content: Sequence[int]) -> list[tuple[int, int]]:
    """(key, length) of each prompt run of a ``Request.content``."""
    return [(int(content[i]), int(content[i + 1])) for i in range(1, len(content) - 1, 2)]


@dataclass
class ReplayPlan:
    """The token ids of a replay's prompts (module doc). ``contents[i]``: request i's
    ``Request.content``; ``waits_for[i]``: the earlier requests whose outputs its
    prompt holds (it is sent after their replies); ``wants_ids[i]``: a later
    prompt holds its output, so ask the server for the ids it generates."""

    contents: list[tuple[int, ...]]
    allowed: np.ndarray
    salt: int
    waits_for: list[list[int]]
    wants_ids: list[bool]
    fallbacks: list[str] = field(default_factory=list)   # one line per run the map stood in for

    @classmethod
    def build(cls, contents: Sequence[tuple[int, ...]], vocab_size: int, salt: int,
              avoid: Iterable[int] = ()) -> ReplayPlan:
        owner = {int(c[0]): i for i, c in enumerate(contents)}        # output key -> its request
        waits: list[list[int]] = []
        wants = [False] * len(contents)
        fallbacks = []
        for i, c in enumerate(contents):
            deps = []
            for key, _ in runs(c):
                j = owner.get(key)
                if j is None:
                    continue
                if j >= i:
                    fallbacks.append(f"request {i} holds the output of request {j}, which is not sent "
                                     f"before it: the simulator's ids stand in")
                    continue
                if j not in deps:
                    deps.append(j)
                    wants[j] = True
            waits.append(sorted(deps))
        return cls([tuple(c) for c in contents], allowed_ids(vocab_size, avoid), salt, waits, wants, fallbacks)

    @classmethod
    def of_requests(cls, contents, prompt_tokens: Sequence[int], vocab_size: int, salt: int,
                    avoid: Iterable[int] = ()) -> ReplayPlan:
        """The plan of a workload's requests: ``contents`` (``workloads.generate.Contents``
        or None: every prompt a run of its own) and the prompt lengths."""
        if contents is None:
            cs = [own_content(i, int(p)) for i, p in enumerate(prompt_tokens)]
        else:
            cs = [contents.content(i) for i in range(len(contents))]
        return cls.build(cs, vocab_size, salt, avoid)

    def prompt(self, i: int, outputs: Sequence[Sequence[int] | None] = ()) -> list[int]:
        """Request i's prompt ids; ``outputs[j]``: the ids the server generated for
        request j (None or missing: not known), used for runs of j's output key."""
        owner = {int(self.contents[j][0]): j for j in self.waits_for[i]}
        pieces = []
        for key, length in runs(self.contents[i]):
            j = owner.get(key)
            got = list(outputs[j] or ()) if j is not None and j < len(outputs) else []
            if j is not None and len(got) < length:
                self.fallbacks.append(f"request {i}: the server returned {len(got)} of the {length} output ids "
                                      f"of request {j} that its prompt holds; the simulator's ids stand in for "
                                      f"the rest")
            if j is not None:
                pieces.append(np.asarray(got[:length], dtype=np.int64))
                if len(got) >= length:
                    continue
            start = min(len(got), length) if j is not None else 0
            pieces.append(token_ids(key, np.arange(start, length), self.allowed, self.salt))
        return np.concatenate(pieces).tolist() if pieces else []

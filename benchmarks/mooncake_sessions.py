"""Multi-turn sessions of the Mooncake FAST'25 synthetic trace, as a session file.

    python benchmarks/mooncake_sessions.py TRACE.jsonl workloads/traces/mooncake_sessions.csv

TRACE.jsonl is ``FAST25-release/traces/synthetic_trace.jsonl`` of
``kvcache-ai/Mooncake`` (Apache-2.0; SHA-256 below): one request per line,
``timestamp`` (ms), ``input_length``, ``output_length`` and ``hash_ids``, the
ids of the prompt's 512-token blocks (the last one partial unless the prompt
is a multiple of 512), equal ids for equal blocks. Its release notes say the
arrivals are Poisson but the order within multi-turn conversations is kept.

Rule (a request continues a conversation): request j continues an earlier
request i when

- j's hash ids start with all of i's, or with all but i's last block when
  that block is partial (j's tokens there differ from i's: a partial block
  hashes differently once the block fills up);
- j has room for i's whole answer and a new user message:
  ``input_j - input_i - output_i >= 1`` (the new user tokens);
- i is not continued yet (a conversation does not branch: the first request
  to match continues it, a later one matching only continued requests starts
  a session of its own).

Of the candidates, the one sharing the most blocks with j continues, the
latest of equals. A request that continues none starts a session. Sessions
are numbered in the order of their first requests, turns from 0.

Written columns: ``session``, ``turn``, ``user_tokens`` (turn 0: its whole
prompt, ``input_length``; later turns: ``input_j - input_i - output_i``, the
tokens after the history), ``output_tokens`` (``output_length``), ``gap_s``
(the next turn's timestamp minus this one's in seconds, empty for a
session's last turn: a send-to-send gap of Poisson-drawn arrivals, not a
measured think time). Replayed as a session (``lengths.kind sessions``),
turn k's prompt is the sum of the user tokens of turns 0..k and the
outputs of turns 0..k-1, which is that request's ``input_length`` in the
trace, exactly.

Prints the statistics that workloads/traces/README.md quotes.
"""

from __future__ import annotations

import csv
import hashlib
import json
import sys
from pathlib import Path

import numpy as np

BLOCK = 512
SOURCE_SHA256 = "bd070915a98fc0ed264d7cfef2ce746002eb3076a695ec31ba2674c0111ec131"


def sessions(rows: list[dict]) -> tuple[list[list[int]], dict[str, int]]:
    """The sessions of ``rows`` (the trace's requests in file order), each the
    list of its requests' indices in turn order; and counts of the candidates
    the rule set aside, by reason."""
    full: dict[tuple[int, ...], list[int]] = {}     # a request's hash ids -> requests
    trimmed: dict[tuple[int, ...], list[int]] = {}  # ... all but a partial last block -> requests
    child: list[int | None] = [None] * len(rows)
    parent: list[int | None] = [None] * len(rows)
    set_aside = {"no room for the answer and a new message": 0, "already continued": 0}
    for j, r in enumerate(rows):
        h = tuple(r["hash_ids"])
        seen: set[int] = set()                       # a request may match twice: whole, and trimmed
        for shared in range(len(h), 0, -1):         # the most shared blocks first
            prefix = h[:shared]
            found = sorted(set(full.get(prefix, []) + trimmed.get(prefix, [])) - seen, reverse=True)   # latest first
            seen.update(found)
            best = None
            for i in found:
                if r["input_length"] - rows[i]["input_length"] - rows[i]["output_length"] < 1:
                    set_aside["no room for the answer and a new message"] += 1
                elif child[i] is not None:
                    set_aside["already continued"] += 1
                elif best is None:
                    best = i
            if best is not None:
                parent[j], child[best] = best, j
                break
        full.setdefault(h, []).append(j)
        if r["input_length"] % BLOCK:
            trimmed.setdefault(h[:-1], []).append(j)
    out = []
    for j in range(len(rows)):
        if parent[j] is None:
            chain = [j]
            while child[chain[-1]] is not None:
                chain.append(child[chain[-1]])
            out.append(chain)
    return out, set_aside


def table(rows: list[dict], found: list[list[int]]) -> list[tuple]:
    """The session file's rows: (session, turn, user_tokens, output_tokens, gap_s or '')."""
    out = []
    for s, chain in enumerate(found):
        for t, j in enumerate(chain):
            r = rows[j]
            if t == 0:
                user = r["input_length"]
            else:
                prev = rows[chain[t - 1]]
                user = r["input_length"] - prev["input_length"] - prev["output_length"]
            gap = (f"{(rows[chain[t + 1]]['timestamp'] - r['timestamp']) / 1000:.3f}"
                   if t + 1 < len(chain) else "")
            out.append((s, t, user, r["output_length"], gap))
    return out


def describe(x: np.ndarray) -> str:
    p = np.percentile(x, [50, 90, 99])
    return (f"mean {x.mean():,.1f}, p50 {p[0]:,.0f}, p90 {p[1]:,.1f}, p99 {p[2]:,.1f}, "
            f"min {x.min():,}, max {x.max():,}")


def main(argv: list[str]) -> None:
    if len(argv) != 2:
        sys.exit(__doc__.split("\n\n")[1])
    src, dst = Path(argv[0]), Path(argv[1])
    data = src.read_bytes()
    digest = hashlib.sha256(data).hexdigest()
    if digest != SOURCE_SHA256:
        print(f"warning: {src} has SHA-256 {digest}, not the release's {SOURCE_SHA256}", file=sys.stderr)
    rows = [json.loads(line) for line in data.decode().splitlines() if line.strip()]
    found, set_aside = sessions(rows)
    out = table(rows, found)
    with dst.open("w", newline="") as f:
        w = csv.writer(f, lineterminator="\n")
        w.writerow(("session", "turn", "user_tokens", "output_tokens", "gap_s"))
        w.writerows(out)
    turns = np.array([len(c) for c in found])
    user = np.array([u for _, t, u, _, _ in out])
    first = np.array([u for _, t, u, _, _ in out if t == 0])
    later = np.array([u for _, t, u, _, _ in out if t > 0])
    output = np.array([o for *_, o, _ in out])
    gaps = np.array([float(g) for *_, g in out if g])
    multi = [c for c in found if len(c) > 1]
    last_prompt = np.array([rows[c[-1]]["input_length"] for c in multi])
    print(f"{len(rows):,} requests -> {len(found):,} sessions, {int((turns > 1).sum()):,} of them multi-turn "
          f"({sum(len(c) for c in multi):,} requests); {len(rows) - len(found):,} continuations")
    print("turns per session:", {int(k): int(v) for k, v in zip(*np.unique(turns, return_counts=True))})
    print("candidates set aside:", set_aside)
    print(f"user tokens, all turns: {describe(user)}")
    print(f"user tokens, first turns: {describe(first)}")
    print(f"user tokens, later turns: {describe(later)}")
    print(f"output tokens: {describe(output)}")
    print(f"last prompt of a multi-turn session: {describe(last_prompt)}")
    print(f"gap to the next turn (s): {describe(gaps)}")
    print(f"wrote {dst} ({len(out):,} rows, {dst.stat().st_size:,} bytes)")


if __name__ == "__main__":
    main(sys.argv[1:])

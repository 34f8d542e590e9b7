"""What a black-box server's token timelines say about its steps; torch-free.

A serving engine that runs one iteration at a time (vLLM v1 on CPU; any
engine without async scheduling) sends every output token of one step at
nearly the same moment, so the client sees *bursts*: all requests that
sampled a token in a step arrive together. ``align`` turns the token arrival
times of a probe session into a sequence of visible steps, each with the
tokens it produced: greedy clustering by time (one token per request per
step), then a repair pass (a decoding request produces exactly one token per
step, so a cluster lying between two consecutive tokens of one request is a
fragment of a neighbouring step). A token that reached the client together
with the request's next one (the stream lagged) goes to the step before its
successor's, and both steps' times are marked unreliable.

``analyse`` then reads the work of each step off the timeline. A token that
is not a request's first is a decode at context ``prompt + index - 1``. A
first token ends the request's prefill; whether earlier steps held chunks of
that prompt depends on the token budget. Prompts whose waiting times overlap
are reconstructed together:

* their total fits the budget beside the visible decodes: none was split;
* one prompt alone on the server: its chunks are invisible and only its time
  to first token (TTFT) tells their cost: a multi-step equation that also
  holds the per-request overhead;
* otherwise they are replayed through vLLM v1's rules (running requests
  first, then waiting ones FCFS, one ``max_num_batched_tokens`` budget) for
  every arrival order and arrival step consistent with the sends and the
  observed first tokens; the steps count as known only if every consistent
  story gives the same chunks.

Only gaps whose step is known and whose previous step held a token of a
request still decoding (so the engine was busy between them) are used:
``gap = time(step) - time(step before)`` is one step's duration. Runs of
pure-decode steps with the same requests are cut into windows of ``window``
gaps (median and mean kept); ``combine`` merges repeats of a probe design
(``Sent.tag``). A prompt that joined a busy engine alone also bounds the
per-request overhead: it reached the queue after the step before its first
chunk was scheduled and before that chunk's step was.

Hand-checked example (budget 512): a decoder at prompt 100 has produced 10
tokens when a 1000-token prompt arrives. vLLM runs 1 decode + a 511-token
chunk, then 1 decode + 489 tokens (first token of the prompt): step shapes
``((511, 0),)`` + decode at 109, then ``((489, 511),)`` + decode at 110
(``tests/serving/test_server_calibrate.py`` checks it on a hand-made timeline).

The rest of the module sends probes (``HttpTransport`` to a real server,
each prompt tagged so that none hits a prefix cache; ``SimTransport`` to a
simulated one with a known profile) and reads or infers
the server's knobs (``read_server``, ``model_facts``, ``infer_knobs``).
"""

from __future__ import annotations

import math
import os
import statistics
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from calibrate.schema import Shape

TAU_S = 3e-4            # a longer pause between two token arrivals starts a new burst


@dataclass(frozen=True, slots=True)
class Sent:
    """One probe request: send offset (s), prompt tokens, max_tokens; ``tag`` names its design."""

    offset_s: float
    prompt_tokens: int
    max_tokens: int
    tag: str = ""


@dataclass
class Timeline:
    """Visible steps of one session: time (median token arrival) and the (request, token) pairs."""

    times: list[float]
    members: list[list[tuple[int, int]]]
    step_of: list[list[int]]                 # per request: the step of each of its tokens
    bad: set[int] = field(default_factory=set)   # steps whose times are unreliable (coalesced tokens)


@dataclass(frozen=True, slots=True)
class Equation:
    """Measured ``y`` seconds = sum of ``shapes``' step times + ``ro`` x the per-request overhead."""

    key: tuple
    kind: str                                # ttft | decode | mixed
    shapes: tuple[Shape, ...]
    ro: float
    y: float                                 # the median of what it stands for (gaps of a window, repeats)
    y_mean: float | None = None              # their mean, where it differs


def align(token_times: Sequence[Sequence[float]], tau_s: float = TAU_S) -> Timeline:
    """Group token arrivals (one list per request) into visible engine steps.

    A token that reached the client less than ``tau_s`` before the request's
    next one (in one event, or in two read back to back: the stream lagged,
    as no step is that short) is left out of the clustering and put in the
    step before its successor's; those steps' times are marked unreliable."""
    late = {(r, j) for r, ts in enumerate(token_times) for j in range(len(ts) - 1) if ts[j + 1] - ts[j] < tau_s}
    events = sorted((t, r, j) for r, ts in enumerate(token_times) for j, t in enumerate(ts)
                    if (r, j) not in late)
    clusters: list[list[tuple[float, int, int]]] = []
    seen: set[int] = set()
    for ev in events:
        if not clusters or ev[0] - clusters[-1][-1][0] > tau_s or ev[1] in seen:
            clusters.append([])
            seen = set()
        clusters[-1].append(ev)
        seen.add(ev[1])
    for _ in range(len(clusters)):                # repair: merge fragments, until nothing changes
        if not _merge_one_fragment(clusters):
            break
    bad_ids: set[int] = set()                     # ids of unreliable clusters (indices move below)
    for r, j in sorted(late, key=lambda x: (x[0], -x[1])):
        c = next(i for i, cl in enumerate(clusters) if any(e[1] == r and e[2] == j + 1 for e in cl))
        if c == 0 or any(e[1] == r for e in clusters[c - 1]):
            clusters.insert(c, [])
            c += 1
        clusters[c - 1].append((math.nan, r, j))
        bad_ids.update((id(clusters[c - 1]), id(clusters[c])))
    step_of: list[list[int]] = [[0] * len(ts) for ts in token_times]
    members, times, bad = [], [], set()
    for s, cl in enumerate(clusters):
        members.append([(r, j) for _, r, j in cl])
        known = [t for t, _, _ in cl if t == t]
        times.append(statistics.median(known) if known else math.nan)
        if id(cl) in bad_ids or not known:
            bad.add(s)
        for _, r, j in cl:
            step_of[r][j] = s
    for s in range(len(times) - 1, -1, -1):       # a step known only from late tokens: next one's time
        if times[s] != times[s]:
            times[s] = times[s + 1] if s + 1 < len(times) else math.inf
    return Timeline(times, members, step_of, bad)


def _merge_one_fragment(clusters: list[list[tuple[float, int, int]]]) -> bool:
    where: dict[tuple[int, int], int] = {(r, j): c for c, cl in enumerate(clusters) for _, r, j in cl}
    for (r, j), c in where.items():
        nxt = where.get((r, j + 1))
        if nxt is None or nxt <= c + 1:
            continue
        frag = c + 1                               # between two consecutive tokens of r: a fragment
        reqs = {e[1] for e in clusters[frag]}
        options = []
        for target in (c, nxt):
            if not reqs & {e[1] for e in clusters[target]}:
                dist = min(abs(a[0] - b[0]) for a in clusters[frag] for b in clusters[target])
                options.append((dist, target))
        if not options:
            continue
        target = min(options)[1]
        clusters[target] = sorted(clusters[target] + clusters[frag])
        del clusters[frag]
        return True
    return False


def _shape(decodes: Sequence[int], chunks: Sequence[tuple[int, int]]) -> Shape:
    """A step's Shape; a one-token chunk is a decode, as ``sim.core.batch.Batch`` counts it."""
    dec = list(decodes) + [k for c, k in chunks if c == 1]
    return Shape(tuple((c, k) for c, k in chunks if c > 1), tuple(dec))


def lone_chunks(prompt: int, budget: int) -> list[tuple[int, int]]:
    """A prompt alone on the server: chunks of ``budget`` tokens, (size, context before)."""
    return [(min(budget, prompt - k), k) for k in range(0, prompt, budget)]


def analyse(sents: Sequence[Sent], prompts: Sequence[int], token_times: Sequence[Sequence[float]],
            send_s: Sequence[float], budget: int, *, max_num_seqs: int | None = None, window: int = 8,
            tau_s: float = TAU_S) -> tuple[list[Equation], list[tuple[float, float]]]:
    """Equations from one session, and (low, high] bounds on the per-request overhead
    (client send to engine queue plus engine output to client) from prompts that
    joined a busy engine (see module doc)."""
    n = len(sents)
    tl = align(token_times, tau_s)
    ns = len(tl.times)
    first = [tl.step_of[r][0] if token_times[r] else None for r in range(n)]
    decodes = [[prompts[r] + j - 1 for r, j in mem if j > 0] for mem in tl.members]
    chunks: list[list[tuple[int, int]]] = [[] for _ in range(ns)]
    owners: list[set[str]] = [set() for _ in range(ns)]      # tags of the prompts chunked there
    certain = [True] * ns
    equations: list[Equation] = []
    bounds: list[tuple[float, float]] = []

    def chained(s: int) -> bool:                 # a request decoded in s-1 and s: no step between
        return s > 0 and any(j > 0 and tl.step_of[q][j - 1] == s - 1 for q, j in tl.members[s])

    # pending window of r: from the first step ending after its send to its first token;
    # prompts whose windows overlap are reconstructed together
    lo_of = [next((s for s in range(ns) if tl.times[s] > send_s[r]), ns) for r in range(n)]
    for group in _overlapping([(min(lo_of[r], first[r]), first[r]) if first[r] is not None else None
                               for r in range(n)]):
        lo, f = min(min(lo_of[r], first[r]) for r in group), max(first[r] for r in group)
        window_steps = range(lo, f + 1)
        if sum(prompts[r] for r in group) + max(len(decodes[s]) for s in window_steps) <= budget:
            for r in group:                           # everything fitted: nothing was split
                chunks[first[r]].append((prompts[r], 0))
                owners[first[r]].add(sents[r].tag)
            if len(group) > 1:
                continue
        r = group[0]
        if len(group) == 1 and not any(q != r for s in window_steps for q, _ in tl.members[s]):
            # alone on the server: TTFT covers its (invisible) chunks and the request overhead
            plan = lone_chunks(prompts[r], budget)
            if token_times[r][0] > send_s[r]:
                equations.append(Equation((sents[r].tag, "ttft"), "ttft",
                                          tuple(_shape([], [c]) for c in plan), 1.0,
                                          token_times[r][0] - send_s[r]))
            if chunks[f]:
                chunks[f][-1] = plan[-1]
            continue
        if chunks[f]:                                  # one prompt that fitted: bound the overhead
            admitted = {r: f}
        else:
            members = {q: (prompts[q], min(lo_of[q], first[q]), first[q], send_s[q]) for q in group}
            plans = (_replay_group(members, lo, [len(decodes[s]) for s in window_steps], budget,
                                   max_num_seqs) if all(chained(s) for s in window_steps)
                     and not any(j > 0 and q in members for s in window_steps for q, j in tl.members[s])
                     else None)
            if plans is None:
                for s in window_steps:
                    certain[s] = False
                continue
            admitted = {}
            for q, plan in plans.items():
                admitted[q] = plan[0][0]
                for s, c, k in plan:
                    chunks[s].append((c, k))
                    owners[s].add(sents[q].tag)
        if len(group) == 1:
            a = admitted[r]
            full = max_num_seqs is not None and len(decodes[a - 1]) >= max_num_seqs
            if a >= 2 and not full and not {a - 2, a - 1} & tl.bad:
                bounds.append((tl.times[a - 2] - send_s[r], tl.times[a - 1] - send_s[r]))
    # gap equations: certain steps that followed a busy one
    runs: dict[tuple, list[tuple[float, Shape]]] = defaultdict(list)
    for s in range(1, ns):
        if not certain[s] or {s - 1, s} & tl.bad or not chained(s):
            continue
        gap = tl.times[s] - tl.times[s - 1]
        if not 0 < gap < math.inf:
            continue
        shape = _shape(decodes[s], chunks[s])
        if chunks[s]:
            equations.append(Equation((*sorted(owners[s]), "mixed", len(shape.decode_contexts),
                                       shape.prefills), "mixed", (shape,), 0.0, gap))
        else:
            runs[tuple(sorted(r for r, _ in tl.members[s]))].append((gap, shape))
    for reqs, items in runs.items():
        for w in range(0, max(1, len(items) - window // 2), window):
            part = items[w:w + window]
            gaps = [g for g, _ in part]
            equations.append(Equation((sents[reqs[0]].tag, "decode", reqs, w), "decode",
                                      (part[len(part) // 2][1],), 0.0, statistics.median(gaps),
                                      statistics.fmean(gaps)))
    return equations, bounds


def _overlapping(windows: Sequence[tuple[int, int] | None]) -> list[list[int]]:
    """Indices grouped into connected runs of overlapping [lo, hi] windows (None: left out)."""
    order = sorted((w[0], w[1], i) for i, w in enumerate(windows) if w is not None)
    groups: list[list[int]] = []
    end = -1
    for lo, hi, i in order:
        if groups and lo <= end:
            groups[-1].append(i)
            end = max(end, hi)
        else:
            groups.append([i])
            end = hi
    return groups


def _replay_group(members: dict[int, tuple[int, int, int, float]], lo: int, decodes: Sequence[int],
                  budget: int, max_num_seqs: int | None, max_candidates: int = 20000
                  ) -> dict[int, list[tuple[int, int, int]]] | None:
    """Chunks (step, size, context) of prompts in flight together beside ``decodes`` visible
    decodes per step from step ``lo`` on, by vLLM v1's rules (running first, then waiting FCFS,
    one token budget), over every arrival order and arrival step consistent with the sends
    and the observed first-token steps. ``members``: request -> (prompt, first step it may
    have arrived, first-token step, send time). None unless every consistent candidate
    gives the same chunks."""
    import itertools

    if len(members) > 6:
        return None
    found: dict[int, list[tuple[int, int, int]]] | None = None
    tried = 0
    for order in itertools.permutations(members):
        sends = [members[q][3] for q in order]
        if any(b < a - 2e-3 for a, b in zip(sends, sends[1:])):
            continue                                  # sent clearly later: arrives later
        for arrive in _non_decreasing([range(members[q][1], members[q][2] + 1) for q in order]):
            tried += 1
            if tried > max_candidates:
                return None
            plan = _simulate_group(order, arrive, members, lo, decodes, budget, max_num_seqs)
            if plan is None:
                continue
            if found is not None and plan != found:
                return None                           # two stories fit the data
            found = plan
    return found


def _non_decreasing(ranges: Sequence[range], floor: int = -1):
    """Every tuple (x_0, x_1, ...) with x_i in ranges[i] and x_0 <= x_1 <= ..."""
    if not ranges:
        yield ()
        return
    for x in ranges[0]:
        if x >= floor:
            for rest in _non_decreasing(ranges[1:], x):
                yield (x, *rest)


def _simulate_group(order, arrive, members, lo, decodes, budget, max_num_seqs):
    done = {q: 0 for q in order}
    plan: dict[int, list[tuple[int, int, int]]] = {q: [] for q in order}
    running: list[int] = []
    waiting = list(zip(arrive, order))
    for i, d in enumerate(decodes):
        s = lo + i
        left = budget - d
        for q in running:
            if left <= 0:
                break
            c = min(members[q][0] - done[q], left)
            plan[q].append((s, c, done[q]))
            done[q] += c
            left -= c
        while waiting and waiting[0][0] <= s and left > 0 and (
                max_num_seqs is None or d + len(running) < max_num_seqs):
            q = waiting.pop(0)[1]
            c = min(members[q][0], left)
            plan[q].append((s, c, 0))
            done[q] = c
            left -= c
            running.append(q)
        for q in list(running):
            if done[q] == members[q][0]:
                if s != members[q][2]:
                    return None                       # its first token would come at another step
                running.remove(q)
            elif s >= members[q][2]:
                return None
    return plan if not running and not waiting else None


def combine(equations: Sequence[Equation]) -> list[Equation]:
    """One equation per key: the median y over repeats (and the mean of their means), with
    the shapes of the median one."""
    groups: dict[tuple, list[Equation]] = defaultdict(list)
    for e in equations:
        groups[e.key].append(e)
    out = []
    for key, eqs in groups.items():
        eqs = sorted(eqs, key=lambda e: e.y)
        mid = eqs[(len(eqs) - 1) // 2]
        y = statistics.median(e.y for e in eqs)
        mean = statistics.fmean(e.y if e.y_mean is None else e.y_mean for e in eqs)
        out.append(Equation(key, mid.kind, mid.shapes, mid.ro, y, mean))
    return out


def stab(bounds: Sequence[tuple[float, float]]) -> float | None:
    """The value inside the most (low, high] intervals (the middle of the best such range)."""
    if not bounds:
        return None
    points = sorted({x for b in bounds for x in b})
    best, where = -1, None
    for lo, hi in zip(points, points[1:]):
        mid = (lo + hi) / 2
        cover = sum(a < mid <= b for a, b in bounds)
        if cover > best:
            best, where = cover, (lo, hi)
    return None if where is None else (where[0] + where[1]) / 2


def simulate_session(sents: Sequence[Sent], profile, *, max_num_seqs: int, max_num_batched_tokens: int,
                     max_model_len: int, num_blocks: int = 1 << 16, block_size: int = 16,
                     in_s: float = 0.0, out_s: float = 0.0, noise: float = 0.0,
                     seed: int = 0) -> tuple[list[float], list[list[float]]]:
    """Send times and token arrival times of ``sents`` on a simulated vLLM v1 server
    whose steps take ``profile``'s time x lognormal(``noise``): what a client of a
    server with exactly that profile would see (requests reach the engine ``in_s``
    after their send, tokens the client ``out_s`` after their step)."""
    import simpy

    from sim.core.policy import PolicyContext
    from policies.vllm_v1 import VllmV1Config, VllmV1Policy
    from sim.core.batch import StepResult
    from sim.loop.server import Server
    from sim.loop.feed import feed
    from sim.core.kv import BlockManager
    from sim.core.request import Request
    from sim.core.state import SchedulerState

    rng = np.random.default_rng(seed)

    class Noisy:
        def execute(self, batch, state):
            t = profile.step_time_s(batch) * float(np.exp(noise * rng.standard_normal()))
            return StepResult(t, t)

    env = simpy.Environment()
    # A synchronous server, as vLLM runs on a CPU (its platform turns async scheduling off): the
    # calibration's probes are read as its steps (a GPU server's async loop is not modelled here).
    policy = VllmV1Policy(VllmV1Config(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                                       async_scheduling=False), PolicyContext(max_model_len))
    state = SchedulerState(BlockManager(num_blocks - 1, block_size), max_model_len, None)
    server = Server(env, policy, state, Noisy())
    order = sorted(range(len(sents)), key=lambda i: sents[i].offset_s)
    reqs = [Request(i, sents[i].offset_s + in_s, sents[i].prompt_tokens, sents[i].max_tokens) for i in order]
    env.process(feed(env, [server], reqs, [r.max_output_tokens for r in reqs]))
    env.run()
    ids, times = state.token_log()
    out: list[list[float]] = [[] for _ in sents]
    for i, t in zip(ids.tolist(), times.tolist()):
        out[i].append(t + out_s + 2e-5 * rng.random())
    return [s.offset_s for s in sents], [sorted(ts) for ts in out]


# ---- transports: how a session's requests reach a server ---------------------------------------
@dataclass
class Session:
    """What came back for each request of a session (perf_counter seconds)."""

    prompts: list[int]
    send_s: list[float]
    token_times: list[list[float]]
    errors: list[str | None]


Transport = Callable[[Sequence[Sent]], Session]


PROBE_SPECIAL_IDS = (0, 1, 2)    # left out of probe prompts (unk, bos, eos of the tiny model)
SERIAL_BITS = 24                 # probes one transport can number (16.7 million)
NONCE_BITS = 24                  # the transport's own number, drawn at random


def tag_length(vocab_size: int) -> int:
    """Tokens a probe's leading tag takes: the fewest base ``vocab_size - 3`` digits
    that spell any ``NONCE_BITS + SERIAL_BITS``-bit number (5 for the tiny model's
    4,096 ids: 4093^4 < 2^48; 3 for Llama 3's 128,256)."""
    base = vocab_size - len(PROBE_SPECIAL_IDS)
    if base < 2:
        raise ValueError(f"vocab_size {vocab_size}: a probe prompt needs at least 2 ids besides "
                         f"{PROBE_SPECIAL_IDS}")
    digits, span = 1, base
    while span < 1 << (SERIAL_BITS + NONCE_BITS):
        digits, span = digits + 1, span * base
    return digits


class HttpTransport:
    """Sends a session to a real server (``client.replay``), a prompt of its own per request.

    Probes must not hit a prefix cache (vLLM's is on by default): a hit skips
    the prefill that the probe times. Every prompt therefore starts with a
    tag of ``tag_length(vocab_size)`` tokens (5 for the tiny model's 4,096
    ids) that spells ``nonce << 24 | serial`` in base ``vocab_size - 3``
    (digit d is id d + 3, so ids 0-2 never appear): ``serial`` counts the
    transport's prompts and ``nonce`` is drawn from the OS per transport
    (``nonce`` fixes it, for tests). Two prompts of one calibration thus
    differ within their first ``tag_length`` tokens, so no two share a first
    KV block of that many tokens or more (vLLM's are 16 or 128): a prefix
    cache, which matches from the first block on, never hits. Prompts of
    another calibration differ from them but for a 2^-24 chance. The rest of
    each prompt is random ids (``client.prompt_ids``, seeded by ``seed`` and
    the serial)."""

    def __init__(self, url: str, model: str, vocab_size: int, seed: int = 0, nonce: int | None = None) -> None:
        self.url, self.model, self.vocab_size = url, model, vocab_size
        self._seed = seed * 1_000_003
        self._serial = 0
        self.nonce = (int.from_bytes(os.urandom(4), "little") if nonce is None else nonce) % (1 << NONCE_BITS)
        self.tag_len = tag_length(vocab_size)

    def prompts(self, sents: Sequence[Sent]) -> list[list[int]]:
        """The next prompts, one per probe of ``sents`` (the class doc's rule)."""
        from calibrate.serving import client
        base, k = self.vocab_size - len(PROBE_SPECIAL_IDS), len(PROBE_SPECIAL_IDS)
        out = []
        for s in sents:
            if self._serial >= 1 << SERIAL_BITS:
                raise RuntimeError(f"more than {1 << SERIAL_BITS} probes from one transport")
            number, tag = self.nonce << SERIAL_BITS | self._serial, []
            for _ in range(self.tag_len):
                number, digit = divmod(number, base)
                tag.append(digit + k)
            self._serial += 1
            self._seed += 1
            rest = client.prompt_ids(max(0, s.prompt_tokens - self.tag_len), self._seed, self.vocab_size,
                                     avoid=PROBE_SPECIAL_IDS)
            out.append((tag + rest)[:s.prompt_tokens])
        return out

    def __call__(self, sents: Sequence[Sent]) -> Session:
        from calibrate.serving import client
        schedule = [(s.offset_s, ids, s.max_tokens) for s, ids in zip(sents, self.prompts(sents))]
        res = client.run(client.replay(self.url, self.model, schedule))
        return Session([r.num_prompt_tokens or s.prompt_tokens for r, s in zip(res, sents)],
                       [r.send_s for r in res], [list(r.token_times_s) for r in res],
                       [r.error if r.error or len(r.token_times_s) == s.max_tokens else
                        f"{len(r.token_times_s)} of {s.max_tokens} tokens" for r, s in zip(res, sents)])


class SimTransport:
    """A simulated server (``simulate_session``) on a clock of its own: for tests and dry runs."""

    def __init__(self, profile: Any, *, max_num_seqs: int, max_num_batched_tokens: int,
                 max_model_len: int, in_s: float = 0.002, out_s: float = 0.001, noise: float = 0.0,
                 seed: int = 0) -> None:
        self.profile, self.in_s, self.out_s, self.noise = profile, in_s, out_s, noise
        self.knobs = dict(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                          max_model_len=max_model_len)
        self.clock, self.seed = 0.0, seed

    def now(self) -> float:
        """The simulated server's clock (the calibration's budget runs on it)."""
        return self.clock

    def __call__(self, sents: Sequence[Sent]) -> Session:
        self.seed += 1
        shifted = [Sent(s.offset_s + self.clock, s.prompt_tokens, s.max_tokens, s.tag) for s in sents]
        send, times = simulate_session(shifted, self.profile, in_s=self.in_s, out_s=self.out_s,
                                       noise=self.noise, seed=self.seed, **self.knobs)
        self.clock = max([t for ts in times for t in ts] + send) + 0.005
        return Session([s.prompt_tokens for s in sents], send, times, [None] * len(sents))


# ---- the server's facts and knobs --------------------------------------------------------------
@dataclass
class Knobs:
    """The scheduler knobs and KV pool of the server, and where each value came from."""

    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    num_gpu_blocks: int | None
    block_size: int | None
    enable_prefix_caching: bool | None
    kv_bytes_per_token: int
    source: dict[str, str] = field(default_factory=dict)
    engine_kind: str = "vllm"                # engines.ENGINE_KINDS
    engine_knobs: dict[str, Any] = field(default_factory=dict)   # what the server said, under its names

    @property
    def kv_tokens(self) -> int:
        if self.num_gpu_blocks and self.block_size:
            return self.num_gpu_blocks * self.block_size
        return self.max_num_seqs * self.max_model_len

    @property
    def kv_bytes(self) -> int:
        return self.kv_tokens * self.kv_bytes_per_token

    def describe(self) -> str:
        return (f"max_num_seqs {self.max_num_seqs} ({self.source['max_num_seqs']}), max_num_batched_tokens "
                f"{self.max_num_batched_tokens} ({self.source['max_num_batched_tokens']}), max_model_len "
                f"{self.max_model_len}, KV {self.num_gpu_blocks} blocks x {self.block_size}")

    def engine_dict(self) -> dict[str, Any]:
        """The profile's ``engine`` mapping: ``kind`` and ``engine_kind`` (the engine), the
        engine's knobs under its own names, the batchsim keys the runner reads (these
        knobs: flag, server or inferred) and where each came from (``engines.engine_mapping``)."""
        from calibrate.serving.engines import engine_mapping

        batchsim = {"max_num_seqs": self.max_num_seqs, "max_num_batched_tokens": self.max_num_batched_tokens,
                    "num_gpu_blocks": self.num_gpu_blocks, "block_size": self.block_size,
                    "max_model_len": self.max_model_len, "enable_prefix_caching": self.enable_prefix_caching}
        return {"kind": self.engine_kind, **engine_mapping(self.engine_kind, self.engine_knobs, batchsim),
                "knob_source": dict(self.source)}


@dataclass
class ModelFacts:
    name: str
    shape: Any                      # sim.cost.profile.ModelShape
    vocab_size: int
    dtype: str
    device: str
    tensor_parallel: int
    weight_bytes: int
    kv_bytes_per_token: int
    source: str


def read_server(url: str, model_config: str | Path | None = None) -> tuple[Any, str | None]:
    """(client.ServerInfo, the engine's version or None); ConfigError if the server cannot
    be reached or gives no model length. A server that does not say its model length
    (trtllm-serve) takes ``model_config``'s ``max_position_embeddings``."""
    import json
    from urllib.parse import urlsplit

    from calibrate.serving import client
    from calibrate.serving.engines import ENGINES
    from sim.run.config import ConfigError

    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ConfigError(f"--server {url!r}: expected http://host:port (an OpenAI-compatible server)")
    try:
        info = client.server_info(url)
    except (ConnectionError, OSError, ValueError, KeyError, IndexError, TypeError) as exc:
        raise ConfigError(f"--server {url}: cannot reach the server's /v1/models "
                          f"({str(exc).splitlines()[0] if str(exc) else type(exc).__name__}); "
                          f"is it running and is the URL right?") from None
    if not info.max_model_len and model_config:
        p = Path(model_config)
        try:
            cfg = json.loads((p / "config.json" if p.is_dir() else p).read_text())
        except (OSError, ValueError) as exc:
            raise ConfigError(f"--model-config {p}: cannot read an HF config.json ({exc})") from None
        length = cfg.get("max_position_embeddings") if isinstance(cfg, dict) else None
        if isinstance(length, int) and length > 0:
            info.max_model_len = length
            info.raw["max_model_len_from"] = "--model-config max_position_embeddings"
    if not info.max_model_len:
        label = ENGINES[info.engine_kind].label
        raise ConfigError(f"--server {url}: {label} does not give its model length (max_model_len in "
                          f"/v1/models); pass --model-config CONFIG_JSON (its max_position_embeddings is used)")
    return info, info.engine_version


def model_facts(info: Any, model_config: str | Path | None) -> ModelFacts:
    """Model shape, dtype and sizes from the HF config (``--model-config``, else the served
    model's folder when it is readable here) and the server's KV cache gauges."""
    import json

    from sim.run.config import ConfigError
    from sim.cost.presets import model_shape_from_hf
    from sim.cost.profile import ModelShape

    vcfg = (info.raw or {}).get("vllm_config") or {}
    gauges = (info.raw or {}).get("info_gauges", {}).get("vllm:cache_config_info", {})
    path = Path(model_config) if model_config else None
    if path is None:
        root = next((m.get("root") for m in (info.raw or {}).get("models", {}).get("data", [])), None)
        path = Path(root) if root and Path(root).exists() else None
    cfg: dict[str, Any] = {}
    if path is not None:
        p = path / "config.json" if path.is_dir() else path
        try:
            cfg = json.loads(p.read_text())
        except (OSError, ValueError) as exc:
            raise ConfigError(f"--model-config {p}: cannot read an HF config.json ({exc})") from None
    L = int(info.max_model_len)
    if cfg:
        try:    # the server's max_model_len stands in for a config without max_position_embeddings
            shape = model_shape_from_hf({"max_position_embeddings": L, **cfg}, info.model)
        except ValueError as exc:
            raise ConfigError(f"--model-config {p}: {exc}") from None
    else:                                    # unknown: placeholders the profile format accepts
        shape = ModelShape(info.model, 1, 1, 1, 1, 1, 1, L)
    sizes = {"float32": 4, "float16": 2, "bfloat16": 2, "half": 2}
    dtype = str((vcfg.get("model_config") or {}).get("dtype") or cfg.get("torch_dtype") or cfg.get("dtype")
                or "unknown").replace("torch.", "")
    try:
        kv = int(gauges["kv_cache_memory_bytes"]) // int(gauges["kv_cache_size_tokens"])
    except (KeyError, ValueError, ZeroDivisionError):
        kv = shape.kv_bytes_per_token(sizes.get(dtype, 2)) if cfg else 0
    if dtype not in sizes and cfg and kv:
        dtype = {4: "float32", 2: "bfloat16"}.get(kv // max(shape.kv_bytes_per_token(1), 1), dtype)
    tp = int((vcfg.get("parallel_config") or {}).get("tensor_parallel_size") or 1)
    device = str((vcfg.get("device_config") or {}).get("device_type") or (vcfg.get("device_config") or {}).get(
        "device") or "unknown")
    return ModelFacts(info.model, shape, int(cfg.get("vocab_size") or 1000), dtype,
                      f"{device} (vLLM server)", tp, shape.num_params * sizes.get(dtype, 2) if cfg else 0,
                      max(kv, 1), str(path) if path else "unknown: pass --model-config")


@dataclass
class Costs:
    """Crude step-cost estimates (s) to size and schedule probes; ``scale`` follows how
    long sessions really took against these estimates."""

    decode_s: float
    per_token_s: float
    overhead_s: float
    scale: float = 1.0

    def step(self, decodes: int, chunk: int = 0) -> float:
        return self.scale * (self.decode_s + self.per_token_s * (max(decodes - 1, 0) + chunk))

    def prefill(self, tokens: int, budget: int) -> float:
        return sum(self.step(0, min(budget, tokens - i)) for i in range(0, tokens, max(budget, 1)))


def _gaps(tl: Timeline) -> dict[int, float]:
    """Gap before each step that followed a busy one (see ``analyse``)."""
    return {s: tl.times[s] - tl.times[s - 1] for s in range(1, len(tl.times))
            if any(j > 0 and tl.step_of[q][j - 1] == s - 1 for q, j in tl.members[s])}


def infer_knobs(info: Any, transport: Transport, say: Callable[[str], None], *, kv_bytes_per_token: int = 1,
                max_num_seqs: int | None = None,
                max_num_batched_tokens: int | None = None) -> tuple[Knobs, Costs]:
    """The server's knobs (flags, else what it says, else inferred by probing) and crude costs."""
    L = int(info.max_model_len)
    for warm in ([Sent(0.0, min(L - 3, 256), 4)], [Sent(0.0, 8, 8)] * 8):
        transport(warm)                                      # first requests pay one-off costs
    t1, ttft1, ttftm = [], [], []
    pm = min(L - 3, 256)
    for _ in range(3):
        ses = transport([Sent(0.0, 1, 16)])
        ttft1.append(ses.token_times[0][0] - ses.send_s[0])
        t1.append(statistics.median(np.diff(ses.token_times[0])))
        ses = transport([Sent(0.0, pm, 2)])
        ttftm.append(ses.token_times[0][0] - ses.send_s[0])
    dec, first = statistics.median(t1), statistics.median(ttft1)
    costs = Costs(dec, max((statistics.median(ttftm) - first) / (pm - 1), 1e-8), max(first - dec, 1e-4))
    src: dict[str, str] = {}
    B = max_num_batched_tokens or info.max_num_batched_tokens
    src["max_num_batched_tokens"] = ("flag" if max_num_batched_tokens else "server" if B else "inferred")
    if not B:
        B = _infer_budget(transport, costs, L, say)
        if B >= L:
            src["max_num_batched_tokens"] = f"inferred lower bound (a {L - 2}-token prompt is not split)"
    S = max_num_seqs or info.max_num_seqs
    src["max_num_seqs"] = "flag" if max_num_seqs else "server" if S else "inferred"
    if not S:
        S, exact = _infer_max_seqs(transport, costs, B, say)
        if not exact:
            src["max_num_seqs"] = f"inferred lower bound ({S} requests decoded together)"
    knobs = Knobs(int(S), int(B), L, info.num_gpu_blocks, info.block_size, info.enable_prefix_caching,
                  kv_bytes_per_token, src, _engine_kind(info), dict(getattr(info, "engine_knobs", None) or {}))
    return knobs, costs


def _engine_kind(info: Any) -> str:
    """The engine a profile names: the detected one; a server that said nothing is vLLM, as before."""
    kind = getattr(info, "engine_kind", "unknown")
    return "vllm" if kind == "unknown" else kind


def _join_trial(transport: Transport, costs: Costs, m: int) -> tuple[bool, int] | None:
    """One request decodes; an ``m``-token prompt joins it. (Was the prompt split over
    two or more steps, how many steps did it take), read from the decoder's gaps: a
    step holding a chunk is longer than the decoder's steps before the join. None
    when the trial is unusable."""
    t_inj = 2 * costs.overhead_s + 12 * costs.step(1)
    n_dec = int((t_inj + 3 * costs.prefill(m, m) + 4 * costs.overhead_s) / costs.step(1)) + 24
    ses = transport([Sent(0.0, 8, n_dec, "kB"), Sent(t_inj, m, 1, f"kB:{m}")])
    if any(ses.errors) or not ses.token_times[1]:
        return None
    tl = align(ses.token_times)
    f = tl.step_of[1][0]
    lo = next((s for s in range(len(tl.times)) if tl.times[s] > ses.send_s[1]), f)
    gaps = _gaps(tl)
    base = [gaps[s] for s in range(2, lo) if s in gaps]
    if len(base) < 4 or f not in gaps or tl.step_of[0][-1] <= f or any(s not in gaps for s in range(lo, f)):
        return None
    b = statistics.median(base)
    noise = 1.4826 * statistics.median(abs(g - b) for g in base) + 0.02 * b
    if f - 1 < lo:
        return False, 1
    g1, g2 = gaps[f - 1] - b, max(gaps[f] - b, 0.0)
    split = g1 > 3 * noise and g1 > 0.25 * (g1 + g2)
    n = 1
    while split and f - n >= lo and gaps[f - n] - b > max(6 * noise, 2 * b):
        n += 1                                     # the run of chunk steps that ends at the first token
    return split, n


def _infer_budget(transport: Transport, costs: Costs, L: int, say: Callable[[str], None]) -> int:
    """max_num_batched_tokens: the largest prompt that joins one decoding request unsplit, + 1.

    The longest prompt's number of chunk steps brackets it; bisection (majority of
    trials per point) pins it inside the bracket."""
    def unsplit(m: int) -> bool:
        votes: list[bool] = []
        for _ in range(7):
            v = _join_trial(transport, costs, m)
            if v is not None:
                votes.append(not v[0])
            if len(votes) - sum(votes) >= 2 or sum(votes) >= 2:
                break
        return sum(votes) * 2 > len(votes)

    def bisect(lo: int, hi: int) -> int:    # the largest m in [lo, hi] that joins unsplit
        while lo < hi:
            m = (lo + hi + 1) // 2
            lo, hi = (m, hi) if unsplit(m) else (lo, m - 1)
        return lo

    top = L - 2
    counts = [v[1] for v in (_join_trial(transport, costs, top) for _ in range(3)) if v is not None]
    n = int(statistics.median(counts)) if counts else 0
    if n == 1 and unsplit(top):
        return L                           # a lower bound: no single prompt is ever split
    c = None
    if n >= 2:                             # c, the chunk beside one decode: (n - 1) c < top <= n c
        lo, hi = max(1, -(-top // n) - 1), min(top - 1, -(-top // (n - 1)))
        c = bisect(lo, hi)
        if (c == lo and not unsplit(c)) or (c == hi and unsplit(c + 1)):
            c = None                       # the count was off: search everything
    if c is None:
        c = bisect(1, top - 1)
    say(f"  inferred max_num_batched_tokens {c + 1} (a {c}-token prompt joins one decode unsplit, "
        f"{c + 1} tokens do not)")
    return c + 1


def _infer_max_seqs(transport: Transport, costs: Costs, budget: int,
                    say: Callable[[str], None]) -> tuple[int, bool]:
    """max_num_seqs: how many of M simultaneous requests decode together, for growing M."""
    best = 1
    for m in sorted({x for x in (64, 256, 1024) if x < budget} | {min(budget, 1024)}):
        n_tok = int(min(512, max(32, 4 * (0.05 + 2e-3 * m) / costs.step(min(m, 64)))))
        ses = transport([Sent(0.0, 4, n_tok, "kS")] * m)
        tl = align(ses.token_times)
        sizes = [len(mem) for mem in tl.members]
        top = max(sizes)
        best = max(best, top)
        firsts = [tl.step_of[r][0] for r in range(m) if ses.token_times[r]]
        lasts = [tl.step_of[r][-1] for r in range(m) if ses.token_times[r]]
        if top < m and sizes.count(top) >= n_tok // 2 and max(firsts) > min(lasts):
            say(f"  inferred max_num_seqs {top} ({m} simultaneous requests decoded {top} at a time)")
            return top, True
    return best, False

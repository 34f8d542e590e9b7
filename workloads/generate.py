"""Turn a workload's traffic (``workloads.spec.Traffic``) into request specs: arrival times,
prompt and output lengths, and what the prompts share (``Contents``: prefix_repetition's
prefixes, a trace's hash ids, multi-turn sessions' histories).

Randomness: one ``np.random.SeedSequence(seed)`` spawns independent streams for
arrivals, prompt lengths and output lengths (and sessions' turn counts), so
changing the length model does not move the arrival times (and vice versa);
prefix_repetition's shuffle draws from the prompt stream.
"""

from __future__ import annotations

import math
import os
import warnings
from dataclasses import dataclass

import numpy as np

from sim.base.strict import ConfigError
from workloads.spec import MAX_SPAN_S, MAX_TOKEN_COUNT, Traffic, num_turns_range
from workloads.traces import TraceData, load_sessions, load_trace


@dataclass(frozen=True)
class Contents:
    """What each request's prompt holds, for prefix caching (``sim.core.prefix``),
    as flat arrays: request i's prompt is the runs ``starts[i] .. starts[i+1] - 1``,
    run r being tokens ``(keys[r], 0 .. lengths[r] - 1)``; its output tokens
    are ``(output_keys[i], 0, 1, ...)``. Equal (key, offset) pairs are equal
    tokens, so two prompts share a prefix exactly where their runs agree. The
    runs of request i sum to its prompt length. Keys are int64; a generator
    keeps its key spaces apart (``key_space``)."""

    keys: np.ndarray            # int64, one per run
    lengths: np.ndarray         # int64 > 0, one per run
    starts: np.ndarray          # int64, len(requests) + 1 offsets into the runs
    output_keys: np.ndarray     # int64, one per request

    def __len__(self) -> int:
        return len(self.output_keys)

    def content(self, i: int) -> tuple[int, ...]:
        """Request i's ``Request.content``: (output key, key_0, len_0, key_1, len_1, ...)."""
        lo, hi = int(self.starts[i]), int(self.starts[i + 1])
        out = [int(self.output_keys[i])]
        for k, n in zip(self.keys[lo:hi].tolist(), self.lengths[lo:hi].tolist()):
            out += (k, n)
        return tuple(out)

    def take(self, index: np.ndarray) -> Contents:
        """The contents of requests ``index`` (an int array or a boolean mask), in that order."""
        idx = np.flatnonzero(index) if np.asarray(index).dtype == bool else np.asarray(index, np.int64)
        counts = (self.starts[idx + 1] - self.starts[idx]).astype(np.int64)
        starts = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        # run j of the result is run (its request's first run) + (j - the request's first place)
        runs = np.repeat(self.starts[idx] - starts[:-1], counts) + np.arange(starts[-1], dtype=np.int64)
        return Contents(self.keys[runs], self.lengths[runs], starts, self.output_keys[idx])


def key_space(tag: int) -> int:
    """The first key of key space ``tag`` (1 .. 15): generators draw keys from
    their own spaces, so keys of different origins never meet. Space 0 is a
    trace's own ids (Mooncake's hash ids); ``sim.core.prefix`` uses 1 << 61 and up.
    Taken here: 8 and 9 (a trace's tokens its ids do not cover, its outputs),
    10 to 12 (prefix_repetition's prefixes, suffixes, outputs)."""
    return tag << 56


# A key space holds 2^56 keys: a key below is its space's start plus a
# request's serial number (or a prefix's index), far below 2^56.
TRACE_OWN = key_space(8)          # + serial: a trace request's prompt tokens its hash ids do not cover
TRACE_OUTPUT = key_space(9)       # + serial: a trace request's output tokens
REPEAT_PREFIX = key_space(10)     # + prefix index: prefix_repetition's shared prefixes
REPEAT_SUFFIX = key_space(11)     # + request: prefix_repetition's suffixes
REPEAT_OUTPUT = key_space(12)     # + request: prefix_repetition's outputs


def hashed_contents(prompt: np.ndarray, hash_ids: np.ndarray, hash_starts: np.ndarray, rows: np.ndarray,
                    serial: np.ndarray, block_tokens: int) -> tuple[Contents, int, int, int]:
    """The contents of requests replaying trace rows ``rows`` (a row may come
    more than once), from the rows' hash ids (``traces.TraceData``): id k of a
    row covers prompt tokens ``k * block_tokens`` up to the next id's, the last
    id what is left (a partial last block has an id too), and becomes the run
    (id, tokens covered) in key space 0, so the simulator's blocks, of any size,
    hold equal tokens exactly where two rows' ids agree, a partial last block
    sharing only the tokens it covers. Ids beyond ``ceil(prompt / block_tokens)``
    cover nothing and are dropped; prompt tokens the ids leave uncovered are the
    request's own (a run of its own key, from ``serial``, a number unique to the
    request: copies of a row share its ids but not its own tokens), and so are
    its outputs. Also returns, over the trace's rows: how many rows hold surplus
    ids, how many ids they are, and how many rows leave tokens uncovered."""
    prompt = np.asarray(prompt, np.int64)
    b = int(block_tokens)
    have = np.diff(hash_starts)
    need = -(-prompt // b)
    used = np.minimum(have, need)
    own = np.maximum(prompt - b * used, 0)         # > 0 only where the ids run out first
    runs = used + (own > 0)
    starts = np.concatenate([[0], np.cumsum(runs)]).astype(np.int64)
    keys = np.empty(int(starts[-1]), np.int64)
    lengths = np.full(int(starts[-1]), b, np.int64)
    id_at = np.concatenate([[0], np.cumsum(used)]).astype(np.int64)
    k = np.arange(int(id_at[-1]), dtype=np.int64)
    keys[np.repeat(starts[:-1] - id_at[:-1], used) + k] = hash_ids[np.repeat(hash_starts[:-1] - id_at[:-1], used) + k]
    whole = (used > 0) & (own == 0)                # the last id covers the remainder
    lengths[starts[1:][whole] - 1] = prompt[whole] - b * (used[whole] - 1)
    lengths[starts[1:][own > 0] - 1] = own[own > 0]
    keys[starts[1:][own > 0] - 1] = -1             # set per request below
    base = Contents(keys, lengths, starts, np.zeros(len(prompt), np.int64))
    out = base.take(np.asarray(rows, np.int64))
    serial = np.asarray(serial, np.int64)
    mine = own[rows] > 0
    out.keys[out.starts[1:][mine] - 1] = TRACE_OWN + serial[mine]
    out.output_keys[:] = TRACE_OUTPUT + serial
    surplus = have - used
    return out, int((surplus > 0).sum()), int(surplus.sum()), int((own > 0).sum())


def _trace_contents(cfg: Traffic, data: TraceData, rows: np.ndarray, serial: np.ndarray,
                    field: str) -> Contents | None:
    """``hashed_contents`` of a file with a hash_ids column (else None), warning of ids that do
    not fit ``lengths.hash_block_tokens`` (``field`` names the file's workload field)."""
    if data.hash_ids is None:
        return None
    b = cfg.lengths.hash_block_tokens
    contents, surplus_rows, surplus_ids, short_rows = hashed_contents(
        data.prompt_tokens, data.hash_ids, data.hash_starts, rows, serial, b)
    if surplus_rows:
        warnings.warn(f"{cfg.source}: {surplus_rows:,} rows of {field} hold more hash_ids than their prompt "
                      f"needs at lengths.hash_block_tokens {b} (ceil(prompt / {b})); their {surplus_ids:,} "
                      f"surplus ids were dropped (is hash_block_tokens right? Mooncake's is 512, "
                      f"Alibaba's 16)", stacklevel=3)
    if short_rows:
        warnings.warn(f"{cfg.source}: {short_rows:,} rows of {field} hold fewer hash_ids than their prompt "
                      f"needs at lengths.hash_block_tokens {b}; the tokens past their last id are theirs "
                      f"alone (is hash_block_tokens right? Mooncake's is 512, Alibaba's 16)", stacklevel=3)
    return contents


@dataclass(frozen=True)
class RequestSpecs:
    arrival_s: np.ndarray          # float64, non-decreasing
    prompt_tokens: np.ndarray      # int64 > 0
    output_tokens: np.ndarray      # int64 > 0 (the true output length)
    num_dropped: int = 0           # trace rows that could not be replayed
    max_tokens: np.ndarray | None = None   # per-request client max_tokens (trace column)
    contents: Contents | None = None       # what the prompts hold (None: nothing shared)
    # Multi-turn sessions: session s is requests sessions[s] .. sessions[s + 1] - 1, its turns in
    # order (int64, number of sessions + 1 offsets; None: no sessions). A turn's arrival_s is the
    # earliest it may be sent, its session's start: the feed sends it after the previous reply.
    sessions: np.ndarray | None = None

    def __len__(self) -> int:
        return len(self.arrival_s)


def _synthetic_arrivals(cfg: Traffic, rng: np.random.Generator, n_max: int) -> np.ndarray:
    a = cfg.arrivals
    n = n_max
    if a.kind in ("all_at_once", "concurrency"):
        # A closed loop's times are only the earliest each request may go:
        # the driver sends it when a client is free (sim.loop.feed.feed_capped).
        return np.zeros(n)
    assert a.rate is not None, "validated: synthetic arrivals have a rate"
    mean_gap = 1.0 / a.rate
    if a.kind == "poisson":
        gaps = rng.exponential(mean_gap, n)
    elif a.kind == "gamma":
        # Gamma gaps with shape k = 1/cv^2 and scale = mean/k: mean 1/rate, CV = cv.
        shape = 1.0 / (a.cv * a.cv)
        gaps = rng.gamma(shape, mean_gap / shape, n)
    else:
        gaps = np.full(n, mean_gap)
    gaps[0] = 0.0
    return np.cumsum(gaps)


def _bounded_zipf(rng: np.random.Generator, lo: int, hi: int, alpha: float, n: int) -> np.ndarray:
    """Lengths in [lo, hi] with P(k) proportional to k^-alpha."""
    ks = np.arange(lo, hi + 1, dtype=np.float64)
    p = ks ** -alpha
    return rng.choice(np.arange(lo, hi + 1), size=n, p=p / p.sum())


def prefix_repetition(cfg: Traffic, rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray, Contents]:
    """``n`` requests of lengths kind prefix_repetition, built as ``vllm bench
    serve --dataset-name prefix_repetition`` builds them (vLLM's
    ``PrefixRepetitionRandomDataset``), with its four parameters: ``num_prefixes``
    prefixes of ``prefix_len`` tokens, each followed by ``n // num_prefixes``
    requests' own suffixes of ``suffix_len`` tokens, every request asking for
    ``output_len`` tokens; the list, prefix by prefix, is then shuffled. The
    same: the structure, the counts per prefix, the fixed output length, the
    shuffle (a uniform permutation). Different: lengths are exact (vLLM's
    random token ids can re-tokenize a few tokens longer or shorter); the
    tokens are keys, not ids, so no two suffixes or prefixes share a token by
    chance; the shuffle draws from the prompt-length stream (``rng``), not
    Python's ``random``, so the order differs from vLLM's for the same seed;
    and where ``num_prefixes`` does not divide ``n``, vLLM makes only
    ``num_prefixes * (n // num_prefixes)`` requests, while here the first
    ``n % num_prefixes`` prefixes get one request more, so ``n`` are made."""
    ln = cfg.lengths
    if n < ln.num_prefixes:
        raise ConfigError(f"{cfg.source}: field 'lengths.num_prefixes' ({ln.num_prefixes:,}) is more than the "
                          f"{n:,} requests to make; every prefix needs a request (vllm bench serve refuses it "
                          f"too): lower num_prefixes")
    per, extra = divmod(n, ln.num_prefixes)
    if extra and cfg.num_requests is not None:
        warnings.warn(f"{cfg.source}: num_requests {n:,} is not a multiple of lengths.num_prefixes "
                      f"{ln.num_prefixes:,}: the first {extra:,} prefixes get {per + 1:,} requests, the others "
                      f"{per:,} (vllm bench serve would send only {per * ln.num_prefixes:,}, {per:,} each)",
                      stacklevel=3)
    counts = np.full(ln.num_prefixes, per, np.int64)
    counts[:extra] += 1
    prefix = np.repeat(np.arange(ln.num_prefixes, dtype=np.int64), counts)[rng.permutation(n)]
    keys = np.empty(2 * n, np.int64)
    keys[0::2] = REPEAT_PREFIX + prefix
    keys[1::2] = REPEAT_SUFFIX + np.arange(n, dtype=np.int64)
    lengths = np.empty(2 * n, np.int64)
    lengths[0::2], lengths[1::2] = ln.prefix_len, ln.suffix_len
    contents = Contents(keys, lengths, np.arange(0, 2 * n + 1, 2, dtype=np.int64),
                        REPEAT_OUTPUT + np.arange(n, dtype=np.int64))
    return (np.full(n, ln.prefix_len + ln.suffix_len, np.int64), np.full(n, ln.output_len, np.int64), contents)


def _lengths(cfg: Traffic, streams: list[np.random.Generator],
             n: int) -> tuple[np.ndarray, np.ndarray, Contents | None]:
    """Prompt and output lengths of ``n`` requests, and their contents where the kind says what
    prompts share (prefix_repetition, or a length file with hash ids)."""
    ln = cfg.lengths
    rp, ro = streams
    if ln.kind == "prefix_repetition":
        return prefix_repetition(cfg, rp, n)
    if ln.kind == "fixed":
        return np.full(n, ln.prompt_tokens, np.int64), np.full(n, ln.output_tokens, np.int64), None
    if ln.kind == "uniform":
        return (rp.integers(ln.prompt_min, ln.prompt_max + 1, n),
                ro.integers(ln.output_min, ln.output_max + 1, n), None)
    if ln.kind == "lognormal":
        def draw(rng: np.random.Generator, mean: float, lo: int, hi: int | None) -> np.ndarray:
            # Lognormal with the requested mean: mu = log(mean) - sigma^2 / 2.
            mu = np.log(mean) - ln.sigma ** 2 / 2
            x = np.rint(rng.lognormal(mu, ln.sigma, n)).astype(np.int64)
            return np.clip(x, lo, hi if hi is not None else np.iinfo(np.int64).max)
        return (draw(rp, ln.prompt_mean, ln.prompt_min, ln.prompt_max),
                draw(ro, ln.output_mean, ln.output_min, ln.output_max), None)
    if ln.kind == "zipf":
        return (_bounded_zipf(rp, ln.prompt_min, ln.prompt_max, ln.alpha, n),
                _bounded_zipf(ro, ln.output_min, ln.output_max, ln.alpha, n), None)
    # empirical: pairs from a length file, keeping prompt/output correlated (and a row's hash ids:
    # a row drawn twice repeats its ids, not its own tokens)
    data = load_trace(cfg.resolve_path(ln.path), need_arrivals=False, columns=ln.columns,
                      columns_field="lengths.columns")
    if data.num_dropped:
        warnings.warn(f"{cfg.source}: {data.num_dropped} rows of lengths.path with a zero token count were "
                      f"dropped (they cannot be replayed)", stacklevel=2)
    if ln.sample == "sequential":
        idx = np.arange(n) % len(data.prompt_tokens)
    else:
        idx = rp.integers(0, len(data.prompt_tokens), n)
    contents = _trace_contents(cfg, data, idx, np.arange(n), "lengths.path")
    return data.prompt_tokens[idx], data.output_tokens[idx], contents


# Peak memory of a simulation per request, with a margin: the token and step
# logs spill to disk (sim.core.logs), only requests in flight are objects, and the
# requests table is compact (sim.results.table, 58 bytes a request), so what grows is
# ~0.1-0.3 KB per request (1M ShareGPT-length requests peaked at ~0.28 GB,
# 100k at ~0.19 GB): what the size estimate below refuses on.
BYTES_PER_REQUEST = 1_000


def _physical_memory_bytes() -> int:
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return 1 << 40


def check_size(cfg: Traffic, num_requests: float, field: str, num_runs: float = 0) -> None:
    """Refuse, before anything is allocated, a workload that cannot fit this
    machine's memory (a MemoryError later would come after minutes of work);
    ``num_runs``: the runs of prompt contents it holds (``RUN_BYTES`` each)."""
    need = num_requests * BYTES_PER_REQUEST + num_runs * RUN_BYTES
    have = _physical_memory_bytes()
    if need > have:
        runs = f" and {num_runs:.3g} runs of prompt contents" if num_runs else ""
        raise ConfigError(f"{cfg.source}: field '{field}' asks for about {num_requests:.3g} requests{runs}, "
                          f"~{need / 2**30:.3g} GiB at ~{BYTES_PER_REQUEST // 1000} KB a request, more than this "
                          f"machine's {have / 2**30:.1f} GiB; lower it or split the run")


# A run of prompt contents (Contents): its key and length (16 bytes), with the temporaries that build them.
RUN_BYTES = 64


def _trace(cfg: Traffic) -> RequestSpecs:
    a = cfg.arrivals
    data = load_trace(cfg.resolve_path(a.path), need_arrivals=True, columns=a.columns,
                      time_unit=a.time_unit)
    t = data.arrival_s
    rows = len(t)
    span = float(t[-1]) if rows > 1 else 0.0
    period = span + span / max(rows - 1, 1)        # copy k is the trace shifted by k periods
    # Only the copies that matter are built: none wholly before start_s (copy k ends at span + k
    # period; one fewer is skipped, to be safe at equality) and, with num_requests, no more than
    # it takes (the first copy kept may lie partly before start_s: one more).
    first = max(0, math.ceil((a.start_s - span) / period) - 1) if period > 0 and a.start_s > span else 0
    first = min(first, a.repeat)
    last = a.repeat
    if cfg.num_requests is not None:
        last = min(last, first + -(-cfg.num_requests // rows) + 1)
    else:
        check_size(cfg, float(rows) * (last - first), "arrivals.repeat")
    copies = last - first
    t = np.concatenate([t + k * period for k in range(first, last)]) if copies else t[:0]
    prompt = np.tile(data.prompt_tokens, copies)
    output = np.tile(data.output_tokens, copies)
    max_tokens = np.tile(data.max_tokens, copies) if data.max_tokens is not None else None
    # Each request's trace row, and its serial number (unique across copies): its content's own keys.
    serial = np.arange(first * rows, last * rows, dtype=np.int64)
    keep = t >= a.start_s
    t, prompt, output, serial = t[keep] - a.start_s, prompt[keep], output[keep], serial[keep]
    max_tokens = max_tokens[keep] if max_tokens is not None else None
    if len(t) == 0:
        raise ConfigError(f"{cfg.source}: field 'arrivals.start_s' ({a.start_s}) is past the "
                          f"trace's last arrival")
    t = t * a.time_scale / a.rate_scale
    if len(t) and float(t[-1]) > MAX_SPAN_S:
        raise ConfigError(f"{cfg.source}: fields 'arrivals.repeat', 'arrivals.time_scale' and 'arrivals.rate_scale' "
                          f"({a.repeat:,}, {a.time_scale:g}, {a.rate_scale:g}) replay the trace over {float(t[-1]):.3g} "
                          f"s, past the {MAX_SPAN_S:g} s (31 years) a run can span; replay fewer copies or faster")
    if cfg.num_requests is not None:               # the rate below is the replayed sample's
        n = cfg.num_requests
        if n > len(t):
            warnings.warn(f"{cfg.source}: num_requests is {n:,} but the trace holds {len(t):,} requests"
                          f"{' after arrivals.start_s' if a.start_s else ''}; replaying those {len(t):,} "
                          f"(arrivals.repeat: {-(-n // len(t))} would replay it back to back)", stacklevel=2)
        t, prompt, output, serial = t[:n], prompt[:n], output[:n], serial[:n]
        max_tokens = max_tokens[:n] if max_tokens is not None else None
    if a.rate is not None and not (len(t) > 1 and t[-1] > 0):
        warnings.warn(f"{cfg.source}: arrivals.rate has no effect: the replayed requests all arrive at "
                      f"once (one request, or one timestamp), so there is no rate to rescale", stacklevel=2)
    if a.rate is not None and len(t) > 1 and t[-1] > 0:
        # arrivals.rate: the mean rate of the requests replayed, (n - 1) / span
        t = t * ((len(t) - 1) / t[-1]) / a.rate       # rescale to the requested mean rate
    # Repeating a trace repeats its content: every copy of a row has the row's hash ids (a copy
    # hits the cache the original filled, as a replayed request would), but tokens the ids do not
    # cover and outputs stay each request's own.
    contents = (_trace_contents(cfg, data, serial % rows, serial, "arrivals.path")
                if cfg.lengths.kind == "trace" else None)
    return RequestSpecs(t, prompt, output, data.num_dropped, max_tokens, contents)


# Key spaces of sessions' contents (key_space): the system prompt and each turn's user tokens,
# and each turn's answer.
USER_KEYS, ANSWER_KEYS = key_space(4), key_space(5)


def _session_turns(cfg: Traffic, rng: np.random.Generator, num_sessions: int, field: str,
                   prompt_rng: np.random.Generator, output_rng: np.random.Generator
                   ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Each session's number of turns, and each turn's user and output tokens
    (sessions in order, their turns in order): from a session file (``rng``
    picks its sessions) or drawn (``rng`` the number of turns, the lengths
    section each turn's tokens). A session of T turns holds T (T + 1) runs
    of contents (T^2, and T of the system prompt), counted in the size check."""
    ln, turns_range = cfg.lengths, num_turns_range(cfg.sessions)
    if ln.kind == "sessions":
        data = load_sessions(cfg.resolve_path(ln.path))
        counts = data.num_turns
        pool = np.arange(len(counts))
        if turns_range is not None:
            pool = pool[(counts >= turns_range[0]) & (counts <= turns_range[1])]
            if not len(pool):
                want = turns_range[0] if turns_range[0] == turns_range[1] else list(turns_range)
                raise ConfigError(f"{cfg.source}: field 'sessions.num_turns' ({want}): no session of lengths.path "
                                  f"has that many turns (its sessions have {counts.min()} to {counts.max()})")
        pick = (pool[np.arange(num_sessions) % len(pool)] if ln.sample == "sequential"
                else pool[rng.integers(0, len(pool), num_sessions)])
        turns = counts[pick]
        check_size(cfg, float(turns.sum()), field, float((turns * (turns + 1)).sum()))
        rows = np.arange(int(turns.sum())) - np.repeat(np.cumsum(turns) - turns, turns) + np.repeat(
            data.starts[pick], turns)
        return turns, data.user_tokens[rows], data.output_tokens[rows]
    lo, hi = turns_range
    turns = np.full(num_sessions, lo, np.int64) if lo == hi else rng.integers(lo, hi + 1, num_sessions)
    check_size(cfg, float(turns.sum()), field, float((turns * (turns + 1)).sum()))
    user, output, shared = _lengths(cfg, [prompt_rng, output_rng], int(turns.sum()))
    if shared is not None:
        raise ConfigError(f"{cfg.source}: field 'lengths.kind' {ln.kind!r} says what prompts share (shared "
                          f"prefixes or hash ids), which a session's turns cannot: under arrivals.kind "
                          f"sessions each turn's prompt is its session's history + new user tokens; use a "
                          f"length kind without shared content, or sessions.system_prompt_tokens for a "
                          f"prefix all sessions share")
    return turns, np.asarray(user, np.int64), np.asarray(output, np.int64)


def _sessions(cfg: Traffic, streams: list[np.random.Generator]) -> RequestSpecs:
    """Multi-turn sessions (``arrivals.kind sessions``): requests by session, then
    turn. Sessions start by a Poisson process at ``arrivals.rate`` (all at 0
    without one: then ``max_concurrency`` paces them), as many as
    ``sessions.num_sessions``, those that start within ``duration_s``.

    Turn k's prompt is the system prompt (one run, key ``USER_KEYS``, shared
    by every session), then for each earlier turn j its user tokens (key
    ``USER_KEYS + 1 + id of turn j``) and its answer (``ANSWER_KEYS + id``:
    the run of that turn's output tokens, as long as its true output), then
    its own user tokens: request i's runs are the system prompt and runs
    ``2 * first .. 2 * i`` of the sequence user_0, answer_0, user_1, answer_1,
    ... of its session's requests (first: its session's first request)."""
    arr_rng, prompt_rng, output_rng, turn_rng = streams
    a, s = cfg.arrivals, cfg.sessions
    if s.num_sessions is not None:
        num, field = s.num_sessions, "sessions.num_sessions"
    else:   # enough sessions to cover duration_s with a wide margin; cut below
        num = int(a.rate * cfg.duration_s * 1.5 + 10 * np.sqrt(a.rate * cfg.duration_s) + 10)
        field = "duration_s"
    check_size(cfg, float(num), field)             # at least a request a session, before any array
    if a.rate is None:
        start = np.zeros(num)
    else:
        gaps = arr_rng.exponential(1.0 / a.rate, num)
        gaps[0] = 0.0
        start = np.cumsum(gaps)
        if cfg.duration_s is not None:
            start = start[start <= cfg.duration_s]
    turns, user, output = _session_turns(cfg, turn_rng, len(start), field, prompt_rng, output_rng)
    n = int(turns.sum())
    first = np.cumsum(turns) - turns               # each session's first request id
    first_of = np.repeat(first, turns)             # ... of each request
    turn = np.arange(n) - first_of
    # Prompt i: system prompt + users of turns 0..k + answers of turns 0..k-1 of its session.
    system = s.system_prompt_tokens
    done = np.cumsum(user + output)                # over all requests, both kinds
    prompt = system + done - output - (done - user - output)[first_of]
    if n and prompt.max() > MAX_TOKEN_COUNT:       # no server takes it, and no table holds the count
        raise ConfigError(f"{cfg.source}: field 'sessions.num_turns': a session's prompt grows to "
                          f"{int(prompt.max()):,} tokens, past {MAX_TOKEN_COUNT:,}; fewer turns or shorter ones")
    # Runs: the sequence user_0, answer_0, user_1, ... over all requests (2i: user, 2i + 1: answer),
    # the system prompt after them at 2n; request i takes [2n] + 2 * first .. 2 * i.
    ids = np.arange(n, dtype=np.int64)
    seq_keys = np.empty(2 * n + 1, np.int64)
    seq_lens = np.empty(2 * n + 1, np.int64)
    seq_keys[0:2 * n:2], seq_keys[1:2 * n:2], seq_keys[2 * n] = USER_KEYS + 1 + ids, ANSWER_KEYS + ids, USER_KEYS
    seq_lens[0:2 * n:2], seq_lens[1:2 * n:2], seq_lens[2 * n] = user, output, system
    own = 2 * turn + 1                             # runs of request i after the system prompt
    count = own + (system > 0)
    run_starts = np.concatenate([[0], np.cumsum(count)]).astype(np.int64)
    pos = np.arange(int(run_starts[-1])) - np.repeat(run_starts[:-1], count)     # run r's place in its prompt
    index = np.repeat(2 * first_of, count) + pos - (system > 0)
    if system > 0:
        index[run_starts[:-1]] = 2 * n
    contents = Contents(seq_keys[index], seq_lens[index], run_starts, ANSWER_KEYS + ids)
    arrival = np.repeat(start, turns)
    return RequestSpecs(arrival, prompt.astype(np.int64), output, contents=contents,
                        sessions=np.concatenate([first, [n]]).astype(np.int64))


def generate(cfg: Traffic) -> RequestSpecs:
    """The workload's requests, in arrival order, truncated by num_requests /
    duration_s (sessions: by session then turn, arrival_s the session's
    start). Deterministic for a given config and seed."""
    if cfg.arrivals.kind == "sessions":
        return _sessions(cfg, [np.random.default_rng(s) for s in np.random.SeedSequence(cfg.seed).spawn(4)])
    if cfg.num_requests is not None:
        check_size(cfg, float(cfg.num_requests), "num_requests")
    ss = np.random.SeedSequence(cfg.seed)
    arr_rng, prompt_rng, output_rng = (np.random.default_rng(s) for s in ss.spawn(3))
    if cfg.arrivals.kind == "trace":
        specs = _trace(cfg)
        if cfg.lengths.kind != "trace":
            p, o, contents = _lengths(cfg, [prompt_rng, output_rng], len(specs))
            specs = RequestSpecs(specs.arrival_s, p, o, specs.num_dropped, specs.max_tokens, contents)
    else:
        if cfg.num_requests is not None:
            n = cfg.num_requests
        else:
            # Enough arrivals to cover duration_s with a wide margin; cut below.
            rate = cfg.arrivals.rate or 1.0
            check_size(cfg, rate * cfg.duration_s, "duration_s")
            n = int(rate * cfg.duration_s * 1.5 + 10 * np.sqrt(rate * cfg.duration_s) + 10)
        t = _synthetic_arrivals(cfg, arr_rng, n)
        p, o, contents = _lengths(cfg, [prompt_rng, output_rng], n)
        specs = RequestSpecs(t, np.asarray(p, np.int64), np.asarray(o, np.int64), contents=contents)
    keep = np.ones(len(specs), bool)
    if cfg.duration_s is not None:
        keep &= specs.arrival_s <= cfg.duration_s
    if cfg.num_requests is not None:
        keep &= np.arange(len(specs)) < cfg.num_requests
    if specs.num_dropped:
        warnings.warn(f"{cfg.source}: {specs.num_dropped} trace rows with a zero token count were "
                      f"dropped (they cannot be replayed)", stacklevel=2)
    if keep.all():
        return specs
    return RequestSpecs(specs.arrival_s[keep], specs.prompt_tokens[keep], specs.output_tokens[keep],
                        specs.num_dropped,
                        specs.max_tokens[keep] if specs.max_tokens is not None else None,
                        specs.contents.take(keep) if specs.contents is not None else None)

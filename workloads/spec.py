"""What traffic a workload asks for: the arrivals, lengths and sessions
sections, their checks, and the ``Traffic`` that ``workloads.generate`` draws
requests from.

The rest of a workload (server, profile, policy, slo) is ``sim.run.config``'s;
this module imports only ``sim.base``.
"""

from __future__ import annotations

import dataclasses
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from sim.base.strict import MAX_COUNT, MAX_SPAN_S, ConfigError, _positive, _require, did_you_mean


@dataclass(frozen=True, slots=True)
class ArrivalsConfig:
    kind: str = "poisson"          # poisson | gamma | constant | all_at_once | trace | concurrency | sessions
    rate: float | None = None      # req/s; for a trace: rescale its mean rate to this; sessions: new sessions/s
    cv: float = 1.0                # gamma: coefficient of variation of the gaps (burstiness)
    path: str | None = None        # trace file (CSV/JSONL); relative to the workload file
    time_scale: float = 1.0        # trace: multiply timestamps (0.5 = replay twice as fast)
    rate_scale: float = 1.0        # trace: multiply the arrival rate (2 = twice the traffic)
    start_s: float = 0.0           # trace: skip arrivals before this time
    columns: dict[str, str] | None = None  # trace: {arrival, prompt, output} column names
    time_unit: str | None = None   # trace: s | ms | us | ns | datetime (guessed when omitted)
    repeat: int = 1                # trace: replay the trace this many times back to back
    # A closed-loop client population (vllm bench serve --max-concurrency):
    # at most this many requests in flight; each client sends its next request
    # when its last one finished or was refused (plus think_time_s), never
    # before the request's drawn arrival. Required by kind concurrency (a pure
    # closed loop); with another kind it caps that kind's arrivals; with kind
    # sessions, at most this many sessions are under way at once.
    max_concurrency: int | None = None
    think_time_s: float = 0.0      # max_concurrency, sessions: a client's pause between reply and next send
    num_requests: int | None = None  # the top-level num_requests, spelled inside arrivals


@dataclass(frozen=True, slots=True)
class LengthsConfig:
    # Under arrivals.kind sessions every kind but trace draws each turn's lengths: prompt is the
    # turn's new user tokens (the history before them is the session's), output its answer;
    # kind sessions takes whole sessions from a session file instead.
    kind: str = "trace"            # trace | fixed | uniform | lognormal | zipf | empirical | prefix_repetition | sessions
    prompt_tokens: int | None = None     # fixed
    output_tokens: int | None = None     # fixed
    prompt_min: int = 1                  # uniform, zipf
    prompt_max: int | None = None        # uniform, zipf; cap for lognormal
    output_min: int = 1
    output_max: int | None = None
    prompt_mean: float | None = None     # lognormal
    output_mean: float | None = None     # lognormal
    sigma: float = 1.0                   # lognormal: std of log(length)
    alpha: float = 1.2                   # zipf exponent
    path: str | None = None              # empirical: a length file (prompt_tokens, output_tokens); sessions: a
    #                                      session file (session, turn, user_tokens, output_tokens)
    sample: str = "random"               # empirical, sessions: random (with replacement) | sequential
    columns: dict[str, str] | None = None  # empirical: {prompt, output, hash_ids} column names
    # trace, empirical: prompt tokens each id of a hash_ids column covers (Mooncake 512, Alibaba 16)
    hash_block_tokens: int = 512
    # prefix_repetition (vllm bench serve --dataset-name prefix_repetition, its defaults):
    prefix_len: int = 256                # tokens of each shared prefix
    suffix_len: int = 256                # tokens of each request's own suffix
    num_prefixes: int = 10               # distinct prefixes; requests split evenly among them
    output_len: int = 128                # every request's output tokens


@dataclass(frozen=True, slots=True)
class SessionsConfig:
    """Multi-turn sessions (``arrivals.kind sessions``). Session turn k + 1's
    prompt is turn k's prompt, then turn k's answer, then the turn's new user
    tokens; the first turn's is the shared system prompt, then its user
    tokens. Each turn's user and output tokens come from the lengths section
    (drawn per turn, or whole sessions from a session file)."""

    num_sessions: int | None = None      # how many sessions (else duration_s: those that start within it)
    # Turns per session: N, or [min, max] drawn uniformly; with a session file (lengths.kind
    # sessions), the file's sessions with that many turns (all of them when left out).
    num_turns: int | list[int] | None = None
    system_prompt_tokens: int = 0        # a prefix shared by every session's prompts


class Traffic(Protocol):
    """What request generation reads of a workload (``sim.run.config.WorkloadConfig`` is one)."""

    seed: int
    num_requests: int | None
    duration_s: float | None
    arrivals: ArrivalsConfig
    lengths: LengthsConfig
    sessions: SessionsConfig | None  # with arrivals.kind sessions
    source: str                      # the file, for messages

    def resolve_path(self, path: str) -> Path: ...


ARRIVAL_KINDS = ("poisson", "gamma", "constant", "all_at_once", "trace", "concurrency", "sessions")
LENGTH_KINDS = ("trace", "fixed", "uniform", "lognormal", "zipf", "empirical", "prefix_repetition", "sessions")


def check_arrivals(a: ArrivalsConfig, src: str) -> None:
    """The arrivals section on its own (``src`` names the file); warns of fields its kind never reads."""
    if a.kind not in ARRIVAL_KINDS:
        raise ConfigError(f"{src}: field 'arrivals.kind' must be one of {', '.join(ARRIVAL_KINDS)}, "
                          f"got {a.kind!r}")
    if a.kind in ("poisson", "gamma", "constant"):
        _require(src, "arrivals.rate", a.rate, f"for arrivals.kind {a.kind} (requests per second)")
    if a.kind == "trace":
        _require(src, "arrivals.path", a.path, "for arrivals.kind trace (a CSV or JSONL file)")
    if a.kind == "concurrency":
        _require(src, "arrivals.max_concurrency", a.max_concurrency,
                 "for arrivals.kind concurrency (how many clients send at once, e.g. 8)")
        if a.rate is not None:
            raise ConfigError(f"{src}: field 'arrivals.rate' does not apply to arrivals.kind concurrency "
                              f"(its clients send as fast as replies come back); to cap a request rate use "
                              f"arrivals: {{kind: poisson, rate: R, max_concurrency: N}} (vllm bench serve "
                              f"--request-rate R --max-concurrency N)")
    if a.kind == "sessions" and a.rate is None and a.max_concurrency is None:
        raise ConfigError(f"{src}: field 'arrivals.rate' is required for arrivals.kind sessions (new sessions "
                          f"per second, Poisson), unless arrivals.max_concurrency caps how many run at once "
                          f"(then each starts when one ends, as vLLM's multi-turn benchmark's clients)")
    _positive(src, "arrivals.max_concurrency", a.max_concurrency)
    _positive(src, "arrivals.think_time_s", a.think_time_s, allow_zero=True)
    if a.think_time_s > 0 and a.max_concurrency is None and a.kind != "sessions":
        raise ConfigError(f"{src}: field 'arrivals.think_time_s' needs arrivals.max_concurrency or arrivals.kind "
                          f"sessions (it is a closed-loop client's pause; open-loop arrivals have no clients)")
    for name in ("rate", "cv", "time_scale", "rate_scale"):
        _positive(src, f"arrivals.{name}", getattr(a, name))
    if a.rate is not None and not MIN_RATE <= a.rate <= MAX_RATE:   # 1e300 req/s: gaps below float resolution
        raise ConfigError(f"{src}: field 'arrivals.rate' must be in [{MIN_RATE:g}, {MAX_RATE:g}] requests per "
                          f"second, got {a.rate:g}")
    if a.think_time_s > MAX_THINK_S:
        raise ConfigError(f"{src}: field 'arrivals.think_time_s' must be at most {MAX_THINK_S:g} s, "
                          f"got {a.think_time_s:g}")
    if not MIN_CV <= a.cv <= MAX_CV:        # gamma shape 1/cv^2: 1e-300 divides by zero, 1e6 is one burst
        raise ConfigError(f"{src}: field 'arrivals.cv' must be in [{MIN_CV:g}, {MAX_CV:g}] (the gaps' coefficient "
                          f"of variation: 1 is Poisson, < 1 more regular, > 1 burstier), got {a.cv:g}")
    for name in ("time_scale", "rate_scale"):
        if not MIN_SCALE <= getattr(a, name) <= MAX_SCALE:
            raise ConfigError(f"{src}: field 'arrivals.{name}' must be in [{MIN_SCALE:g}, {MAX_SCALE:g}] (a factor on "
                              f"the trace's times or rate), got {getattr(a, name):g}")
    _positive(src, "arrivals.start_s", a.start_s, allow_zero=True)
    if a.start_s > MAX_SPAN_S:
        raise ConfigError(f"{src}: field 'arrivals.start_s' must be at most {MAX_SPAN_S:g} s (31 years), "
                          f"got {a.start_s:g}")
    _positive(src, "arrivals.repeat", a.repeat)
    if a.time_unit not in TIME_UNITS:
        raise ConfigError(f"{src}: field 'arrivals.time_unit' must be one of {', '.join(TIME_UNITS[1:])}, "
                          f"got {a.time_unit!r}")
    _check_columns(a.columns, "arrivals.columns", ("arrival", "prompt", "output", "max_tokens", "hash_ids"), src)
    _warn_unused("arrivals", a, ARRIVAL_FIELD_KINDS, src)
    if a.kind == "trace" and a.rate is not None:
        scaled = [name for name in ("time_scale", "rate_scale") if getattr(a, name) != 1.0]
        if scaled:
            warnings.warn(f"{src}: arrivals.{' and arrivals.'.join(scaled)} ignored: arrivals.rate rescales the "
                          f"replayed trace to its own mean rate (keep one of them)", stacklevel=4)


# Which kinds read a field (the others ignore it): a field set to other than its default
# under another kind is set aside with a warning, as another policy's knob is, so one
# file or sweep can switch kinds while a typo-like slip (cv on poisson) is still seen.
_TRACE = ("trace",)
ARRIVAL_FIELD_KINDS: dict[str, tuple[str, ...]] = {
    "rate": ("poisson", "gamma", "constant", "trace", "sessions"), "cv": ("gamma",), "path": _TRACE,
    "time_scale": _TRACE, "rate_scale": _TRACE, "start_s": _TRACE, "columns": _TRACE, "time_unit": _TRACE,
    "repeat": _TRACE}
LENGTH_FIELD_KINDS: dict[str, tuple[str, ...]] = {
    "prompt_tokens": ("fixed",), "output_tokens": ("fixed",),
    "prompt_min": ("uniform", "lognormal", "zipf"), "output_min": ("uniform", "lognormal", "zipf"),
    "prompt_max": ("uniform", "lognormal", "zipf"), "output_max": ("uniform", "lognormal", "zipf"),
    "prompt_mean": ("lognormal",), "output_mean": ("lognormal",), "sigma": ("lognormal",),
    "alpha": ("zipf",), "path": ("empirical", "sessions"), "sample": ("empirical", "sessions"),
    "columns": ("empirical",), "hash_block_tokens": ("trace", "empirical"), "prefix_len": ("prefix_repetition",),
    "suffix_len": ("prefix_repetition",), "num_prefixes": ("prefix_repetition",),
    "output_len": ("prefix_repetition",)}


def _warn_unused(section: str, cfg: Any, uses: dict[str, tuple[str, ...]], src: str) -> None:
    """Warn about fields set away from their default that ``cfg.kind`` does not read."""
    unused = [f"{section}.{f.name} (read by kind {' / '.join(uses[f.name])})"
              for f in dataclasses.fields(cfg)
              if f.name in uses and cfg.kind not in uses[f.name] and getattr(cfg, f.name) != f.default]
    if unused:
        warnings.warn(f"{src}: {', '.join(unused)} not used by {section}.kind {cfg.kind} (ignored)", stacklevel=4)


TIME_UNITS = (None, "s", "ms", "us", "ns", "datetime")
MIN_CV, MAX_CV = 0.001, 100.0
MIN_RATE, MAX_RATE = 1e-6, 1e6        # requests per second: one in 11 days .. a million a second
MAX_THINK_S = 1e6
MAX_TOKEN_COUNT = MAX_COUNT           # as traces hold token counts
MIN_SCALE, MAX_SCALE = 1e-6, 1e6      # a trace's time_scale and rate_scale


def _check_columns(columns: dict[str, str] | None, name: str, roles: tuple[str, ...], src: str) -> None:
    """A trace's column mapping names only roles the loader knows, each a column name."""
    for role, column in (columns or {}).items():
        if role not in roles:
            raise ConfigError(f"{src}: field '{name}.{role}' is unknown{did_you_mean(role, roles)}; "
                              f"expected some of {', '.join(roles)}")
        if not isinstance(column, str) or not column.strip():
            raise ConfigError(f"{src}: field '{name}.{role}' must be a column name, got {column!r}")


def check_lengths(ln: LengthsConfig, src: str) -> None:
    """The lengths section on its own (``src`` names the file); warns of fields its kind never reads."""
    if ln.kind not in LENGTH_KINDS:
        raise ConfigError(f"{src}: field 'lengths.kind' must be one of {', '.join(LENGTH_KINDS)}, "
                          f"got {ln.kind!r}")
    need = {"fixed": ("prompt_tokens", "output_tokens"),
            "uniform": ("prompt_max", "output_max"),
            "lognormal": ("prompt_mean", "output_mean"),
            "zipf": ("prompt_max", "output_max"),
            "empirical": ("path",),
            "sessions": ("path",)}.get(ln.kind, ())
    for name in need:
        _require(src, f"lengths.{name}", getattr(ln, name), f"for lengths.kind {ln.kind}"
                 + (" (a session file: session, turn, user_tokens, output_tokens)" if ln.kind == "sessions" else ""))
    for name in ("prompt_tokens", "output_tokens", "prompt_min", "prompt_max", "output_min",
                 "output_max", "prompt_mean", "output_mean", "sigma", "alpha"):
        _positive(src, f"lengths.{name}", getattr(ln, name))
    for name in ("prompt_tokens", "output_tokens", "prompt_min", "prompt_max", "output_min", "output_max",
                 "prompt_mean", "output_mean"):
        if getattr(ln, name) is not None and getattr(ln, name) > MAX_TOKEN_COUNT:    # 1e15 overflowed int32
            raise ConfigError(f"{src}: field 'lengths.{name}' must be at most {MAX_TOKEN_COUNT:,} (a token count), "
                              f"got {getattr(ln, name):,}")
    for lo, hi in (("prompt_min", "prompt_max"), ("output_min", "output_max")):
        if getattr(ln, hi) is not None and getattr(ln, hi) < getattr(ln, lo):
            raise ConfigError(f"{src}: field 'lengths.{hi}' ({getattr(ln, hi)}) must be >= "
                              f"lengths.{lo} ({getattr(ln, lo)})")
    if ln.sample not in ("random", "sequential"):
        raise ConfigError(f"{src}: field 'lengths.sample' must be random or sequential, got {ln.sample!r}")
    for name in ("hash_block_tokens", "prefix_len", "suffix_len", "num_prefixes", "output_len"):
        _positive(src, f"lengths.{name}", getattr(ln, name))
        if getattr(ln, name) > MAX_TOKEN_COUNT:
            raise ConfigError(f"{src}: field 'lengths.{name}' must be at most {MAX_TOKEN_COUNT:,}, "
                              f"got {getattr(ln, name):,}")
    if ln.kind == "prefix_repetition" and ln.prefix_len + ln.suffix_len > MAX_TOKEN_COUNT:
        raise ConfigError(f"{src}: fields 'lengths.prefix_len' + 'lengths.suffix_len' ({ln.prefix_len:,} + "
                          f"{ln.suffix_len:,}) make prompts over {MAX_TOKEN_COUNT:,} tokens")
    _check_columns(ln.columns, "lengths.columns", ("prompt", "output", "hash_ids"), src)
    if ln.columns and ln.kind != "empirical":
        raise ConfigError(f"{src}: field 'lengths.columns' applies to lengths.kind empirical (a length file); "
                          f"a trace's columns are arrivals.columns"
                          + ("; a session file's are fixed (session, turn, user_tokens, output_tokens)"
                             if ln.kind == "sessions" else ""))
    _warn_unused("lengths", ln, LENGTH_FIELD_KINDS, src)


MAX_TURNS = 1_000      # turns per session: turn k's prompt has 2k + 1 runs, so a session holds ~T^2 runs


def num_turns_range(s: SessionsConfig) -> tuple[int, int] | None:
    """``sessions.num_turns`` as (min, max), None when left out."""
    n = s.num_turns
    if n is None:
        return None
    return (n, n) if isinstance(n, int) else (n[0], n[1])


def check_sessions(t: Traffic, src: str) -> None:
    """Multi-turn sessions (``arrivals.kind sessions``) with their sessions and
    lengths sections and the counts that bound them; and that neither a
    sessions section nor a session file comes without them."""
    a, ln, s = t.arrivals, t.lengths, t.sessions
    if a.kind != "sessions":
        if s is not None:
            raise ConfigError(f"{src}: field 'sessions' applies to arrivals.kind sessions (multi-turn sessions), "
                              f"not {a.kind}; set arrivals: {{kind: sessions, rate: R}} (new sessions per second) "
                              f"or remove the sessions section")
        if ln.kind == "sessions":
            raise ConfigError(f"{src}: field 'lengths.kind' is sessions (a session file) but arrivals.kind is "
                              f"{a.kind}; replay sessions with arrivals: {{kind: sessions, rate: R}}")
        return
    s = s or SessionsConfig()
    if t.num_requests is not None:
        raise ConfigError(f"{src}: field 'num_requests' does not apply to arrivals.kind sessions (its requests are "
                          f"the sessions' turns); set sessions.num_sessions, or duration_s")
    _positive(src, "sessions.num_sessions", s.num_sessions)
    if s.num_sessions is None and t.duration_s is None:
        raise ConfigError(f"{src}: field 'sessions.num_sessions' is required for arrivals.kind sessions (how many "
                          f"sessions run), unless duration_s bounds them (the sessions that start within it)")
    if t.duration_s is not None and a.rate is None:
        raise ConfigError(f"{src}: field 'duration_s' cannot bound arrivals.kind sessions without arrivals.rate "
                          f"(every session may start at 0, as soon as a client is free); set "
                          f"sessions.num_sessions")
    turns = num_turns_range(s)
    if turns is None and ln.kind != "sessions":
        raise ConfigError(f"{src}: field 'sessions.num_turns' is required for arrivals.kind sessions (turns per "
                          f"session: N, or [min, max] drawn uniformly), unless lengths.kind sessions takes "
                          f"whole sessions from a file")
    if isinstance(s.num_turns, list) and len(s.num_turns) != 2:
        raise ConfigError(f"{src}: field 'sessions.num_turns' must be a number or [min, max], got {s.num_turns}")
    if turns is not None and not 1 <= turns[0] <= turns[1] <= MAX_TURNS:
        raise ConfigError(f"{src}: field 'sessions.num_turns' must be N or [min, max] with 1 <= min <= max <= "
                          f"{MAX_TURNS:,}, got {s.num_turns}")
    _positive(src, "sessions.system_prompt_tokens", s.system_prompt_tokens, allow_zero=True)
    if s.system_prompt_tokens > MAX_TOKEN_COUNT:
        raise ConfigError(f"{src}: field 'sessions.system_prompt_tokens' must be at most {MAX_TOKEN_COUNT:,}, "
                          f"got {s.system_prompt_tokens:,}")
    if ln.kind == "trace":
        raise ConfigError(f"{src}: field 'lengths.kind' is trace but arrivals.kind sessions has no trace file; "
                          f"draw each turn's lengths (lengths.kind fixed, uniform, lognormal, zipf or empirical: "
                          f"prompt is a turn's new user tokens, output its answer), or take whole sessions from "
                          f"a session file with lengths: {{kind: sessions, path: mooncake_sessions.csv}}")

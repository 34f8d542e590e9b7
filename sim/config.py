"""Validated configuration: frozen dataclasses built once, at the edge, from YAML.

Every error is a ``ConfigError`` whose message names the file, the field, what
was expected and how to fix it; unknown keys are rejected with the list of
allowed ones. Sweeps and ``--set`` overrides edit the *raw* mapping
(``set_dotted``) and validate again, so a variant is checked like a file.
"""

from __future__ import annotations

import dataclasses
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

import yaml

from policies import POLICIES
from sim.strict import ConfigError, _positive, _require, build, did_you_mean, load_yaml

__all__ = ["ConfigError", "WorkloadConfig", "load_workload", "load_yaml_mapping", "parse_override",
           "set_dotted", "workload_from_dict"]


@dataclass(frozen=True, slots=True)
class ArrivalsConfig:
    kind: str = "poisson"          # poisson | gamma | constant | all_at_once | trace | concurrency
    rate: float | None = None      # req/s; for a trace: rescale its mean rate to this
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
    # closed loop); with another kind it caps that kind's arrivals.
    max_concurrency: int | None = None
    think_time_s: float = 0.0      # with max_concurrency: a client's pause between reply and next send
    num_requests: int | None = None  # the top-level num_requests, spelled inside arrivals


@dataclass(frozen=True, slots=True)
class LengthsConfig:
    kind: str = "trace"            # trace | fixed | uniform | lognormal | zipf | empirical
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
    path: str | None = None              # empirical: a length file (prompt_tokens, output_tokens)
    sample: str = "random"               # empirical: random (with replacement) | sequential
    columns: dict[str, str] | None = None  # empirical: {prompt, output} column names


@dataclass(frozen=True, slots=True)
class ServerConfig:
    block_size: int = 16                 # vLLM default
    gpu_memory_utilization: float = 0.9  # vLLM default
    watermark: float = 0.01              # vLLM default
    max_model_len: int | None = None     # default: the profile's measured server, else the model's context
    num_blocks: int | None = None        # default: the profile's measured server, else its memory facts


@dataclass(frozen=True, slots=True)
class ProfileConfig:
    model: str | dict[str, Any] = "llama-3.1-8b"
    gpu: str = "h100-sxm"
    tensor_parallel: int = 1
    dtype: str = "bf16"
    # The serving engine generation whose host work the analytic preset charges
    # (sim.collectives.ENGINES: vllm-v0 fitted on public runs; vllm-v1, vllm-v1-async).
    engine: str = "vllm-v0"
    path: str | None = None              # a profile file; overrides model/gpu


# The thresholds goodput counts per request (vLLM's --goodput); a workload's slo takes only these.
GOODPUT_KEYS = ("ttft_ms", "tpot_ms", "e2el_ms")


@dataclass(frozen=True, slots=True)
class Slo:
    """Latency targets in ms (None: not constrained), the one SLO type.

    A run's goodput (a workload's ``slo``, vLLM's --goodput) counts the
    completed requests within every one of ``GOODPUT_KEYS``. A plan
    (``reports.experiments``) requires at least ``attainment`` of the requests
    within ttft_ms and tpot_ms and of all token gaps within ``itl_ms``: ITL is
    per gap, not per request, so it is a plan's target only."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None
    e2el_ms: float | None = None
    itl_ms: float | None = None
    attainment: float = 0.99

    def goodput_thresholds(self) -> dict[str, float | None]:
        """The per-request thresholds goodput counts, by key."""
        return {k: getattr(self, k) for k in GOODPUT_KEYS}

    def describe(self) -> str:
        """"p99 TTFT <= 2000 ms, ITL <= 100 ms" (the plan's reading)."""
        parts = [f"{name.split('_')[0].upper()} <= {v:g} ms" for name, v in
                 (("ttft_ms", self.ttft_ms), ("itl_ms", self.itl_ms), ("tpot_ms", self.tpot_ms),
                  ("e2el_ms", self.e2el_ms)) if v is not None]
        return f"p{100 * self.attainment:g} " + ", ".join(parts) if parts else "none"


@dataclass(frozen=True, slots=True)
class WorkloadConfig:
    name: str
    seed: int = 0
    num_requests: int | None = None
    duration_s: float | None = None
    arrivals: ArrivalsConfig = field(default_factory=ArrivalsConfig)
    lengths: LengthsConfig = field(default_factory=LengthsConfig)
    max_tokens: int | str = "output"     # output | context | an integer cap
    policy: Any = None                   # one of the policies' config dataclasses
    server: ServerConfig = field(default_factory=ServerConfig)
    profile: ProfileConfig = field(default_factory=ProfileConfig)
    slo: Slo | None = None
    source: str = "<workload>"
    base_dir: str = "."
    raw: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d.pop("raw")
        if self.slo is not None:                 # a workload's slo holds goodput thresholds only
            d["slo"] = self.slo.goodput_thresholds()
        return d

    def resolve_path(self, path: str) -> Path:
        """A path from the file: relative to the file's folder, else a bundled
        trace by name, else a file shipped with batchsim (e.g.
        ``calibrate/profiles/cpu/tiny-llama/float32.yaml``)."""
        p = Path(path).expanduser()
        if p.is_absolute():
            return p
        local = Path(self.base_dir) / p
        root = Path(__file__).resolve().parent.parent
        # A bare name or traces/NAME may name a bundled trace; any other folder is the user's own.
        bundled = (root / "workloads" / "traces" / p.name,) if p.parent in (Path("."), Path("traces")) else ()
        for candidate in (local, *bundled, root / p):
            if candidate.exists():
                return candidate
        return local


SECTIONS: dict[str, type] = {
    "arrivals": ArrivalsConfig, "lengths": LengthsConfig, "server": ServerConfig,
    "profile": ProfileConfig, "slo": Slo,
}


# ---- the workload ------------------------------------------------------------
ALL_POLICY_KNOBS = frozenset(f.name for cfg_cls, _ in POLICIES.values()
                             for f in dataclasses.fields(cfg_cls)) - {"kind"}
ARRIVAL_KINDS = ("poisson", "gamma", "constant", "all_at_once", "trace", "concurrency")
LENGTH_KINDS = ("trace", "fixed", "uniform", "lognormal", "zipf", "empirical")


def _check_arrivals(a: ArrivalsConfig, src: str) -> None:
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
    _positive(src, "arrivals.max_concurrency", a.max_concurrency)
    _positive(src, "arrivals.think_time_s", a.think_time_s, allow_zero=True)
    if a.think_time_s > 0 and a.max_concurrency is None:
        raise ConfigError(f"{src}: field 'arrivals.think_time_s' needs arrivals.max_concurrency (it is a "
                          f"closed-loop client's pause; open-loop arrivals have no clients)")
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
    _positive(src, "arrivals.start_s", a.start_s, allow_zero=True)
    _positive(src, "arrivals.repeat", a.repeat)
    if a.time_unit not in TIME_UNITS:
        raise ConfigError(f"{src}: field 'arrivals.time_unit' must be one of {', '.join(TIME_UNITS[1:])}, "
                          f"got {a.time_unit!r}")
    _check_columns(a.columns, "arrivals.columns", ("arrival", "prompt", "output", "max_tokens"), src)
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
    "rate": ("poisson", "gamma", "constant", "trace"), "cv": ("gamma",), "path": _TRACE,
    "time_scale": _TRACE, "rate_scale": _TRACE, "start_s": _TRACE, "columns": _TRACE, "time_unit": _TRACE,
    "repeat": _TRACE}
LENGTH_FIELD_KINDS: dict[str, tuple[str, ...]] = {
    "prompt_tokens": ("fixed",), "output_tokens": ("fixed",),
    "prompt_min": ("uniform", "lognormal", "zipf"), "output_min": ("uniform", "lognormal", "zipf"),
    "prompt_max": ("uniform", "lognormal", "zipf"), "output_max": ("uniform", "lognormal", "zipf"),
    "prompt_mean": ("lognormal",), "output_mean": ("lognormal",), "sigma": ("lognormal",),
    "alpha": ("zipf",), "path": ("empirical",), "sample": ("empirical",), "columns": ("empirical",)}


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
MAX_TOKEN_COUNT = 2**31 - 1           # as traces hold token counts


def _check_columns(columns: dict[str, str] | None, name: str, roles: tuple[str, ...], src: str) -> None:
    """A trace's column mapping names only roles the loader knows, each a column name."""
    for role, column in (columns or {}).items():
        if role not in roles:
            raise ConfigError(f"{src}: field '{name}.{role}' is unknown{did_you_mean(role, roles)}; "
                              f"expected some of {', '.join(roles)}")
        if not isinstance(column, str) or not column.strip():
            raise ConfigError(f"{src}: field '{name}.{role}' must be a column name, got {column!r}")


def _check_lengths(ln: LengthsConfig, src: str) -> None:
    if ln.kind not in LENGTH_KINDS:
        raise ConfigError(f"{src}: field 'lengths.kind' must be one of {', '.join(LENGTH_KINDS)}, "
                          f"got {ln.kind!r}")
    need = {"fixed": ("prompt_tokens", "output_tokens"),
            "uniform": ("prompt_max", "output_max"),
            "lognormal": ("prompt_mean", "output_mean"),
            "zipf": ("prompt_max", "output_max"),
            "empirical": ("path",)}.get(ln.kind, ())
    for name in need:
        _require(src, f"lengths.{name}", getattr(ln, name), f"for lengths.kind {ln.kind}")
    for name in ("prompt_tokens", "output_tokens", "prompt_min", "prompt_max", "output_min",
                 "output_max", "prompt_mean", "output_mean", "sigma", "alpha"):
        _positive(src, f"lengths.{name}", getattr(ln, name))
    for lo, hi in (("prompt_min", "prompt_max"), ("output_min", "output_max")):
        if getattr(ln, hi) is not None and getattr(ln, hi) < getattr(ln, lo):
            raise ConfigError(f"{src}: field 'lengths.{hi}' ({getattr(ln, hi)}) must be >= "
                              f"lengths.{lo} ({getattr(ln, lo)})")
    if ln.sample not in ("random", "sequential"):
        raise ConfigError(f"{src}: field 'lengths.sample' must be random or sequential, got {ln.sample!r}")
    _check_columns(ln.columns, "lengths.columns", ("prompt", "output"), src)
    if ln.columns and ln.kind != "empirical":
        raise ConfigError(f"{src}: field 'lengths.columns' applies to lengths.kind empirical (a length file); "
                          f"a trace's columns are arrivals.columns")
    _warn_unused("lengths", ln, LENGTH_FIELD_KINDS, src)


def _fold_num_requests(cfg: WorkloadConfig, src: str) -> WorkloadConfig:
    """``arrivals.num_requests`` is another spelling of the top-level
    ``num_requests`` (the one everything downstream reads): keep one."""
    n = cfg.arrivals.num_requests
    if n is None:
        return cfg
    _positive(src, "arrivals.num_requests", n)
    if cfg.num_requests is not None and cfg.num_requests != n:
        raise ConfigError(f"{src}: fields 'num_requests' ({cfg.num_requests}) and 'arrivals.num_requests' "
                          f"({n}) disagree; keep one of them")
    return dataclasses.replace(cfg, num_requests=n, arrivals=dataclasses.replace(cfg.arrivals, num_requests=None))


def _check_closed_loop(cfg: WorkloadConfig, src: str) -> None:
    """A closed loop's send times follow the replies, so only a count bounds it."""
    if cfg.arrivals.kind != "concurrency":
        return
    if cfg.num_requests is None:
        raise ConfigError(f"{src}: field 'num_requests' is required for arrivals.kind concurrency (how many "
                          f"requests the clients send in all); set num_requests or arrivals.num_requests")
    if cfg.duration_s is not None:
        raise ConfigError(f"{src}: field 'duration_s' cannot bound arrivals.kind concurrency (its send times "
                          f"follow the replies); remove it and set num_requests")


def _chunked_prefill_alias(data: dict[str, Any], src: str) -> dict[str, Any]:
    """vLLM's ``enable_chunked_prefill`` flag, mapped onto the batchsim policy
    that models the scheduler it selects, with a note. vLLM v0 with chunked
    prefill is the ``sarathi`` policy (decode-first, then partial prefills,
    then new prompts under one token budget); without it, ``vllm``. vLLM v1
    and Sarathi always chunk here; v1's --no-enable-chunked-prefill (no
    partial prefill of a new request, budget raised to max_model_len) is not
    modelled, so it is refused."""
    kind = data.get("kind")
    if "enable_chunked_prefill" not in data or not isinstance(kind, str) or kind not in POLICIES:
        return data                       # (an unknown kind is reported by the caller)
    rest = {k: v for k, v in data.items() if k != "enable_chunked_prefill"}
    flag = data["enable_chunked_prefill"]
    if not isinstance(flag, bool):
        raise ConfigError(f"{src}: field 'policy.enable_chunked_prefill' expected true or false, got {flag!r}")
    if kind == "vllm":
        if flag:
            warnings.warn(f"{src}: policy.kind vllm with enable_chunked_prefill true is vLLM v0's chunked-"
                          f"prefill scheduler: simulated as policy.kind sarathi", stacklevel=4)
            return {**rest, "kind": "sarathi"}
        return rest
    if kind in ("vllm_v1", "sarathi") and flag:
        return rest                       # they always chunk
    if kind in ("vllm_v1", "sarathi"):
        raise ConfigError(f"{src}: field 'policy.enable_chunked_prefill' false is not modelled for policy "
                          f"{kind}, which always chunks prefills; for a scheduler without chunked prefill "
                          f"use policy.kind vllm (vLLM v0)")
    raise ConfigError(f"{src}: field 'policy.enable_chunked_prefill' applies to policy.kind vllm, vllm_v1 or "
                      f"sarathi, not {kind!r}; remove it")


def _build_policy(data: Any, src: str) -> Any:
    if data is None:
        data = {"kind": "vllm"}
    if isinstance(data, str):
        data = {"kind": data}
    if not isinstance(data, dict) or "kind" not in data:
        raise ConfigError(f"{src}: field 'policy' needs a 'kind' ({', '.join(POLICIES)})")
    data = _chunked_prefill_alias(data, src)
    kind = data["kind"]
    if not isinstance(kind, str) or kind not in POLICIES:
        raise ConfigError(f"{src}: field 'policy.kind' must be one of {', '.join(POLICIES)}, got {kind!r}"
                          + did_you_mean(kind, list(POLICIES)))
    cls = POLICIES[kind][0]
    own = {f.name for f in dataclasses.fields(cls)}
    knobs = {k: v for k, v in data.items() if k != "kind"}
    # A knob of another policy (say max_num_batched_tokens on static) is set
    # aside with a warning, so one file or sweep can switch policy.kind; a
    # knob of no policy at all is a typo and an error.
    foreign = sorted(k for k in knobs if k not in own and k in ALL_POLICY_KNOBS)
    if foreign:
        warnings.warn(f"{src}: policy.{', policy.'.join(foreign)} not used by policy {kind} (ignored)",
                      stacklevel=3)
    cfg = build(cls, {k: v for k, v in knobs.items() if k not in foreign}, "policy", src)
    for f in dataclasses.fields(cls):
        v = getattr(cfg, f.name)
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            _positive(src, f"policy.{f.name}", v, allow_zero=f.default == 0)   # a default of 0 means "off"
    if kind == "vllm_v1" and not cfg.watermark < 1:
        raise ConfigError(f"{src}: field 'policy.watermark' must be in [0, 1), got {cfg.watermark}")
    reserve = getattr(cfg, "reserve", None)
    if reserve is not None and reserve not in ("max_tokens", "max", "pow2", "oracle"):
        raise ConfigError(f"{src}: field 'policy.reserve' must be max_tokens, max, pow2 or oracle, "
                          f"got {reserve!r}")
    return cfg


def _workload_slo(data: Any, source: str) -> Slo:
    """A workload's slo: goodput thresholds only (ITL and attainment are a plan's targets)."""
    if isinstance(data, dict):
        for key in ("itl_ms", "attainment"):
            if key in data:
                raise ConfigError(f"{source}: field 'slo.{key}' is a plan's target (a share of requests or "
                                  f"token gaps within a threshold), not goodput's; a workload's slo takes "
                                  f"{', '.join(GOODPUT_KEYS)} (vLLM's --goodput): use tpot_ms, or set it in a "
                                  f"plan file")
    return build(Slo, data, "slo", source)


def workload_from_dict(data: Any, source: str = "<workload>", base_dir: str | Path = ".") -> WorkloadConfig:
    """Validate a raw workload mapping into a WorkloadConfig."""
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: expected a mapping of workload fields at the top level, "
                          f"got {type(data).__name__}")
    allowed = [f.name for f in dataclasses.fields(WorkloadConfig) if f.name not in ("source", "base_dir", "raw")]
    for key in data:
        if key in ("base", "vary", "candidates", "target_rate"):
            what = "plan" if {"candidates", "target_rate"} & set(data) else "sweep"
            raise ConfigError(f"{source}: field '{key}' belongs to a {what} file; run it with "
                              f"`sim {what} {source}`")
        if key not in allowed:
            raise ConfigError(f"{source}: unknown field '{key}'{did_you_mean(key, allowed)}; "
                              f"allowed: {', '.join(allowed)}")
    top = {k: v for k, v in data.items() if k not in SECTIONS and k != "policy"}
    if "name" in top and not isinstance(top["name"], str):
        raise ConfigError(f"{source}: field 'name' must be a string (or left out: the file's name), "
                          f"got {top['name']!r}")
    if "name" in top:
        _check_name(top["name"], source)
    top.setdefault("name", Path(source).stem)
    sections = {k: build(cls, data.get(k), k, source) for k, cls in SECTIONS.items() if k != "slo"}
    slo = _workload_slo(data["slo"], source) if data.get("slo") is not None else None
    cfg = build(WorkloadConfig, top, "", source, **sections, slo=slo,
                policy=_build_policy(data.get("policy"), source))
    cfg = dataclasses.replace(cfg, source=str(source), base_dir=str(base_dir), raw=data)
    cfg = _fold_num_requests(cfg, source)
    _check_arrivals(cfg.arrivals, source)
    _check_lengths(cfg.lengths, source)
    if cfg.lengths.kind == "trace" and cfg.arrivals.kind == "concurrency":
        raise ConfigError(f"{source}: field 'lengths.kind' is trace but arrivals.kind concurrency has no trace "
                          f"file; take a file's lengths in order with lengths: {{kind: empirical, path: FILE, "
                          f"sample: sequential}}, or replay its timestamps under a cap with arrivals: "
                          f"{{kind: trace, path: FILE, max_concurrency: N}}")
    if cfg.lengths.kind == "trace" and cfg.arrivals.kind != "trace":
        raise ConfigError(f"{source}: field 'lengths.kind' is trace but arrivals.kind is "
                          f"{cfg.arrivals.kind}; use lengths.kind empirical with a length file")
    _check_closed_loop(cfg, source)
    if cfg.arrivals.kind != "trace" and cfg.num_requests is None and cfg.duration_s is None:
        raise ConfigError(f"{source}: set 'num_requests' or 'duration_s' for synthetic arrivals")
    _positive(source, "seed", cfg.seed, allow_zero=True)
    _positive(source, "num_requests", cfg.num_requests)
    _positive(source, "duration_s", cfg.duration_s)
    if isinstance(cfg.max_tokens, str) and cfg.max_tokens not in ("output", "context"):
        raise ConfigError(f"{source}: field 'max_tokens' must be output, context or an integer, "
                          f"got {cfg.max_tokens!r}")
    if isinstance(cfg.max_tokens, int):
        _positive(source, "max_tokens", cfg.max_tokens)
        if cfg.max_tokens > MAX_TOKEN_COUNT:
            raise ConfigError(f"{source}: field 'max_tokens' must be at most {MAX_TOKEN_COUNT:,} (a token count), "
                              f"got {cfg.max_tokens:,}")
    s = cfg.server
    for name in ("block_size", "max_model_len", "num_blocks"):
        _positive(source, f"server.{name}", getattr(s, name))
    if not 0 < s.gpu_memory_utilization <= 1:
        raise ConfigError(f"{source}: field 'server.gpu_memory_utilization' must be in (0, 1], "
                          f"got {s.gpu_memory_utilization}")
    if not 0 <= s.watermark < 1:
        raise ConfigError(f"{source}: field 'server.watermark' must be in [0, 1), got {s.watermark}")
    _positive(source, "profile.tensor_parallel", cfg.profile.tensor_parallel)
    for name, value in (("arrivals.path", cfg.arrivals.path), ("lengths.path", cfg.lengths.path),
                         ("profile.path", cfg.profile.path)):
        if value is not None and (not isinstance(value, str) or not value.strip()):
            raise ConfigError(f"{source}: field '{name}' must be a file path, got {value!r}")
    raw_profile = data.get("profile") if isinstance(data.get("profile"), dict) else {}
    clash = sorted(k for k in ("model", "gpu", "tensor_parallel", "dtype", "engine") if k in raw_profile)
    if cfg.profile.path is not None and clash:
        raise ConfigError(f"{source}: field 'profile' gives both a path and {', '.join(clash)}; a profile "
                          f"file fixes the model and the hardware: keep one of them")
    if cfg.slo is not None:
        for name in ("ttft_ms", "tpot_ms", "e2el_ms"):
            _positive(source, f"slo.{name}", getattr(cfg.slo, name))
    return cfg


def _check_name(name: str, source: str) -> None:
    """A run's name becomes its folder (runs/<name>), so it must be one plain folder name."""
    bad = (not name.strip() or name in (".", "..") or any(c in name for c in "/\\\0") or len(name) > 200
           or any(ord(c) < 32 for c in name))
    if bad:
        raise ConfigError(f"{source}: field 'name' must be a plain folder name (no '/', '\\', control characters, "
                          f"'.' or '..', at most 200 characters), got {name!r}; it names the run's folder "
                          f"runs/<name> (choose the folder itself with --out)")


# ---- files and overrides ------------------------------------------------------
def load_yaml_mapping(path: str | Path) -> dict[str, Any]:
    """Read a YAML file that must hold a mapping, with one-line errors."""
    if isinstance(path, str) and not path.strip():
        raise ConfigError(f"expected a YAML file path, got {path!r}")
    path = Path(path)
    if path.exists() and not path.is_dir() and not path.is_file():
        raise ConfigError(f"{path}: is not a regular file (a device or a pipe); give a YAML file")
    if path.is_dir():
        raise ConfigError(f"{path}: is a folder; give a YAML file (e.g. {path / 'azure_conv.yaml'})")
    if not path.is_file():
        raise ConfigError(f"{path}: file not found")
    try:
        data = load_yaml(path.read_text())
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise ConfigError(f"{path}: invalid YAML{at}: {problem}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{path}: not a text file (expected UTF-8 YAML)") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping of fields, got {type(data).__name__}")
    return data


def parse_override(text: str) -> tuple[str, Any]:
    """``key.sub=value`` -> ("key.sub", YAML-parsed value)."""
    if "=" not in text:
        raise ConfigError(f"--set {text!r}: expected key=value, e.g. policy.max_num_seqs=128")
    key, raw = text.split("=", 1)
    try:
        value = load_yaml(raw) if raw.strip() else None
    except yaml.YAMLError:
        value = raw
    return key.strip(), value


def set_dotted(data: Mapping[str, Any], key: str, value: Any) -> dict[str, Any]:
    """A copy of ``data`` with the dotted ``key`` set to ``value``."""
    out = dict(data)
    parts = key.split(".")
    node = out
    for part in parts[:-1]:
        child = node.get(part)
        if isinstance(child, str) and part == "policy":
            child = {"kind": child}
        child = dict(child) if isinstance(child, dict) else {}
        node[part] = child
        node = child
    node[parts[-1]] = value
    return out


def load_workload(path: str | Path, overrides: Mapping[str, Any] | None = None) -> WorkloadConfig:
    """Load and validate a workload file, applying dotted-key overrides first."""
    data = load_yaml_mapping(path)
    for key, value in (overrides or {}).items():
        if isinstance(value, str):
            _, value = parse_override(f"{key}={value}")
        data = set_dotted(data, key, value)
    try:
        return workload_from_dict(data, str(path), Path(path).resolve().parent)
    except ConfigError as exc:          # a field an override set: say so, the file does not hold it
        named = [k for k in overrides or {} if k != "seed" and (f"'{k}'" in str(exc) or f"'{k}." in str(exc))]
        if not named:
            raise
        given = ", ".join(f"{k}={overrides[k]}" for k in named)
        raise ConfigError(f"{exc} (the value comes from --set {given})") from None

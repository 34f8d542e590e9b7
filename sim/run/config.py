"""Validated configuration: frozen dataclasses built once, at the edge, from YAML.

Every error is a ``ConfigError`` whose message names the file, the field, what
was expected and how to fix it; unknown keys are rejected with the list of
allowed ones. Sweeps and ``--set`` overrides edit the *raw* mapping
(``set_dotted``) and validate again, so a variant is checked like a file.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

import yaml

from policies import POLICIES
from policies.config import check_server_fields, kinds_where, policy_config
from workloads.spec import (MAX_TOKEN_COUNT, ArrivalsConfig, LengthsConfig, SessionsConfig, check_arrivals,
                            check_lengths, check_sessions)
from sim.base.strict import MAX_COUNT, MAX_SPAN_S, ConfigError, _positive, build, did_you_mean, load_yaml

__all__ = ["ConfigError", "WorkloadConfig", "load_workload", "load_yaml_mapping", "parse_override",
           "set_dotted", "workload_from_dict"]


@dataclass(frozen=True, slots=True)
class ServerConfig:
    block_size: int = 16                 # vLLM default
    gpu_memory_utilization: float = 0.9  # vLLM default
    watermark: float = 0.01              # vLLM default
    max_model_len: int | None = None     # default: the profile's measured server, else the model's context
    num_blocks: int | None = None        # default: the profile's measured server, else its memory facts


@dataclass(frozen=True, slots=True)
class ProfileConfig:
    # A preset name (sim.cost.presets.MODEL_PRESETS), an HF config.json's fields, the path of a
    # config.json file (relative to the workload file; any name ending in .json), or a Hugging Face
    # id among the configs the aiconfigurator-core wheel bundles (the kernels extra: Qwen/Qwen3-32B).
    model: str | dict[str, Any] = "llama-3.1-8b"
    gpu: str = "h100-sxm"
    tensor_parallel: int = 1
    dtype: str = "bf16"                  # activations; with nothing else said, weights and KV too
    # Weight format (sim.cost.precision.WEIGHT_DTYPES: fp8, nvfp4 or fp4, mxfp4, ...); default: the
    # config's quantization_config, else dtype.
    weight_dtype: str | None = None
    kv_cache_dtype: str | None = None    # vLLM's --kv-cache-dtype: auto (dtype), fp8, fp8_e4m3, fp8_e5m2
    enable_expert_parallel: bool = False  # vLLM's --enable-expert-parallel (EP degree = tensor_parallel x
    #                                       data_parallel_size)
    # vLLM's --data-parallel-size: that many ranks of tensor_parallel GPUs behind one API server,
    # each with its own scheduler and KV pool (sim.loop.dp); an MoE model's ranks step together.
    data_parallel_size: int = 1
    # Data-parallel MoE ranks: the tokens the busiest expert-parallel rank's experts get over the mean
    # (1.0: uniform routing; measured routing is often 1.2-2x); its experts are priced at that many.
    expert_imbalance: float = 1.0
    # Data-parallel MoE ranks' dispatch and combine: allgather_reducescatter (vLLM's default
    # --all2all-backend; SGLang's default, no --moe-a2a-backend, gathers and scatters alike), or
    # DeepEP's all-to-all, priced from the kernel tables (profile.kernels): deepep_high_throughput
    # or deepep_low_latency for every step (vLLM's --all2all-backend, SGLang's --deepep-mode normal /
    # low_latency; sim.cost.aic.DEEPEP_MODES says why SGLang's auto mode is not offered).
    moe_a2a_backend: str = "allgather_reducescatter"
    # The serving engine generation whose host work the analytic preset charges
    # (sim.cost.collectives.ENGINES: vllm-v0 fitted on public runs; vllm-v1, vllm-v1-async). With
    # kernels on vLLM's tables, vllm-v1-async picks vLLM's async host terms, anything else its
    # synchronous loop's (sim.cost.kernels.host_terms). A synchronous loop's terms are host work
    # that async scheduling's pipelined loop overlaps with the forward pass (Profile.host_s);
    # async terms are what the overlap left unhidden, charged on the device's path.
    engine: str = "vllm-v0"
    path: str | None = None              # a profile file; overrides model/gpu
    # Step costs from measured CUDA kernel tables (sim.cost.kernels): "aiconfigurator" (the
    # aiconfigurator-core wheel, the kernels extra); None: the analytic roofline. The tables are
    # the policy's engine's (vLLM's, SGLang's or TensorRT-LLM's), at engine_version's nearest
    # measured version (None: the newest).
    kernels: str | None = None
    engine_version: str | None = None


# The thresholds goodput counts per request (vLLM's --goodput); a workload's slo takes only these.
GOODPUT_KEYS = ("ttft_ms", "tpot_ms", "e2el_ms")
# profile.moe_a2a_backend (sim.cost.aic.DEEPEP_MODES beside the default)
MOE_A2A_BACKENDS = ("allgather_reducescatter", "deepep_high_throughput", "deepep_low_latency")


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
    sessions: SessionsConfig | None = None   # with arrivals.kind sessions
    max_tokens: int | str = "output"     # output | context | an integer cap
    policy: Any = None                   # one of the policies' config dataclasses
    server: ServerConfig = field(default_factory=ServerConfig)
    profile: ProfileConfig = field(default_factory=ProfileConfig)
    slo: Slo | None = None
    # Step every iteration the loop's fast path would skip and check it against the fast path's plan
    # (sim.loop.stretch; ``sim run --check``): for a policy of your own, or knobs the tests do not cover.
    check_fast_path: bool = False
    # Disaggregated prefill and decode (sim.run.pd_config.Disaggregation; None: aggregated).
    disaggregation: Any = None
    source: str = "<workload>"
    base_dir: str = "."
    raw: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(dataclasses.replace(self, disaggregation=None))
        d.pop("raw")
        if self.sessions is None:                # a run without sessions records its config as before
            d.pop("sessions")
        if not self.check_fast_path:             # so does a run without the check
            d.pop("check_fast_path")
        if self.disaggregation is None:          # and an aggregated run
            d.pop("disaggregation")
        else:
            d["disaggregation"] = self.disaggregation.to_dict()
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
        root = Path(__file__).resolve().parents[2]
        # A bare name or traces/NAME may name a bundled trace; any other folder is the user's own.
        bundled = (root / "workloads" / "traces" / p.name,) if p.parent in (Path("."), Path("traces")) else ()
        for candidate in (local, *bundled, root / p):
            if candidate.exists():
                return candidate
        return local


SECTIONS: dict[str, type] = {
    "arrivals": ArrivalsConfig, "lengths": LengthsConfig, "server": ServerConfig,
    "profile": ProfileConfig, "slo": Slo, "sessions": SessionsConfig,
}
OPTIONAL_SECTIONS = ("slo", "sessions")     # None unless the file has them


# ---- the workload ------------------------------------------------------------
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


def _check_sessions_run(cfg: WorkloadConfig, src: str) -> None:
    """What sessions need of the rest of the workload: answers as long as drawn, and a policy
    that serves a turn without waiting for more."""
    if isinstance(cfg.max_tokens, int) and not isinstance(cfg.max_tokens, bool):
        raise ConfigError(f"{src}: field 'max_tokens' ({cfg.max_tokens}) would cut answers short of the lengths "
                          f"drawn, while each next turn's prompt holds the whole answer; cap the answers with "
                          f"lengths.output_max (or leave max_tokens at output)")
    if cfg.lengths.kind == "prefix_repetition":
        raise ConfigError(f"{src}: field 'lengths.kind': prefix_repetition builds whole prompts around shared "
                          f"prefixes, not a session's turns (each turn's prompt is its history + new user "
                          f"tokens); use sessions.system_prompt_tokens for a prefix all sessions share")
    knob = POLICIES[cfg.policy.kind][1].full_batch_knob
    if knob is not None and getattr(cfg.policy, knob) > 1:
        raise ConfigError(f"{src}: field 'policy.kind': policy {cfg.policy.kind} waits for a full batch "
                          f"(policy.{knob} = {getattr(cfg.policy, knob)} requests), and a session sends its next "
                          f"turn only after its reply, so the last sessions would wait forever; use a policy "
                          f"that does not wait for a full batch (policy.kind "
                          f"{kinds_where(lambda c: c.full_batch_knob is None)})")


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
    top = {k: v for k, v in data.items() if k not in SECTIONS and k not in ("policy", "disaggregation")}
    if "name" in top and not isinstance(top["name"], str):
        raise ConfigError(f"{source}: field 'name' must be a string (or left out: the file's name), "
                          f"got {top['name']!r}")
    if "name" in top:
        _check_name(top["name"], source)
    top.setdefault("name", Path(source).stem)
    sections = {k: build(cls, data.get(k), k, source) for k, cls in SECTIONS.items() if k not in OPTIONAL_SECTIONS}
    slo = _workload_slo(data["slo"], source) if data.get("slo") is not None else None
    sessions = build(SessionsConfig, data["sessions"], "sessions", source) if data.get("sessions") is not None else None
    cfg = build(WorkloadConfig, top, "", source, **sections, slo=slo, sessions=sessions,
                policy=policy_config(data.get("policy"), source))
    cfg = dataclasses.replace(cfg, source=str(source), base_dir=str(base_dir), raw=data)
    cfg = _fold_num_requests(cfg, source)
    check_arrivals(cfg.arrivals, source)
    check_lengths(cfg.lengths, source)
    check_sessions(cfg, source)
    if cfg.arrivals.kind == "sessions":
        _check_sessions_run(cfg, source)
    if cfg.lengths.kind == "trace" and cfg.arrivals.kind == "concurrency":
        raise ConfigError(f"{source}: field 'lengths.kind' is trace but arrivals.kind concurrency has no trace "
                          f"file; take a file's lengths in order with lengths: {{kind: empirical, path: FILE, "
                          f"sample: sequential}}, or replay its timestamps under a cap with arrivals: "
                          f"{{kind: trace, path: FILE, max_concurrency: N}}")
    if cfg.lengths.kind == "trace" and cfg.arrivals.kind != "trace":
        raise ConfigError(f"{source}: field 'lengths.kind' is trace but arrivals.kind is "
                          f"{cfg.arrivals.kind}; use lengths.kind empirical with a length file")
    if (cfg.lengths.kind == "prefix_repetition" and cfg.num_requests is not None
            and cfg.num_requests < cfg.lengths.num_prefixes):
        raise ConfigError(f"{source}: field 'lengths.num_prefixes' ({cfg.lengths.num_prefixes:,}) is more than "
                          f"num_requests ({cfg.num_requests:,}); every prefix needs a request (vllm bench serve "
                          f"refuses it too): lower num_prefixes or raise num_requests")
    _check_closed_loop(cfg, source)
    if cfg.arrivals.kind not in ("trace", "sessions") and cfg.num_requests is None and cfg.duration_s is None:
        raise ConfigError(f"{source}: set 'num_requests' or 'duration_s' for synthetic arrivals")
    _positive(source, "seed", cfg.seed, allow_zero=True)
    _positive(source, "num_requests", cfg.num_requests)
    _positive(source, "duration_s", cfg.duration_s)
    if cfg.duration_s is not None and cfg.duration_s > MAX_SPAN_S:
        raise ConfigError(f"{source}: field 'duration_s' must be at most {MAX_SPAN_S:g} s (31 years), "
                          f"got {cfg.duration_s:g}")
    if isinstance(cfg.max_tokens, str) and cfg.max_tokens not in ("output", "context"):
        raise ConfigError(f"{source}: field 'max_tokens' must be output, context or an integer, "
                          f"got {cfg.max_tokens!r}")
    if isinstance(cfg.max_tokens, int):
        _positive(source, "max_tokens", cfg.max_tokens)
        if cfg.max_tokens > MAX_TOKEN_COUNT:
            raise ConfigError(f"{source}: field 'max_tokens' must be at most {MAX_TOKEN_COUNT:,} (a token count), "
                              f"got {cfg.max_tokens:,}")
    check_server_fields(cfg.policy.kind, data.get("server"), source)
    s = cfg.server
    for name in ("block_size", "max_model_len", "num_blocks"):
        _positive(source, f"server.{name}", getattr(s, name))
        if getattr(s, name) is not None and getattr(s, name) > MAX_COUNT:
            raise ConfigError(f"{source}: field 'server.{name}' must be at most {MAX_COUNT:,} (a count), "
                              f"got {getattr(s, name):,}")
    if not 0 < s.gpu_memory_utilization <= 1:
        raise ConfigError(f"{source}: field 'server.gpu_memory_utilization' must be in (0, 1], "
                          f"got {s.gpu_memory_utilization}")
    if not 0 <= s.watermark < 1:
        raise ConfigError(f"{source}: field 'server.watermark' must be in [0, 1), got {s.watermark}")
    _positive(source, "profile.tensor_parallel", cfg.profile.tensor_parallel)
    _positive(source, "profile.data_parallel_size", cfg.profile.data_parallel_size)
    f = cfg.profile.expert_imbalance
    if isinstance(f, bool) or not isinstance(f, (int, float)) or not 1.0 <= f <= 16.0:
        raise ConfigError(f"{source}: field 'profile.expert_imbalance' must be a number from 1 (uniform routing) "
                          f"to 16, got {f!r}")
    if f != 1.0 and not (cfg.profile.data_parallel_size > 1 and cfg.profile.enable_expert_parallel):
        raise ConfigError(f"{source}: field 'profile.expert_imbalance' applies to data-parallel ranks with expert "
                          f"parallelism (profile.data_parallel_size > 1, enable_expert_parallel: true)")
    a2a = cfg.profile.moe_a2a_backend
    if a2a not in MOE_A2A_BACKENDS:
        raise ConfigError(f"{source}: field 'profile.moe_a2a_backend' must be one of {', '.join(MOE_A2A_BACKENDS)}, "
                          f"got {a2a!r}{did_you_mean(str(a2a), MOE_A2A_BACKENDS)}")
    if a2a != "allgather_reducescatter":
        if not (cfg.profile.data_parallel_size > 1 and cfg.profile.enable_expert_parallel):
            raise ConfigError(f"{source}: field 'profile.moe_a2a_backend' is {a2a}: DeepEP dispatches to expert-parallel "
                              f"ranks of data-parallel attention (profile.data_parallel_size > 1, "
                              f"enable_expert_parallel: true)")
        if cfg.profile.kernels is None:
            raise ConfigError(f"{source}: field 'profile.moe_a2a_backend' is {a2a}: DeepEP's kernels are priced from "
                              f"the measured tables only (set profile.kernels: aiconfigurator); the roofline prices "
                              f"allgather_reducescatter")
    if cfg.profile.data_parallel_size > 1024:
        raise ConfigError(f"{source}: field 'profile.data_parallel_size' must be at most 1024, "
                          f"got {cfg.profile.data_parallel_size:,}")
    for name, value in (("arrivals.path", cfg.arrivals.path), ("lengths.path", cfg.lengths.path),
                         ("profile.path", cfg.profile.path)):
        if value is not None and (not isinstance(value, str) or not value.strip()):
            raise ConfigError(f"{source}: field '{name}' must be a file path, got {value!r}")
    raw_profile = data.get("profile") if isinstance(data.get("profile"), dict) else {}
    clash = sorted(k for k in ("model", "gpu", "tensor_parallel", "dtype", "engine", "weight_dtype",
                               "kv_cache_dtype", "enable_expert_parallel", "kernels", "engine_version",
                               "data_parallel_size", "expert_imbalance", "moe_a2a_backend")
                   if k in raw_profile)
    if cfg.profile.path is not None and clash:
        raise ConfigError(f"{source}: field 'profile' gives both a path and {', '.join(clash)}; a profile "
                          f"file fixes the model and the hardware: keep one of them")
    cfg = dataclasses.replace(cfg, profile=_check_precision(cfg.profile, source))
    _check_kernels(cfg.profile, source, raw_profile)
    if data.get("disaggregation") is not None:
        from sim.run.pd_config import parse_disaggregation

        pd = parse_disaggregation(data, source, str(base_dir), workload_from_dict)
        cfg = dataclasses.replace(cfg, disaggregation=pd)
    if cfg.slo is not None:
        for name in ("ttft_ms", "tpot_ms", "e2el_ms"):
            _positive(source, f"slo.{name}", getattr(cfg.slo, name))
            if getattr(cfg.slo, name) is not None and getattr(cfg.slo, name) > MAX_SPAN_S * 1e3:
                raise ConfigError(f"{source}: field 'slo.{name}' must be at most {MAX_SPAN_S * 1e3:g} ms (31 years), "
                                  f"got {getattr(cfg.slo, name):g}")
    return cfg


KERNEL_SOURCES = ("aiconfigurator",)


def _check_kernels(p: ProfileConfig, source: str, raw: dict[str, Any]) -> None:
    """profile.kernels names a kernel-table source; engine_version needs one and is a version."""
    if p.kernels is not None and (not isinstance(p.kernels, str) or p.kernels.lower() not in KERNEL_SOURCES):
        raise ConfigError(f"{source}: field 'profile.kernels' is {p.kernels!r}; expected one of "
                          f"{', '.join(KERNEL_SOURCES)} (or leave it out for the analytic roofline)")
    if p.engine_version is not None:
        if p.kernels is None:
            raise ConfigError(f"{source}: field 'profile.engine_version' picks a version of measured kernel "
                              f"tables; set profile.kernels: aiconfigurator with it (or leave it out)")
        if isinstance(p.engine_version, bool) or not isinstance(p.engine_version, (str, int, float)):
            raise ConfigError(f"{source}: field 'profile.engine_version' must be a version such as 0.24.0, "
                              f"got {p.engine_version!r}")


def _check_precision(p: ProfileConfig, source: str) -> ProfileConfig:
    """profile.dtype, weight_dtype and kv_cache_dtype name formats sim.cost.precision knows, in
    any case; returned in lower case, the one spelling everything downstream compares (MXFP4
    against a checkpoint's stated mxfp4 once quantized every linear layer, not only the experts)."""
    from sim.cost.precision import ACTIVATION_DTYPES, KV_CACHE_DTYPES, WEIGHT_DTYPES
    for name, value, allowed in (("dtype", p.dtype, tuple(ACTIVATION_DTYPES)),
                                 ("weight_dtype", p.weight_dtype, WEIGHT_DTYPES),
                                 ("kv_cache_dtype", p.kv_cache_dtype, KV_CACHE_DTYPES)):
        if value is not None and str(value).lower() not in allowed:
            raise ConfigError(f"{source}: field 'profile.{name}' is {value!r}; expected one of {', '.join(allowed)}")
    p = dataclasses.replace(p, **{name: getattr(p, name).lower() for name in ("dtype", "weight_dtype", "kv_cache_dtype")
                                  if getattr(p, name) is not None})
    if p.weight_dtype is not None and p.weight_dtype in ACTIVATION_DTYPES and p.weight_dtype != p.dtype:
        raise ConfigError(f"{source}: field 'profile.weight_dtype' is {p.weight_dtype!r} but profile.dtype is "
                          f"{p.dtype!r}; unquantized weights are stored in dtype: set dtype: {p.weight_dtype} "
                          f"(or a quantized weight_dtype: fp8, nvfp4, mxfp4)")
    return p


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


def set_dotted(data: Mapping[str, Any], key: str, value: Any, source: str = "<workload>") -> dict[str, Any]:
    """A copy of ``data`` with the dotted ``key`` set to ``value``. A part of the key that holds
    a value rather than a mapping (``profile.model.hidden_size`` with ``model: llama-3.1-8b``) is
    a ConfigError naming ``source``: replacing the value by a mapping of one field would change
    what it names (a preset became a custom shape of one field)."""
    out = dict(data)
    parts = key.split(".")
    node = out
    for depth, part in enumerate(parts[:-1]):
        child = node.get(part)
        if isinstance(child, str) and part == "policy" and depth == 0:
            child = {"kind": child}
        default = _default_at(parts[:depth + 1]) if child is None else None
        if (child is not None and not isinstance(child, dict)) or isinstance(default, str):
            prefix = ".".join(parts[:depth + 1])
            shown = f"{child!r}" if child is not None else f"{default!r} (its default)"
            raise ConfigError(f"{source}: field '{key}' cannot be set: '{prefix}' is {shown}, a value, not a "
                              f"mapping of fields; set '{prefix}' as a whole")
        child = dict(child) if isinstance(child, dict) else {}
        node[part] = child
        node = child
    node[parts[-1]] = value
    return out


def _default_at(parts: list[str]) -> Any:
    """The default of the workload field ``parts`` names (``["profile", "model"]``: the preset
    llama-3.1-8b), through the section dataclasses; None where there is none."""
    cls: Any = WorkloadConfig
    value: Any = None
    for part in parts:
        f = next((f for f in dataclasses.fields(cls) if f.name == part), None) if dataclasses.is_dataclass(cls) else None
        if f is None:
            return None
        if f.default is not dataclasses.MISSING:
            value = f.default
        elif f.default_factory is not dataclasses.MISSING:
            value = f.default_factory()
        else:
            return None
        cls = type(value)
    return value


def load_workload(path: str | Path, overrides: Mapping[str, Any] | None = None) -> WorkloadConfig:
    """Load and validate a workload file, applying dotted-key overrides first."""
    data = load_yaml_mapping(path)
    for key, value in (overrides or {}).items():
        if isinstance(value, str):
            _, value = parse_override(f"{key}={value}")
        data = set_dotted(data, key, value, f"{path} (--set {key}={value})")
    try:
        return workload_from_dict(data, str(path), Path(path).resolve().parent)
    except ConfigError as exc:          # a field an override set: say so, the file does not hold it
        named = [k for k in overrides or {} if k != "seed" and (f"'{k}'" in str(exc) or f"'{k}." in str(exc))]
        if not named:
            raise
        given = ", ".join(f"{k}={overrides[k]}" for k in named)
        raise ConfigError(f"{exc} (the value comes from --set {given})") from None

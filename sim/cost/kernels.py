"""Kernel profiles: a ``Profile`` whose step costs come from measured CUDA kernel tables
(``profile: {kernels: aiconfigurator, ...}``; the tables: ``sim.cost.aic``).

Every curve is tabulated from the wheel's answer for that op family at that shape, per TP
shard, in the precision's own kernels, on grids refined until piecewise-linear
interpolation stays within ``GRID_TOLERANCE`` of the wheel at probe points:

    linear(T)            the token-parallel ops of a step of T tokens (embedding, norms,
                         QKV/O and MLP GEMMs, MoE and its dispatch, the TP all-reduces)
    lm_head(n)           the LM head's GEMM for the n sequences a step samples
    attn_prefill(c, p)   context attention of a chunk of c tokens over p earlier ones
    prefill_shared_s     what the chunks of one step share (their attention runs as one
                         launch): the chunks beyond the first do not pay it again
    attn_decode(n, c)    generation attention of n decodes at a mean context of c tokens
                         (the tables' KV length c + 1: the new token's key included)

Memory (weights, KV bytes, activations) is batchsim's own model of the same config
(``sim.cost.roofline``), and for vLLM's tables its start-up sampler warm-up: max_num_seqs
dummy requests' logits over the whole vocabulary in fp32, sorted for top-p (values and
int64 indices: ``SAMPLER_BYTES_PER_LOGIT`` a logit), whose peak the KV pool loses when it
exceeds the forward pass's (gpt-oss-120b at 1,024 sequences: 3.1 GiB of an H100). What kernels do not measure, the engine's host time per step and
per sequence and the API server's per request, is ``HostTerms`` (fitted per engine on
public serving runs: ``benchmarks/public_serving.py``), added on top; the provenance says
which part is measured and which fitted. A synchronous loop's terms are the profile's host
part (``Profile.host_s``), which the pipelined loop of async scheduling runs beside the
forward pass before (sim.loop.server.pipelined_start_s); vLLM's async terms, fitted as an
addition on async runs, are what their overlap left unhidden and stay on the device's path
(``HostTerms.overlapped``).

Tables are built once per (wheel version, GPU, engine, version, model, TP, EP, precisions,
grid format) and kept in a user cache folder (``cache_dir``), never per run.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sim.cost import aic
from sim.cost.aic import KernelsError
from sim.cost.curves import Curve1D, Curve2D, MeasuredRange
from sim.cost.kernel_grids import GridBounds, tabulate
# re-exported: the model resolution is used through this module (calibrate.kernels, the benchmarks)
from sim.cost.kernel_models import (PRESET_ARCHITECTURES, PRESET_IDS, ResolvedModel, preset_hf_config,  # noqa: F401
                                    quant_modes, resolve_model, unmodelled_mechanism)
from sim.cost.profile import FORMAT_VERSION, Profile, load_profile

KERNEL_SOURCES = ("aiconfigurator",)
GRID_FORMAT = 4                    # bump when the grids or the composition change: rebuilds caches
SAMPLER_BYTES_PER_LOGIT = 4 + 4 + 8  # vLLM's sampler warm-up: fp32 logits, their sorted copy, int64 sort indices


@dataclass(frozen=True, slots=True)
class HostTerms:
    """The engine's host (CPU) time that kernel tables do not hold, in seconds: per step,
    extra per step when TP > 1, per sequence scheduled, per request (the API server's
    tokenizing, detokenizing and streaming: delays the request's first token)."""

    engine: str
    step_s: float
    tp_step_s: float
    per_seq_s: float
    request_s: float
    source: str
    # True: fitted as an additive term on runs of an async loop, so step_s, tp_step_s and
    # per_seq_s are what its overlap left unhidden between two forward passes: charged on the
    # device's path, never hidden again. False: a synchronous loop's host work, which a
    # pipelined loop runs beside the forward pass before (Profile.host_s).
    overlapped: bool = False


# The host terms per engine: benchmarks/bench_kernels_public.py --fit (kernel_serving.fit_host:
# least squares on log(sim / real) of the TTFT and TPOT of the training models' public serving
# runs, soft L1, within the plausible bounds kernel_serving.FIT_HI). Two public SGLang and TensorRT-
# LLM training runs are too few to fit four numbers: those engines take vLLM's, said in their source.
_VLLM = dict(step_s=0.8689e-3, tp_step_s=0.0, per_seq_s=71.45e-6, request_s=13.78e-3)
_VLLM_SOURCE = "fitted on 27 public vLLM serving runs of the training models (vLLM 0.10-0.25, synchronous loop)"
HOST_TERMS: dict[str, HostTerms] = {
    "vllm": HostTerms("vllm", **_VLLM, source=_VLLM_SOURCE),
    # Fitted additively (step = kernels + these) on async runs: the time their overlap left on
    # the critical path, so under the pipelined loop's max rule they stay on the device's path
    # (overlapped); hiding them again would count the overlap twice. Not refitted under the rule.
    "vllm-async": HostTerms("vllm-async", step_s=0.0, tp_step_s=0.4975e-3, per_seq_s=62.60e-6, request_s=0.0,
                            source="fitted on 8 public vLLM serving runs of the training models with "
                                   "--async-scheduling", overlapped=True),
    "sglang": HostTerms("sglang", **_VLLM, source=f"vLLM's ({_VLLM_SOURCE}): 3 public SGLang runs of the "
                                                  f"training models are too few to fit SGLang's own"),
    "trtllm": HostTerms("trtllm", **_VLLM, source=f"vLLM's ({_VLLM_SOURCE}): 4 public TensorRT-LLM runs of "
                                                  f"the training models are too few to fit its own"),
}


def host_terms(engine: str, vllm_generation: str = "vllm-v1") -> HostTerms:
    """The host terms for ``engine``'s tables; for vLLM's, ``vllm_generation`` (the analytic
    profile's ``engine`` knob) picks async scheduling's (vllm-v1-async) or the synchronous
    loop's (vllm-v1, and vllm-v0, whose 0.5-era host terms do not apply to these kernels)."""
    if engine == "vllm":
        return HOST_TERMS["vllm-async" if vllm_generation == "vllm-v1-async" else "vllm"]
    return HOST_TERMS[engine]


def cache_dir() -> Path:
    """``BATCHSIM_CACHE_DIR``, else ``$XDG_CACHE_HOME/batchsim``, else ``~/.cache/batchsim``."""
    if os.environ.get("BATCHSIM_CACHE_DIR"):
        return Path(os.environ["BATCHSIM_CACHE_DIR"]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base).expanduser() / "batchsim"


# ---- the profile ----------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class KernelSpec:
    """What identifies a kernel profile (the workload's ``profile`` section, resolved)."""

    model: str | dict[str, Any]
    gpu: str
    engine: str                          # the wheel's engine: vllm | sglang | trtllm
    tensor_parallel: int = 1
    dtype: str = "bf16"
    weight_dtype: str | None = None
    kv_cache_dtype: str | None = None
    expert_parallel: bool = False
    engine_version: str | None = None    # None: the newest measured
    data_parallel: int = 1               # attention data parallelism (one rank's profile)
    moe_a2a: str | None = None           # DeepEP's all-to-all (aic.DEEPEP_MODES); None: the engine's default


def kernel_profile(spec: KernelSpec, host: HostTerms, folder: Path | None = None) -> Profile:
    """The kernel profile of ``spec`` with ``host``'s terms on top: read from the cache
    folder if these tables were built before, else built (seconds) and cached."""
    from sim.cost.presets import GPU_PRESETS
    folder = cache_dir() if folder is None else folder
    system = aic.system_of(spec.gpu)
    if spec.engine not in aic.ENGINES:
        raise KernelsError(f"engine {spec.engine!r} has no kernel tables; tables exist for {', '.join(aic.ENGINES)}")
    gpu = GPU_PRESETS[spec.gpu.lower()]
    model = resolve_model(spec.model, folder)
    # Keyed by the version asked (the wheel's version fixes what it resolves to), so that a
    # cached profile is read without importing the wheel.
    key = {"grid_format": GRID_FORMAT, "wheel": aic.wheel_version(), "system": system, "engine": spec.engine,
           "version_asked": spec.engine_version, "model": model.config, "tp": spec.tensor_parallel,
           "ep": spec.expert_parallel, "dtype": spec.dtype, "weight_dtype": spec.weight_dtype,
           "kv_cache_dtype": spec.kv_cache_dtype, "gpu": dataclasses.asdict(gpu),
           **({"dp": spec.data_parallel} if spec.data_parallel > 1 else {}),
           **({"moe_a2a": spec.moe_a2a} if spec.moe_a2a else {})}
    digest = hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:20]
    path = folder / "kernels" / f"{digest}.json"
    if path.is_file():
        tables = load_profile(path)
    else:
        aic.require_wheel()
        version = aic.resolve_version(system, spec.engine, spec.engine_version)
        tables = build_tables(spec, model, gpu, system, version)
        tables.provenance["cache_key"] = digest
        tables.save(path)               # atomic: a concurrent build writes the same bytes
    if spec.engine_version is not None:
        tables.provenance["engine_version_asked"] = str(spec.engine_version)
    return with_host(tables, host)


def build_tables(spec: KernelSpec, model: ResolvedModel, gpu: Any, system: str, version: str) -> Profile:
    """The kernel curves of ``spec`` and batchsim's memory facts, no host time (``with_host``)."""
    from sim.cost.hf_config import model_shape_from_hf
    from sim.cost.precision import Precision, precision_from_hf
    from sim.cost.roofline import Roofline
    try:
        shape = model_shape_from_hf(model.config, model.name)
        stated, scope = precision_from_hf(model.config, model.name)
    except ValueError as exc:
        raise KernelsError(str(exc)) from None
    weights = spec.weight_dtype or stated
    if stated is None or weights != stated:
        scope = "linear"
    precision = Precision(dtype=spec.dtype, weight_dtype=weights, kv_cache_dtype=spec.kv_cache_dtype or "auto",
                          quantized=scope)
    rf = Roofline(shape, gpu, spec.tensor_parallel, spec.dtype, precision=precision,
                  expert_parallel=spec.expert_parallel, data_parallel=spec.data_parallel)
    modes = quant_modes(precision.weight_dtype, stated, scope, precision.kv_cache_dtype, gpu.generation,
                        mla=shape.is_mla)
    tables = aic.KernelTables(model.wheel_path, system, spec.engine, version, spec.tensor_parallel,
                              expert_parallel=spec.expert_parallel, data_parallel=spec.data_parallel,
                              moe_a2a=spec.moe_a2a, **modes)
    t = spec.tensor_parallel
    bounds = GridBounds(max_tokens=max(131072, shape.max_position_embeddings), max_seqs=4096,
                        max_context=shape.max_position_embeddings)
    try:
        tab = tabulate(tables, bounds)
    except (RuntimeError, ValueError) as exc:        # the wheel's PerfDataNotAvailableError and kin
        raise KernelsError(f"the {aic.ENGINES[spec.engine]} {version} tables on {system} lack a shape this "
                           f"model needs: {str(exc).split(' at /')[0]}") from None
    grids, values, limits = tab["grids"], tab["values"], tab["limits"]
    prefill_len, decode_len = limits.get("prefill_len"), limits.get("decode_len")
    label = (precision.label() + ("-ep" if spec.expert_parallel else "")
             + (f"-dp{spec.data_parallel}" if spec.data_parallel > 1 else "")
             + (f"-{spec.moe_a2a}" if spec.moe_a2a else ""))
    engine_name = aic.ENGINES[spec.engine]
    extra = {**({"weight_dtype": precision.weights} if precision.is_quantized else {}),
             **({"kv_cache_dtype": precision.kv_cache_dtype} if precision.kv_cache_dtype != "auto" else {})}
    return Profile(
        name=f"{model.name}@{gpu.name}-tp{t}-{label}-{spec.engine}-{version}", model=shape, device=gpu.name,
        dtype=precision.dtype, tensor_parallel=t, data_parallel_size=spec.data_parallel,
        memory_bytes_per_gpu=gpu.memory_bytes,
        weight_bytes=rf.weight_bytes, activation_bytes_per_gpu=rf.activation_bytes_per_gpu(0),
        activation_bytes_per_token_per_gpu=rf.activation_bytes_per_gpu(1) - rf.activation_bytes_per_gpu(0),
        kv_bytes_per_token=rf.kv_bytes_per_token, kv_bytes_per_seq=rf.kv_bytes_per_seq, overhead_s=0.0,
        linear=Curve1D(grids["linear"], values["linear"], name="curves.linear", measured_max=limits.get("tokens")),
        lm_head=Curve1D(grids["lm_head"], values["lm_head"], name="curves.lm_head",
                        measured_max=limits.get("tokens")),
        moe=(Curve1D(grids["moe"], values["moe"], name="curves.moe", measured_max=limits.get("tokens"))
             if "moe" in grids else None),
        attn_prefill=Curve2D(*grids["attn_prefill"], values["attn_prefill"], name="curves.attn_prefill",
                             measured=MeasuredRange(prefill_len, prefill_len, -1.0) if prefill_len else None),
        attn_decode=Curve2D(*grids["attn_decode"], values["attn_decode"], name="curves.attn_decode",
                            measured=(MeasuredRange(limits["decode_seqs"], decode_len - 1)
                                      if decode_len else None)),
        prefill_shared_s=tab["prefill_shared_s"], decode_per_seq=True,
        sampler_bytes_per_seq=SAMPLER_BYTES_PER_LOGIT * shape.vocab_size if spec.engine == "vllm" else 0,
        provenance={"source": "kernel-tables", "kernels": "aiconfigurator",
                    "label": f"{engine_name} {version} kernel tables on {system}, {aic.WHEEL} {aic.wheel_version()}",
                    "wheel": f"{aic.WHEEL} {aic.wheel_version()}", "system": system, "engine": spec.engine,
                    "engine_version": version, "gpu": gpu.name, "model": model.name, "tensor_parallel": t,
                    "expert_parallel": spec.expert_parallel, "dtype": precision.dtype, **extra,
                    **({"data_parallel_size": spec.data_parallel} if spec.data_parallel > 1 else {}),
                    **({"moe_a2a_backend": spec.moe_a2a} if spec.moe_a2a else {}),
                    "quant_modes": tables.quant_modes, "tables": tables.tables(), "measured_ranges": limits,
                    "batchsim_format": FORMAT_VERSION, "grid_format": GRID_FORMAT,
                    "measured": "the GPU kernels of every op (the tables above)",
                    "not_measured": "memory (batchsim's own model of the config) and the engine's host time "
                                    "(provenance.host)", **({"model_note": model.note} if model.note else {})},
        fit_error={"method": "grid interpolation of the wheel's per-op estimates",
                   "max_rel_error_at_probes": tab["max_rel_error_at_probes"], "monotone_repairs": tab["repairs"]},
        efficiency={}, **extra,
    )


def with_host(tables: Profile, host: HostTerms) -> Profile:
    """``tables`` (kernel time only) with the engine's host terms on top: per step in
    ``overhead_s``, per sequence in each prefill chunk's and each decode's attention (as the
    analytic roofline charges it), per request as the server's request overhead. A synchronous
    loop's terms are the profile's host part (``Profile.host_s``); ``overlapped`` ones are not."""
    t = tables.tensor_parallel
    per_seq = host.per_seq_s
    pre, dec = tables.attn_prefill, tables.attn_decode
    prov = {**tables.provenance, "host": dataclasses.asdict(host)}
    return dataclasses.replace(
        tables, overhead_s=host.step_s + (host.tp_step_s if t > 1 else 0.0),
        attn_prefill=Curve2D(pre.xs, pre.ys, [[z + per_seq for z in row] for row in pre.zs], name=pre.name,
                             measured=pre.measured),
        attn_decode=Curve2D(dec.xs, dec.ys, [[z + n * per_seq for z in row] for n, row in zip(dec.xs, dec.zs)],
                            name=dec.name, measured=dec.measured),
        linear=dataclasses.replace(tables.linear), lm_head=dataclasses.replace(tables.lm_head),
        engine={**tables.engine, "request_overhead_s": host.request_s}, provenance=prov,
        host_step_s=0.0 if host.overlapped else host.step_s + (host.tp_step_s if t > 1 else 0.0),
        host_per_seq_s=0.0 if host.overlapped else per_seq)

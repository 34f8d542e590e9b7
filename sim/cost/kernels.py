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
which part is measured and which fitted.

Tables are built once per (wheel version, GPU, engine, version, model, TP, EP, precisions,
grid format) and kept in a user cache folder (``cache_dir``), never per run.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import warnings

from sim.cost import aic
from sim.cost.curves import (Curve1D, Curve2D, CurveRepairWarning, MeasuredRange, isotonic, isotonic_grid,
                             repairs_of)
from sim.cost.aic import KernelsError
from sim.cost.hf_config import WRAPPER_KEYS as _WRAPPERS, unmodelled_mechanism   # the importer's one table
from sim.cost.profile import FORMAT_VERSION, Profile, load_profile

KERNEL_SOURCES = ("aiconfigurator",)
GRID_TOLERANCE = 0.01              # relative interpolation error allowed at the probes
MAX_AXIS_POINTS = 96               # a grid axis stops growing here (the worst error left is reported)
MIN_SPLIT_REL = 0.02               # nor is an interval split once it is narrower than 2% of its start
GRID_FORMAT = 3                    # bump when the grids or the composition change: rebuilds caches
SAMPLER_BYTES_PER_LOGIT = 4 + 4 + 8  # vLLM's sampler warm-up: fp32 logits, their sorted copy, int64 sort indices
_PROBES = (0.25, 0.5, 0.75)
DECODE_ROUNDS = 3                  # the decode table's refining rounds (its answers cost ~100 us each)
_MAX_ROUNDS = 10
MS = 1e-3


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


# The host terms per engine: benchmarks/bench_kernels_public.py --fit (kernel_serving.fit_host:
# least squares on log(sim / real) of the TTFT and TPOT of the training models' public serving
# runs, soft L1, within the plausible bounds kernel_serving.FIT_HI). Two public SGLang and TensorRT-
# LLM training runs are too few to fit four numbers: those engines take vLLM's, said in their source.
_VLLM = dict(step_s=0.8689e-3, tp_step_s=0.0, per_seq_s=71.45e-6, request_s=13.78e-3)
_VLLM_SOURCE = "fitted on 27 public vLLM serving runs of the training models (vLLM 0.10-0.25, synchronous loop)"
HOST_TERMS: dict[str, HostTerms] = {
    "vllm": HostTerms("vllm", **_VLLM, source=_VLLM_SOURCE),
    "vllm-async": HostTerms("vllm-async", step_s=0.0, tp_step_s=0.4975e-3, per_seq_s=62.60e-6, request_s=0.0,
                            source="fitted on 8 public vLLM serving runs of the training models with "
                                   "--async-scheduling"),
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


# ---- grids ---------------------------------------------------------------------------
def _ints_between(a: int, b: int) -> int | None:
    """A whole number strictly inside (a, b), near the geometric middle; None if none
    (or if the interval is already narrower than ``MIN_SPLIT_REL`` of its start)."""
    if b - a < 2 or (a > 0 and b - a < MIN_SPLIT_REL * a):
        return None
    mid = int(round(math.sqrt(a * b))) if a > 0 else (a + b) // 2
    return min(max(mid, a + 1), b - 1)


def _probes(a: int, b: int) -> list[int]:
    return sorted({int(round(a + (b - a) * u)) for u in _PROBES} - {a, b})


def _rel(approx: float, exact: float) -> float:
    return abs(approx - exact) / max(abs(exact), 1e-12)


def refine_1d(f: Callable[[int], float], xs: list[int], tol: float = GRID_TOLERANCE) -> tuple[list[int], float]:
    """Whole-number grid points, split until linear interpolation of f is within ``tol``
    (relative) at the probes of every interval; the worst error left."""
    xs = sorted(set(xs))
    worst = 0.0
    for _ in range(_MAX_ROUNDS):
        worst, new = 0.0, []
        for a, b in zip(xs, xs[1:]):
            fa, fb = f(a), f(b)
            err = max((_rel(fa + (fb - fa) * (p - a) / (b - a), f(p)) for p in _probes(a, b)), default=0.0)
            worst = max(worst, err)
            if err > tol and (m := _ints_between(a, b)) is not None:
                new.append(m)
        if not new or len(xs) >= MAX_AXIS_POINTS:
            break
        xs = sorted(set(xs) | set(new))
    return xs, worst


def refine_2d(f: Callable[[int, int], float], xs: list[int], ys: list[int], tol: float = GRID_TOLERANCE,
              max_points: int = MAX_AXIS_POINTS, max_rounds: int = _MAX_ROUNDS) -> tuple[list[int], list[int], float]:
    """``refine_1d`` for a tensor grid: a cell whose bilinear interpolation misses f by
    more than ``tol`` at a probe splits the axis along which 1-D interpolation misses more.
    A cell is checked once (its error is kept while its four corners stay grid points)."""
    xs, ys = sorted(set(xs)), sorted(set(ys))
    checked: dict[tuple[int, int, int, int], float] = {}

    def cell_error(x0: int, x1: int, y0: int, y1: int) -> tuple[float, float, float]:
        z00, z01, z10, z11 = f(x0, y0), f(x0, y1), f(x1, y0), f(x1, y1)
        err = err_x = err_y = 0.0
        for px in _probes(x0, x1) or [x0]:
            tx = (px - x0) / (x1 - x0)
            for py in _probes(y0, y1) or [y0]:
                ty = (py - y0) / (y1 - y0)
                exact = f(px, py)
                bil = (z00 * (1 - tx) + z10 * tx) * (1 - ty) + (z01 * (1 - tx) + z11 * tx) * ty
                err = max(err, _rel(bil, exact))
                err_x = max(err_x, _rel(f(x0, py) * (1 - tx) + f(x1, py) * tx, exact))
                err_y = max(err_y, _rel(f(px, y0) * (1 - ty) + f(px, y1) * ty, exact))
        return err, err_x, err_y

    worst = 0.0
    for round_ in range(max_rounds):
        worst, add_x, add_y = 0.0, set(), set()
        for x0, x1 in zip(xs, xs[1:]):
            for y0, y1 in zip(ys, ys[1:]):
                key = (x0, x1, y0, y1)
                if key not in checked:
                    err, err_x, err_y = cell_error(*key)
                    checked[key] = err
                    if err > tol:
                        if err_x >= 0.5 * err_y and (m := _ints_between(x0, x1)) is not None:
                            add_x.add(m)
                        if err_y >= 0.5 * err_x and (m := _ints_between(y0, y1)) is not None:
                            add_y.add(m)
                worst = max(worst, checked[key])
        if len(xs) >= max_points or round_ == max_rounds - 1:
            add_x = set()
        if len(ys) >= max_points or round_ == max_rounds - 1:
            add_y = set()
        if not add_x and not add_y:
            break
        xs, ys = sorted(set(xs) | add_x), sorted(set(ys) | add_y)
    return xs, ys, worst


def _feasible_prefill(f: Callable[[int, int], float], max_context: int) -> Callable[[int, int], float]:
    """f(chunk, context) where chunk + context fits the model's context; past it (no request
    gets there, but a rectangular grid has corners there) the value at the edge, scaled by
    the (query, key) pairs: monotone, and never the tables' far extrapolation."""
    def g(c: int, p: int) -> float:
        edge = max(0, max_context - c)
        if p <= edge:
            return f(c, p)
        return f(c, edge) * (p + (c + 1) / 2) / (edge + (c + 1) / 2)
    return g


def _axis(measured: list[int], lo: int, hi: int) -> list[int]:
    """A grid axis on [lo, hi]: the measured points inside, the powers of two and their
    1.5x (the tables' usual spacing), lo and hi."""
    fill = {v for k in range(64) for v in (2**k, 3 * 2**k) if lo < v < hi}
    return sorted({lo, hi} | fill | {int(m) for m in measured if lo < m < hi})


def _memo(f: Callable[..., float]) -> Callable[..., float]:
    cache: dict[tuple, float] = {}

    def g(*args: int) -> float:
        hit = cache.get(args)
        if hit is None:
            hit = cache[args] = f(*args)
        return hit
    return g


def _powers(lo: int, hi: int) -> list[int]:
    """lo, the powers of two between, hi."""
    out = [lo] + [2**k for k in range(1, 64) if lo < 2**k < hi] + [hi]
    return sorted(set(out))


# ---- the tables ------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class GridBounds:
    """How far each curve's grid reaches (the measured ranges are usually narrower)."""

    max_tokens: int          # a step's tokens (linear)
    max_seqs: int            # sequences in a step (lm_head, attn_decode)
    max_context: int         # a request's context (attn_prefill's axes, attn_decode's mean context)


def tabulate(tables: aic.KernelTables, bounds: GridBounds) -> dict[str, Any]:
    """The kernel curves (seconds, monotone) of ``tables`` on grids that hold the tables'
    measured points and are refined within ``bounds``, with where each was measured, the
    repairs monotonicity needed and the worst interpolation error left at the probes."""
    axes = tables.measured_axes()
    token_axis = _axis(axes.get("tokens", []), 1, bounds.max_tokens)
    seq_axis = _axis(axes.get("decode_seqs", []), 1, bounds.max_seqs)
    row_axis = _axis(axes.get("tokens", []), 1, bounds.max_seqs)
    length_axis = _axis(axes.get("prefill_len", []), 1, bounds.max_context)
    with aic.quiet():
        linear = _memo(lambda t: tables.linear_ms(t) * MS)
        lm_head = _memo(lambda n: tables.lm_head_ms(n) * MS)
        prefill = _memo(_feasible_prefill(lambda c, p: tables.prefill_attention_ms(c, p) * MS, bounds.max_context))
        # Decodes by their mean context c (the tables' KV length is c + 1, the new token's own
        # key included), on the tables' measured batches and lengths and refined a few rounds
        # (where the wheel's lanes interpolate on other points than the table's).
        decode = _memo(lambda n, c: tables.decode_attention_ms(n, c + 1) * MS)
        lin_x, lin_err = refine_1d(linear, token_axis)
        lm_x, lm_err = refine_1d(lm_head, row_axis)
        pre_c, pre_p, pre_err = refine_2d(prefill, length_axis, [0] + length_axis)
        mean_axis = [0] + _axis([kv - 1 for kv in axes.get("decode_len", []) if kv > 1], 1, bounds.max_context)
        dec_n, dec_p, dec_err = refine_2d(decode, seq_axis, mean_axis, max_rounds=DECODE_ROUNDS)
        # One launch over the step's chunks: b chunks of 16 tokens cost little more than one,
        # so what one chunk alone pays beyond its share is the launch (measured at b = 8).
        one, eight = tables.prefill_attention_ms(16, 0) * MS, tables.prefill_attention_ms(16, 0, batch=8) * MS
        shared_s = min(one, max(0.0, (8 * one - eight) / 7))
        # A chunk over more context is never cheaper than over none: the tables measure
        # whole prompts (context 0) and the wheel derives a chunk over context from them, so
        # where the derived value falls below the measured one it is raised to it (a running
        # maximum along the context axis, before the two-axis repair).
        values = {"linear": [linear(t) for t in lin_x], "lm_head": [lm_head(n) for n in lm_x],
                  "attn_prefill": [list(itertools.accumulate((prefill(c, p) for p in pre_p), max)) for c in pre_c],
                  "attn_decode": [[decode(n, p) for p in dec_p] for n in dec_n]}
    repaired = {}
    for name in ("linear", "lm_head"):
        fixed = isotonic(values[name])
        repaired[name] = _repair_note(repairs_of([values[name]], [fixed]), len(fixed))
        values[name] = fixed
    for name in ("attn_prefill", "attn_decode"):
        fixed = isotonic_grid(values[name])
        repaired[name] = _repair_note(repairs_of(values[name], fixed), sum(len(r) for r in fixed))
        values[name] = fixed
    limits = {axis: float(max(v)) for axis, v in axes.items() if v}
    return {"grids": {"linear": lin_x, "lm_head": lm_x, "attn_prefill": (pre_c, pre_p), "attn_decode": (dec_n, dec_p)},
            "values": values, "prefill_shared_s": shared_s, "limits": limits, "repairs": repaired,
            "max_rel_error_at_probes": {"linear": lin_err, "lm_head": lm_err, "attn_prefill": pre_err,
                                        "attn_decode": dec_err}}


def _repair_note(repairs: list, num_values: int) -> dict[str, Any]:
    """How many table values the monotone repair moved by more than 5%, and the largest move."""
    top = repairs[0] if repairs else None
    return {"moved_over_5pct": len(repairs), "of": num_values,
            "largest_pct": round(100 * (top.after - top.before) / max(abs(top.before), 1e-300), 1) if top else 0.0}


# ---- models -----------------------------------------------------------------------------
# batchsim presets whose exact config the wheel bundles (Llama 3.3 70B has Llama 3.1 70B's).
PRESET_IDS = {
    "llama-3.1-8b": "meta-llama/Meta-Llama-3.1-8B", "llama-3.1-70b": "meta-llama/Meta-Llama-3.1-70B",
    "llama-3.3-70b": "meta-llama/Meta-Llama-3.1-70B", "qwen3-8b": "Qwen/Qwen3-8B", "qwen3-32b": "Qwen/Qwen3-32B",
    "qwen3-30b-a3b": "Qwen/Qwen3-30B-A3B", "qwen3-235b-a22b": "Qwen/Qwen3-235B-A22B",
    "mixtral-8x7b": "mistralai/Mixtral-8x7B-v0.1", "gpt-oss-20b": "openai/gpt-oss-20b",
    "gpt-oss-120b": "openai/gpt-oss-120b",
}
# Presets the wheel bundles no config of: the architecture its graph builder reads them as
# (Mistral's decoder is Llama's; Qwen3 dense adds the QK norms).
PRESET_ARCHITECTURES = {
    "llama-2-7b": "LlamaForCausalLM", "llama-2-13b": "LlamaForCausalLM", "mistral-7b": "LlamaForCausalLM",
    "mistral-small-24b": "LlamaForCausalLM", "qwen3-14b": "Qwen3ForCausalLM",
}


def preset_hf_config(name: str) -> dict[str, Any]:
    """The HF config.json fields of a dense preset (``MODEL_PRESETS``) the wheel bundles no config
    of, as its graph builder reads them; ``model_shape_from_hf`` gives the preset back."""
    from sim.cost.presets import MODEL_PRESETS
    m = MODEL_PRESETS[name]
    return {"name": name, "architectures": [PRESET_ARCHITECTURES[name]], "hidden_size": m.hidden_size,
            "num_hidden_layers": m.num_layers, "num_attention_heads": m.num_heads,
            "num_key_value_heads": m.num_kv_heads, "intermediate_size": m.intermediate_size,
            "vocab_size": m.vocab_size, "max_position_embeddings": m.max_position_embeddings,
            "head_dim": m.head_dim, "hidden_act": "silu", "tie_word_embeddings": m.tie_word_embeddings,
            "rope_theta": m.rope_theta}


def language_model_config(cfg: dict[str, Any]) -> tuple[dict[str, Any], str | None]:
    """The decoder's config: ``cfg``, or the language model a multimodal config wraps (its
    ``text_config``), with a note that the vision tower is left out."""
    for key in _WRAPPERS:
        inner = cfg.get(key)
        if isinstance(inner, dict) and "hidden_size" not in cfg:
            merged = {**inner, "name": cfg.get("name"), "architectures": cfg.get("architectures")}
            if "quantization_config" in cfg and "quantization_config" not in inner:
                merged["quantization_config"] = cfg["quantization_config"]
            return merged, f"the language model of {cfg.get('name')} ({key}); its vision tower is left out"
    return cfg, None


@dataclass(frozen=True)
class ResolvedModel:
    """A model as a kernel profile needs it: its HF config (batchsim's shape and memory are
    read from it) and what the wheel builds its op graph from (a bundled id or a folder)."""

    name: str
    config: dict[str, Any]
    wheel_path: str
    note: str | None = None


def resolve_model(model: str | dict[str, Any], folder: Path) -> ResolvedModel:
    """``model`` as a preset name, a Hugging Face id the wheel bundles, or an HF config
    mapping; a config the wheel does not bundle is written to ``folder``/<hash>/config.json
    for its graph builder (which never fetches). KernelsError naming what is missing."""
    from sim.cost.presets import MODEL_PRESETS
    if isinstance(model, str) and model.lower() in MODEL_PRESETS and model.lower() not in PRESET_IDS:
        if model.lower() not in PRESET_ARCHITECTURES:
            raise KernelsError(f"model {model!r}: the kernel tables' graphs are for gated (SwiGLU) decoders "
                               f"and the {aic.WHEEL} wheel bundles no config of this preset; give a Hugging "
                               f"Face id it bundles (e.g. Qwen/Qwen3-32B) or the model's config.json")
        model = preset_hf_config(model.lower())
    if isinstance(model, str):
        model_id = PRESET_IDS.get(model.lower(), model)
        cfg = aic.model_config(model_id)
        name, path = (model.lower() if model.lower() in PRESET_IDS else model_id), model_id
    else:
        cfg, name, path = dict(model), str(model.get("name") or model.get("_name_or_path") or "custom"), ""
    mechanism = unmodelled_mechanism(cfg)
    if mechanism is not None:
        raise KernelsError(f"model {name!r} uses {mechanism}, which batchsim does not model yet")
    decoder, note = language_model_config(cfg)
    if not path:
        body = json.dumps({k: v for k, v in decoder.items() if k != "name"}, sort_keys=True)
        target = folder / "models" / hashlib.sha256(body.encode()).hexdigest()[:16]
        target.mkdir(parents=True, exist_ok=True)
        if "architectures" not in decoder:
            raise KernelsError(f"model {name!r}: its config has no 'architectures' field, which the kernel "
                               f"tables' graph builder needs (e.g. [\"LlamaForCausalLM\"])")
        (target / "config.json").write_text(body)
        path = str(target)
    return ResolvedModel(name, {**decoder, "name": name}, path, note)


# ---- precisions ---------------------------------------------------------------------------
def quant_modes(weights: str | None, stated: str | None, scope: str, kv_cache_dtype: str, generation: str
                ) -> dict[str, str | None]:
    """The wheel's quant modes for batchsim's formats: None where the checkpoint's config
    states the format (the wheel reads it there, block scales included); else the kernel
    class vLLM runs that format in on this generation (FP4 weight-only before Blackwell)."""
    # The KV cache always as batchsim sizes it (vLLM's --kv-cache-dtype: auto is the activation
    # dtype, even for an FP8 checkpoint, whose KV the wheel would otherwise take as FP8).
    modes: dict[str, str | None] = {"gemm_quant_mode": None, "moe_quant_mode": None,
                                    "kvcache_quant_mode": "fp8" if kv_cache_dtype.startswith("fp8") else "bfloat16"}
    if weights is None or weights == stated:
        return modes
    blackwell = generation == "blackwell"
    gemm = {"bf16": "bfloat16", "fp16": "bfloat16", "fp8": "fp8",
            "nvfp4": "nvfp4" if blackwell else "w4a16_nvfp4", "mxfp4": None}.get(weights)
    moe = {"bf16": "bfloat16", "fp16": "bfloat16", "fp8": "fp8", "nvfp4": "nvfp4" if blackwell else "nvfp4_wo",
           "mxfp4": "w4a16_mxfp4"}.get(weights)
    if scope == "experts":
        gemm = None
    modes.update(gemm_quant_mode=gemm, moe_quant_mode=moe)
    return modes


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
           "kv_cache_dtype": spec.kv_cache_dtype, "gpu": dataclasses.asdict(gpu)}
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
                  expert_parallel=spec.expert_parallel)
    modes = quant_modes(precision.weight_dtype, stated, scope, precision.kv_cache_dtype, gpu.generation)
    tables = aic.KernelTables(model.wheel_path, system, spec.engine, version, spec.tensor_parallel,
                              expert_parallel=spec.expert_parallel, **modes)
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
    label = precision.label() + ("-ep" if spec.expert_parallel else "")
    engine_name = aic.ENGINES[spec.engine]
    extra = {**({"weight_dtype": precision.weights} if precision.is_quantized else {}),
             **({"kv_cache_dtype": precision.kv_cache_dtype} if precision.kv_cache_dtype != "auto" else {})}
    return Profile(
        name=f"{model.name}@{gpu.name}-tp{t}-{label}-{spec.engine}-{version}", model=shape, device=gpu.name,
        dtype=precision.dtype, tensor_parallel=t, memory_bytes_per_gpu=gpu.memory_bytes,
        weight_bytes=rf.weight_bytes, activation_bytes_per_gpu=rf.activation_bytes_per_gpu(0),
        activation_bytes_per_token_per_gpu=rf.activation_bytes_per_gpu(1) - rf.activation_bytes_per_gpu(0),
        kv_bytes_per_token=rf.kv_bytes_per_token, kv_bytes_per_seq=rf.kv_bytes_per_seq, overhead_s=0.0,
        linear=Curve1D(grids["linear"], values["linear"], name="curves.linear", measured_max=limits.get("tokens")),
        lm_head=Curve1D(grids["lm_head"], values["lm_head"], name="curves.lm_head",
                        measured_max=limits.get("tokens")),
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
    analytic roofline charges it), per request as the server's request overhead."""
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
        engine={**tables.engine, "request_overhead_s": host.request_s}, provenance=prov)

"""Number formats: what a weight or a KV entry costs in bytes, and which tensor-core rate a GEMM runs at.

Three precisions describe one deployment:

- ``dtype`` (``profile.dtype``): the activation dtype, bf16 / fp16 / fp32 (vLLM's ``--dtype``);
  the shorthand "weights and KV in that dtype" when nothing else is said.
- ``weight_dtype``: how the decoder layers' linear weights are stored: one of ``WEIGHT_DTYPES``.
  fp8 is 1 byte a parameter (its per-tensor or per-channel scales are a few bytes a row: not
  counted); fp4 kinds are half a byte plus their block scales, which are counted: nvfp4 has one
  fp8 (E4M3) scale per 16 values (+1/16 byte a parameter), mxfp4 one E8M0 scale per 32 (+1/32).
  The embedding and the LM head stay in the activation dtype (FP8/FP4 checkpoints list lm_head
  among the modules not converted); with ``quantized: experts`` (gpt-oss's mxfp4) only the MoE
  experts are quantized and attention, router and shared weights stay in the activation dtype.
- ``kv_cache_dtype`` (vLLM's ``--kv-cache-dtype``): auto = the activation dtype, or fp8 (e4m3 /
  e5m2), 1 byte an element.

Which rate a quantized GEMM runs at depends on the GPU (``gemm_precision``): with FP8 tensor cores
(Ada, Hopper, Blackwell) vLLM quantizes activations on the fly and runs W8A8 at the FP8 peak; on
Ampere (no FP8 tensor cores) it runs FP8 weights weight-only (W8A16, Marlin): BF16 peak, 1-byte
weight reads. FP4 likewise runs at the FP4 peak on Blackwell only; on Hopper and older, vLLM runs
mxfp4 / nvfp4 weight-only through Marlin: BF16 peak, 4-bit weights plus scales.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

ACTIVATION_DTYPES = {"bf16": 2, "fp16": 2, "fp32": 4}
# Bytes per parameter, block scales included (see the module docstring).
WEIGHT_BYTES_PER_PARAM: dict[str, float] = {
    "bf16": 2.0, "fp16": 2.0, "fp32": 4.0,
    "fp8": 1.0,
    "nvfp4": 0.5 + 1 / 16,        # 4 bits + one 1-byte E4M3 scale per 16 values = 0.5625
    "mxfp4": 0.5 + 1 / 32,        # 4 bits + one 1-byte E8M0 scale per 32 values = 0.53125
    # NOTE: integer 4-bit, weight-only, one bf16 scale per group of 32 (Kimi-K2's compressed-tensors
    # checkpoints, group_size 32): 0.5 + 2/32 = 0.5625; a group of 128 would be 0.515625 (-8%).
    "int4": 0.5 + 2 / 32,
}
WEIGHT_ALIASES = {"fp4": "nvfp4", "float8": "fp8", "fp8_e4m3": "fp8"}
WEIGHT_DTYPES = tuple(WEIGHT_BYTES_PER_PARAM) + tuple(WEIGHT_ALIASES)
KV_CACHE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4, "fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1}
KV_CACHE_DTYPES = ("auto",) + tuple(KV_CACHE_BYTES)
QUANTIZED_SCOPES = ("linear", "experts")   # every decoder-layer GEMM | the MoE experts only
# The tensor-core class a GEMM of that weight format runs on, where the GPU has it.
_GEMM_CLASS = {"fp8": "fp8", "nvfp4": "fp4", "mxfp4": "fp4"}
_WEIGHT_ONLY = {"fp8": "w8a16", "fp4": "w4a16"}     # where the GPU lacks the tensor cores
_ALWAYS_WEIGHT_ONLY = {"int4": "w4a16"}             # no tensor cores of the format: Marlin/Machete W4A16


def weight_dtype_name(value: str) -> str:
    """The canonical weight format for ``value`` (``fp4`` -> ``nvfp4``); ValueError listing the choices."""
    name = WEIGHT_ALIASES.get(str(value).lower(), str(value).lower()) if isinstance(value, str) else None
    if name not in WEIGHT_BYTES_PER_PARAM:
        raise ValueError(f"weight_dtype {value!r} is not supported; expected one of {', '.join(WEIGHT_DTYPES)}")
    return name


@dataclass(frozen=True, slots=True)
class Precision:
    """The number formats of one deployment (see the module docstring). ValueError on bad names."""

    dtype: str = "bf16"                  # activations (and, with the defaults, weights and KV)
    weight_dtype: str | None = None      # None: the activation dtype
    kv_cache_dtype: str = "auto"
    quantized: str = "linear"            # which weights weight_dtype applies to: QUANTIZED_SCOPES

    def __post_init__(self) -> None:
        if self.dtype not in ACTIVATION_DTYPES:
            raise ValueError(f"dtype {self.dtype!r} is not supported; use one of {sorted(ACTIVATION_DTYPES)}")
        if self.weight_dtype is not None:
            w = weight_dtype_name(self.weight_dtype)
            if w in ACTIVATION_DTYPES and w != self.dtype:
                raise ValueError(f"weight_dtype {w!r} differs from dtype {self.dtype!r}: unquantized weights are "
                                 f"stored in the activation dtype; set dtype: {w} (or a quantized weight_dtype: "
                                 f"fp8, nvfp4, mxfp4)")
            object.__setattr__(self, "weight_dtype", w)
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype {self.kv_cache_dtype!r} is not supported; expected one of "
                             f"{', '.join(KV_CACHE_DTYPES)}")
        if self.quantized not in QUANTIZED_SCOPES:
            raise ValueError(f"quantized {self.quantized!r} must be one of {', '.join(QUANTIZED_SCOPES)}")

    @property
    def weights(self) -> str:
        """The weight format of the quantized weights (the activation dtype when unquantized)."""
        return self.weight_dtype or self.dtype

    @property
    def is_quantized(self) -> bool:
        return self.weights not in ACTIVATION_DTYPES

    @property
    def activation_bytes(self) -> int:
        return ACTIVATION_DTYPES[self.dtype]

    @property
    def weight_bytes_per_param(self) -> float:
        return WEIGHT_BYTES_PER_PARAM[self.weights]

    @property
    def kv_bytes_per_element(self) -> int:
        return self.activation_bytes if self.kv_cache_dtype == "auto" else KV_CACHE_BYTES[self.kv_cache_dtype]

    @property
    def kv_dtype(self) -> str:
        """The KV cache's own format (auto resolved)."""
        return self.dtype if self.kv_cache_dtype == "auto" else self.kv_cache_dtype

    def gemm_precision(self, gpu: Any) -> str:
        """The kernel class the quantized GEMMs run as on ``gpu``: "fp8" or "fp4" where the
        GPU has that peak (``GpuSpec.peak_flops_fp8`` / ``peak_flops_fp4`` > 0), else the
        weight-only kernels (Marlin W8A16 / W4A16: "w8a16" / "w4a16"), whose math runs at
        the activation dtype's peak; the activation dtype itself for unquantized weights."""
        if self.weights in _ALWAYS_WEIGHT_ONLY:
            return _ALWAYS_WEIGHT_ONLY[self.weights]
        cls = _GEMM_CLASS.get(self.weights)
        if cls is None:
            return self.dtype
        return cls if (getattr(gpu, f"peak_flops_{cls}", 0) or 0) > 0 else _WEIGHT_ONLY[cls]

    def label(self) -> str:
        """"bf16", or "bf16-w_fp8-kv_fp8" when weights or KV differ from the activation dtype."""
        parts = [self.dtype]
        if self.is_quantized:
            parts.append(f"w_{self.weights}" + ("-experts" if self.quantized == "experts" else ""))
        if self.kv_dtype != self.dtype:
            parts.append(f"kv_{self.kv_dtype}")
        return "-".join(parts)


def precision_from_hf(cfg: Mapping[str, Any], name: str) -> tuple[str | None, str]:
    """(weight_dtype, quantized scope) a HF config's ``quantization_config`` states; (None,
    "linear") without one. Understood: ``quant_method: fp8`` (vLLM/HF FP8 checkpoints);
    compressed-tensors whose config groups' weights are ``type: float, num_bits: 8`` (or
    ``format: float-quantized``), or ``type: int, num_bits: 4`` packed (Kimi-K2's INT4 experts:
    weight-only, ``gemm_precision`` w4a16); ModelOpt's ``quant_algo: FP8 | NVFP4``; ``quant_method:
    mxfp4`` (gpt-oss: the MoE experts only, attention and the rest stay bf16). Any other
    method is a ValueError naming it (a silent bf16 would double the weights)."""
    q = cfg.get("quantization_config")
    if q is None:                                     # a multimodal config: its language model's
        from sim.cost.hf_config import language_model_config
        q = language_model_config(cfg)[0].get("quantization_config")
    if q is None:
        return None, "linear"
    if not isinstance(q, Mapping):
        raise ValueError(f"model '{name}': field 'quantization_config' must be a mapping, got {q!r}")
    method = str(q.get("quant_method", "")).lower()
    algo = str(q.get("quant_algo", "") or (q.get("quantization") or {}).get("quant_algo", "")).upper()
    if method == "fp8":
        return "fp8", "linear"
    if method == "mxfp4":
        return "mxfp4", "experts"
    if method == "modelopt" or algo:
        if algo.startswith("FP8"):
            return "fp8", "linear"
        if algo == "NVFP4":
            return "nvfp4", "linear"
        raise ValueError(f"model '{name}': quantization_config.quant_algo {algo!r} is not supported; "
                         f"batchsim models FP8 and NVFP4")
    if method == "compressed-tensors":
        fmt = str(q.get("format", "")).lower()
        groups = q.get("config_groups") or {}
        weights = [g.get("weights") or {} for g in groups.values() if isinstance(g, Mapping)] \
            if isinstance(groups, Mapping) else []
        bits = {(str(w.get("type", "")).lower(), w.get("num_bits")) for w in weights if isinstance(w, Mapping)}
        if fmt == "float-quantized" or bits == {("float", 8)}:
            return "fp8", "linear"
        if fmt == "nvfp4-pack-quantized" or bits == {("float", 4)}:
            return "nvfp4", "linear"
        if bits == {("int", 4)} and fmt == "pack-quantized":
            # Kimi-K2's INT4 experts: its ignore list keeps attention, shared experts and the dense
            # MLP in bf16 (any "self_attn" pattern among the modules left out: the experts only).
            ignore = [str(i) for i in q.get("ignore") or []]
            return "int4", "experts" if any("self_attn" in i for i in ignore) else "linear"
        raise ValueError(f"model '{name}': compressed-tensors quantization (format {fmt!r}, weights {sorted(bits)}) "
                         f"is not supported; batchsim models float 8-bit (FP8), NVFP4 and INT4 (pack-quantized) "
                         f"weights")
    raise ValueError(f"model '{name}': quantization_config.quant_method {method!r} is not supported; batchsim "
                     f"models fp8, compressed-tensors FP8/NVFP4, modelopt FP8/NVFP4 and mxfp4 (or drop "
                     f"quantization_config and set profile.weight_dtype)")

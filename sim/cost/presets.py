"""Datasheet facts of common GPUs and the shapes of common open models.

``GPU_PRESETS`` and ``MODEL_PRESETS`` are plain dicts keyed by lowercase names;
``sim.cost.roofline`` turns a (model, GPU) pair into an analytic ``Profile``.

Memory sizes are what the CUDA driver reports as total memory (``nvidia-smi``
"MiB" column, MiB = 2**20 bytes), not the marketing "GB" figure: that is the
number an engine's KV-cache sizing starts from.
"""

from __future__ import annotations

import csv
from collections.abc import Mapping
from dataclasses import MISSING, dataclass, fields
from functools import lru_cache
from pathlib import Path
from typing import Any

from sim.cost.profile import ModelShape

MIB = 1024**2
TERA = 1e12
GIGA = 1e9


@dataclass(frozen=True, slots=True)
class GpuSpec:
    """One GPU's peak rates (dense, no sparsity) and memory.

    interconnect_bytes_s: per-direction GPU-to-GPU bandwidth (NVLink, or PCIe
        where there is no NVLink).
    interconnect_latency_s: fixed cost of one small all-reduce call (a measured
        order of magnitude, not a datasheet number; sources beside each preset).
    interconnect_kind: "nvlink" or "pcie".
    """

    name: str
    memory_bytes: int
    peak_flops_bf16: float
    # Plain FP32 (CUDA cores, no TF32): what fp32 serving runs at, since vLLM keeps PyTorch's
    # float32 matmul precision "highest" (VLLM_FLOAT32_MATMUL_PRECISION), which turns TF32 off.
    peak_flops_fp32: float
    mem_bandwidth_bytes_s: float
    interconnect_bytes_s: float
    interconnect_latency_s: float
    interconnect_kind: str = "nvlink"


GPU_PRESETS: dict[str, GpuSpec] = {
    "a100-40gb": GpuSpec(
        name="a100-40gb",
        memory_bytes=40960 * MIB,               # nvidia-smi: 40960 MiB (A100 SXM4 40GB)
        peak_flops_bf16=312 * TERA,             # A100 datasheet: BF16 tensor core 312 TFLOPS dense
        peak_flops_fp32=19.5 * TERA,            # A100 datasheet: FP32 19.5 TFLOPS
        mem_bandwidth_bytes_s=1555 * GIGA,      # A100 datasheet: 40GB HBM2 1,555 GB/s
        interconnect_bytes_s=300 * GIGA,        # NVLink 3: 600 GB/s total = 300 GB/s per direction
        interconnect_latency_s=10e-6,           # small-message NVLink all-reduce, ~10 us
    ),
    "a100-80gb": GpuSpec(
        name="a100-80gb",
        memory_bytes=81920 * MIB,               # nvidia-smi: 81920 MiB (A100 SXM4 80GB)
        peak_flops_bf16=312 * TERA,             # A100 datasheet: BF16 tensor core 312 TFLOPS dense
        peak_flops_fp32=19.5 * TERA,            # A100 datasheet: FP32 19.5 TFLOPS
        mem_bandwidth_bytes_s=2039 * GIGA,      # A100 datasheet: 80GB HBM2e SXM 2,039 GB/s
        interconnect_bytes_s=300 * GIGA,        # NVLink 3: 600 GB/s total = 300 GB/s per direction
        interconnect_latency_s=10e-6,           # small-message NVLink all-reduce, ~10 us
    ),
    "h100-sxm": GpuSpec(
        name="h100-sxm",
        memory_bytes=81559 * MIB,               # nvidia-smi: 81559 MiB ("80GB HBM3")
        peak_flops_bf16=989 * TERA,             # H100 SXM datasheet: BF16 1,979 TFLOPS with sparsity / 2
        peak_flops_fp32=67 * TERA,              # H100 SXM datasheet: FP32 67 TFLOPS
        mem_bandwidth_bytes_s=3350 * GIGA,      # H100 SXM datasheet: 3.35 TB/s
        interconnect_bytes_s=450 * GIGA,        # NVLink 4: 900 GB/s total = 450 GB/s per direction
        # vLLM's custom all-reduce on H100, TP 2-8, <= 32 KiB: 8.5-11.8 us (sgl-project/sglang#2904)
        interconnect_latency_s=10e-6,
    ),
    "h200": GpuSpec(
        name="h200",
        memory_bytes=143771 * MIB,              # nvidia-smi: 143771 MiB (datasheet says "141 GB")
        peak_flops_bf16=989 * TERA,             # H200 SXM datasheet: BF16 1,979 TFLOPS with sparsity / 2
        peak_flops_fp32=67 * TERA,              # H200 SXM datasheet: FP32 67 TFLOPS
        mem_bandwidth_bytes_s=4800 * GIGA,      # H200 datasheet: 4.8 TB/s
        interconnect_bytes_s=450 * GIGA,        # NVLink 4: 900 GB/s total = 450 GB/s per direction
        interconnect_latency_s=10e-6,           # small-message NVLink all-reduce, ~10 us
    ),
    "l40s": GpuSpec(
        name="l40s",
        memory_bytes=46068 * MIB,               # nvidia-smi: 46068 MiB (48 GB GDDR6, ECC on)
        peak_flops_bf16=362 * TERA,             # L40S datasheet: BF16 733 TFLOPS with sparsity / 2 (362.05)
        peak_flops_fp32=91.6 * TERA,            # L40S datasheet: FP32 91.6 TFLOPS
        mem_bandwidth_bytes_s=864 * GIGA,       # L40S datasheet: 864 GB/s
        interconnect_bytes_s=32 * GIGA,         # no NVLink: PCIe Gen4 x16, ~32 GB/s per direction
        # vLLM's custom all-reduce needs NVLink; NCCL's small-message all-reduce over PCIe, ~25 us
        interconnect_latency_s=25e-6,
        interconnect_kind="pcie",
    ),
}


MODEL_PRESETS: dict[str, ModelShape] = {
    # meta-llama/Llama-2-7b-hf config.json
    "llama-2-7b": ModelShape("llama-2-7b", 4096, 32, 32, 32, 11008, 32000, 4096),
    # meta-llama/Llama-2-13b-hf config.json
    "llama-2-13b": ModelShape("llama-2-13b", 5120, 40, 40, 40, 13824, 32000, 4096),
    # meta-llama/Llama-3.1-8B config.json
    "llama-3.1-8b": ModelShape("llama-3.1-8b", 4096, 32, 32, 8, 14336, 128256, 131072,
                               rope_theta=500000.0),
    # mistralai/Mistral-7B-v0.1 config.json
    "mistral-7b": ModelShape("mistral-7b", 4096, 32, 32, 8, 14336, 32000, 32768),
    # facebook/opt-13b config.json: ffn_dim 20480, 2-matrix MLP, LM head tied to the embedding
    "opt-13b": ModelShape("opt-13b", 5120, 40, 40, 40, 20480, 50272, 2048,
                          mlp="gelu", tie_word_embeddings=True),
    # meta-llama/Llama-3.1-70B config.json
    "llama-3.1-70b": ModelShape("llama-3.1-70b", 8192, 80, 64, 8, 28672, 128256, 131072,
                                rope_theta=500000.0),
}

# HF config.json name -> ModelShape field; the second spelling is accepted too
# (OPT's ffn_dim, or batchsim's own names as written in a profile file).
_HF_FIELDS: dict[str, tuple[str, ...]] = {
    "hidden_size": ("hidden_size",),
    "num_layers": ("num_hidden_layers", "num_layers"),
    "num_heads": ("num_attention_heads", "num_heads"),
    "intermediate_size": ("intermediate_size", "ffn_dim"),
    "vocab_size": ("vocab_size",),
    "max_position_embeddings": ("max_position_embeddings",),
}
_GATED_ACTS = {"silu", "swish", "swiglu"}
# transformers' ACT2FN names of the plain (two-matrix) MLPs' activations
_PLAIN_ACTS = {"gelu", "gelu_new", "gelu_fast", "gelu_pytorch_tanh", "gelu_python", "gelu_accurate", "gelu_10",
               "quick_gelu", "relu", "relu2", "relu6", "leaky_relu", "tanh", "sigmoid", "mish", "linear",
               "laplace", "prelu", "elu", "selu"}


def _positive_int(cfg: Mapping[str, Any], key: str, name: str) -> int:
    value = cfg[key]
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"model '{name}': field '{key}' must be a positive integer, got {value!r}")
    return value


def _mlp_kind(cfg: Mapping[str, Any], name: str) -> str:
    """batchsim's ``mlp`` key as given, else the kind hidden_act (or OPT's activation_function) implies."""
    if "mlp" in cfg:
        return str(cfg["mlp"])                    # ModelShape checks it is one of MLP_KINDS
    act = cfg.get("hidden_act", cfg.get("activation_function"))
    if act is None:
        raise ValueError(f"model '{name}': config field 'hidden_act' is missing "
                         f"(or 'activation_function'; or give mlp: swiglu | gelu)")
    if not isinstance(act, str):
        raise ValueError(f"model '{name}': field 'hidden_act' must be the activation's name (silu, gelu, ...), "
                         f"got {act!r}")
    if act.lower() not in _GATED_ACTS | _PLAIN_ACTS:
        raise ValueError(f"model '{name}': field 'hidden_act' is {act!r}, an activation batchsim does not know; "
                         f"expected one of {', '.join(sorted(_GATED_ACTS | _PLAIN_ACTS))} (or give mlp: swiglu | "
                         f"gelu)")
    return "swiglu" if act.lower() in _GATED_ACTS else "gelu"


def model_shape_from_hf(cfg: Mapping[str, Any], name: str | None = None) -> ModelShape:
    """A ``ModelShape`` from HF ``config.json`` fields: the one importer, for the
    roofline and the torch model alike.

    Required (no default, since a wrong guess changes costs or memory silently):
    hidden_size, num_hidden_layers, num_attention_heads, intermediate_size (or
    ffn_dim), vocab_size, max_position_embeddings, and the MLP kind: hidden_act
    (or activation_function, OPT) -- silu/swish means a gated 3-matrix MLP
    ("swiglu"), anything else a 2-matrix one ("gelu") -- or batchsim's own
    ``mlp`` key. Optional: num_key_value_heads (default: the number of heads);
    tie_word_embeddings (default True, as in HF's PretrainedConfig); rope_theta,
    or rope_parameters.rope_theta as transformers 5 writes it (default 10000.0);
    head_dim, which must equal hidden_size / num_attention_heads. ``name``
    defaults to the config's ``name`` or ``_name_or_path``, else "custom".
    Raises ValueError naming the missing or bad field.
    """
    if not isinstance(cfg, Mapping):
        raise ValueError(f"model '{name}': expected a mapping of config fields, got {type(cfg).__name__}")
    name = name or str(cfg.get("name") or cfg.get("_name_or_path") or "custom")
    values: dict[str, int] = {}
    for field_name, keys in _HF_FIELDS.items():
        key = next((k for k in keys if k in cfg), None)
        if key is None:
            raise ValueError(f"model '{name}': config field '{keys[0]}' is missing"
                             + (f" (or '{keys[1]}')" if len(keys) > 1 else ""))
        values[field_name] = _positive_int(cfg, key, name)
    kv_key = next((k for k in ("num_key_value_heads", "num_kv_heads") if cfg.get(k) is not None), None)
    num_kv_heads = _positive_int(cfg, kv_key, name) if kv_key else values["num_heads"]
    rope_parameters = cfg.get("rope_parameters") or {}
    if not isinstance(rope_parameters, Mapping):
        raise ValueError(f"model '{name}': field 'rope_parameters' must be a mapping (rope_theta, rope_type, ...), "
                         f"got {rope_parameters!r}")
    rope_theta = cfg.get("rope_theta", rope_parameters.get("rope_theta", 10000.0))
    shape = ModelShape(name=name, num_kv_heads=num_kv_heads, mlp=_mlp_kind(cfg, name),
                       tie_word_embeddings=bool(cfg.get("tie_word_embeddings", True)),
                       rope_theta=rope_theta, **values)
    head_dim = cfg.get("head_dim")
    if head_dim is not None and head_dim != shape.head_dim:
        raise ValueError(f"model '{name}': field 'head_dim' is {head_dim!r} but hidden_size / "
                         f"num_attention_heads is {shape.head_dim}; a separate head_dim is not supported")
    return shape


def model_shape_from_dict(spec: Mapping[str, Any]) -> ModelShape:
    """A ModelShape from HF ``config.json`` fields (a dict with
    ``num_hidden_layers``: ``model_shape_from_hf``) or from ModelShape's own
    fields, as a profile file's ``model`` section holds them (their defaults
    apply). Unknown or missing own fields are a ValueError that lists them."""
    if "num_hidden_layers" in spec:
        return model_shape_from_hf(spec)
    allowed = [f.name for f in fields(ModelShape)]
    unknown = sorted(set(spec) - set(allowed))
    if unknown:
        raise ValueError(f"unknown model field(s) {unknown}; allowed: {', '.join(allowed)}")
    missing = [f.name for f in fields(ModelShape) if f.default is MISSING and f.name not in spec]
    if missing:
        raise ValueError(f"model config is missing field(s) {missing}")
    return ModelShape(**spec)


# ---- validation error of the analytic presets ------------------------------------
PRESET_ERRORS_PATH = (Path(__file__).resolve().parents[2] / "calibrate" / "profiles" / "public_vllm"
                      / "preset_errors.csv")
_INT_COLUMNS = ("tensor_parallel", "num_rows", "num_rows_all")
_FLOAT_COLUMNS = ("mae_pct", "bias_pct", "p90_abs_pct", "mae_pct_all")


@lru_cache(maxsize=4)
def _preset_error_table(path: str) -> dict[tuple[str, int], dict[str, Any]]:
    p = Path(path)
    if not p.is_file():
        return {}
    out: dict[tuple[str, int], dict[str, Any]] = {}
    with p.open(newline="") as f:
        for row in csv.DictReader(f):
            e: dict[str, Any] = dict(row)
            e.update({k: int(row[k]) for k in _INT_COLUMNS})
            e.update({k: float(row[k]) for k in _FLOAT_COLUMNS})
            out[(e["gpu"], e["tensor_parallel"])] = e
    return out


def preset_error(gpu: str, tp: int, path: str | Path | None = None) -> dict[str, Any] | None:
    """The validation error of the analytic preset on ``gpu`` at tensor parallel ``tp``,
    measured against public vLLM runs (``calibrate/profiles/public_vllm/``), or None
    where no run was checked (other GPUs and degrees).

    Keys: gpu, tensor_parallel, engine, held_out (how the rows were held out),
    num_rows, mae_pct and bias_pct on the held-out rows (sim - real) / real,
    p90_abs_pct, num_rows_all and mae_pct_all over every row, source.
    """
    table = _preset_error_table(str(path or PRESET_ERRORS_PATH))
    return table.get((str(gpu).lower(), int(tp)))

"""Efficiency: the achieved fractions of the datasheet peaks, and the fixed step costs.

Split from ``sim.cost.roofline`` (which re-exports both names). ``MATMUL_FLOPS_FIT`` is
where a fit per (GPU generation, GEMM precision) goes; ``Efficiency.for_gpu`` applies it.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import asdict, dataclass, fields
from typing import Any

from sim.cost.collectives import ATTN_DECODE_FLOPS, DEFAULT_ENGINE, ENGINES, INTERCONNECT_EFFICIENCY, LAYER_FIXED_S, \
    engine_overhead
from sim.cost.presets import GpuSpec


@dataclass(frozen=True, slots=True)
class Efficiency:
    """Achieved fractions of the datasheet peaks, and fixed costs (fitted and checked
    against public vLLM runs: calibrate/profiles/README.md)."""

    matmul_flops: float = 0.68      # dense GEMMs (QKV/O, MLP, LM head)
    # GEMMs of FP8 / FP4 weights where the GPU runs them at its FP8 / FP4 peak
    # (sim.cost.precision.Precision.gemm_precision): the bf16 value until fitted; per
    # GPU generation through MATMUL_FLOPS_FIT (``Efficiency.for_gpu``).
    matmul_flops_fp8: float = 0.68
    matmul_flops_fp4: float = 0.68
    matmul_flops_w8a16: float = 0.68     # weight-only kernels (Marlin): math at the activation dtype's peak
    matmul_flops_w4a16: float = 0.68
    mem_bw: float = 0.83            # weight + activation streaming in the linear layers
    attn_flops: float = 0.50        # prefill attention math (FlashAttention, tensor cores)
    attn_decode_flops: float = ATTN_DECODE_FLOPS  # paged decode attention: CUDA cores, per query head
    attn_mem_bw: float = 0.82       # paged KV reads (block-table gathers)
    interconnect: float = INTERCONNECT_EFFICIENCY  # all-reduce bus bandwidth / link peak at serving sizes
    layer_fixed_s: float = LAYER_FIXED_S          # per layer per forward pass: the kernels' floor
    # The serving engine's host work (sim.cost.collectives.ENGINES): per step (schedule, prepare
    # inputs, sample, process outputs), extra per step when TP > 1, per scheduled sequence.
    engine: str = DEFAULT_ENGINE
    overhead_s: float = ENGINES[DEFAULT_ENGINE].step_s
    tp_overhead_s: float = ENGINES[DEFAULT_ENGINE].tp_step_s
    per_seq_s: float = ENGINES[DEFAULT_ENGINE].per_seq_s
    # Near the ridge point: tile buffers between the memory and math stages of a kernel
    # (Ampere's multistage GEMM mainloop keeps 3); inf = the hard max(c, m).
    pipeline_stages: float = 3
    ridge_law: str = (
        "time = (c^(S+1) - m^(S+1)) / (c^S - m^S) with c the compute time, m the memory time and "
        "S = pipeline_stages: a load -> math pipeline with S tile buffers; max(c, m) far from the "
        "ridge, (S+1)/S x c at c = m (4/3 for S = 3; within 0.3% of (c^k + m^k)^(1/k), k = 2.41)"
    )
    justification: str = (
        "Achieved, not peak, rates, fitted on 251 public vLLM 0.5 batches (A100-40GB, H100-SXM, TP 1, "
        "2, 4; calibrate/profiles/public_vllm/) and checked on 253 held out by model: GEMMs reach ~68% "
        "of tensor-core peak, weight streaming ~83% and paged-KV reads ~82% of HBM bandwidth; prefill "
        "attention keeps the 50% prior; vLLM's paged-attention decode kernel runs on CUDA cores per "
        "query head (~1.3% of the tensor-core peak). Every layer pays a kernel floor (layer_fixed_s) "
        "that TP does not shrink; TP adds 2 all-reduces per layer, one after the embedding and a "
        "logits gather, each the link's call latency plus bytes at ~20% of link peak (sim.cost.collectives). "
        "The engine's host work is per step, per step at TP > 1 and per sequence (engine: "
        "sim.cost.collectives.ENGINES; vllm-v0 fitted, vllm-v1 and vllm-v1-async from vLLM's own measurements). "
        "Near the ridge point (96-768 tokens per step on A100/H100) compute and memory are both "
        "partly active: the time is that of a 3-buffer load -> math pipeline (ridge_law), up to "
        "4/3 x max(compute, memory); Vidur's A100 Llama-2-7B medians agree within 10% at 32, 128, "
        "512 and 2048 tokens (calibrate/profiles/README.md)."
    )

    def __post_init__(self) -> None:
        for f in fields(self):           # rates must be > 0, fixed costs >= 0
            value = getattr(self, f.name)
            if isinstance(value, str) and f.name in ("ridge_law", "justification", "engine"):
                continue
            if not isinstance(value, (int, float)) or value < 0 or (value == 0 and not f.name.endswith("_s")):
                raise ValueError(f"Efficiency.{f.name} must be {'>= 0' if f.name.endswith('_s') else '> 0'}, "
                                 f"got {value!r}")
        stages = self.pipeline_stages
        if not (math.isinf(stages) or (float(stages).is_integer() and stages >= 1)):
            raise ValueError(f"Efficiency.pipeline_stages must be a whole number >= 1 or inf, got {stages!r}")

    @classmethod
    def peak(cls) -> Efficiency:
        """The pure peak-rate roofline: every fraction 1, no fixed costs, the hard max(c, m)."""
        return cls(matmul_flops=1.0, matmul_flops_fp8=1.0, matmul_flops_fp4=1.0, matmul_flops_w8a16=1.0,
                   matmul_flops_w4a16=1.0, mem_bw=1.0, attn_flops=1.0, attn_decode_flops=1.0, attn_mem_bw=1.0,
                   interconnect=1.0, layer_fixed_s=0.0, engine="none", overhead_s=0.0, tp_overhead_s=0.0,
                   per_seq_s=0.0, pipeline_stages=math.inf, ridge_law="time = max(c, m)",
                   justification="peak-rate roofline, no losses")

    @classmethod
    def for_engine(cls, engine: str) -> Efficiency:
        """The defaults with the host-work terms of ``engine`` (sim.cost.collectives.ENGINES)."""
        e = engine_overhead(engine)
        return cls(engine=e.name, overhead_s=e.step_s, tp_overhead_s=e.tp_step_s, per_seq_s=e.per_seq_s)

    @classmethod
    def for_gpu(cls, gpu: GpuSpec, base: Efficiency | None = None, moe: bool = False) -> Efficiency:
        """``base`` (default: the defaults) with the matmul fractions fitted for ``gpu``'s
        generation and the model's kind (``moe``: a mixture of experts; ``MATMUL_FLOPS_FIT``),
        where there are any."""
        base = base or cls()
        kind = "moe" if moe else "dense"
        updates = {f"matmul_flops{'' if prec == 'bf16' else '_' + prec}": value
                   for (gen, prec, k), value in MATMUL_FLOPS_FIT.items() if gen == gpu.generation and k == kind}
        return dataclasses.replace(base, **updates) if updates else base

    def matmul_fraction(self, precision: str) -> float:
        """The achieved fraction of the peak for GEMMs at ``precision`` (bf16/fp16/fp32, fp8, fp4)."""
        return {"fp8": self.matmul_flops_fp8, "fp4": self.matmul_flops_fp4, "w8a16": self.matmul_flops_w8a16,
                "w4a16": self.matmul_flops_w4a16}.get(precision, self.matmul_flops)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


# Fitted matmul fractions per (GpuSpec.generation, GEMM class: "fp8" | "fp4" | "w8a16" |
# "w4a16", model kind: "dense" | "moe"), for Efficiency.for_gpu; written by
# `python benchmarks/bench_presets_public.py --serving --fit` from the training models' rows
# of calibrate/profiles/public_serving/ (vLLM 0.10-0.25 serving runs of gpt-oss-120b,
# Qwen3-32B, Qwen3-235B-A22B and Mistral-Small-24B; rows per entry beside it). The MoE entries
# are far below a GEMM kernel's efficiency because they also absorb what the roofline leaves
# out at those runs (grouped expert GEMMs with few tokens per expert, dequantization, the API
# server's streaming work with 1,000 requests in flight): read them as what a step of that
# model class costs on that generation, not as tensor-core utilisation, and they apply to
# MoE models only. A (generation, class, kind) without an entry, bf16 and fp16 keep
# Efficiency's fields (0.68, fitted on A100/H100 bf16/fp16 batches): dense FP8 on Hopper
# has no public vLLM >= 0.10 run here, so its trust line says "unknown".
MATMUL_FLOPS_FIT: dict[tuple[str, str, str], float] = {
    ("ampere", "w4a16", "moe"): 0.193,    # 5 rows: gpt-oss-120b (mxfp4 experts, Marlin MoE) on A100-80GB, TP 1-2
    ("ampere", "w8a16", "dense"): 0.378,  # 1 row: Qwen3-32B-FP8 (Marlin W8A16) on A100-80GB
    ("hopper", "w4a16", "moe"): 0.166,    # 19 rows: gpt-oss-120b (mxfp4 experts) on H100, TP 1-8
    ("hopper", "fp8", "moe"): 0.106,      # 4 rows: Qwen3-235B-A22B-FP8 on H100, TP 4-8, with and without EP
    ("blackwell", "fp8", "moe"): 0.439,   # 1 row: Qwen3-235B-A22B-FP8 on B200, TP 4, 30K-token prompts
    ("blackwell", "fp4", "dense"): 0.26,  # 1 row: Mistral-Small-24B NVFP4 on B200
}
# Not fitted: (blackwell, fp4, moe): its one row (gpt-oss-120b on 8 x B200, 1,000 ShareGPT prompts
# at once) wants a fraction below the search's floor (0.05): what it misses is not GEMM speed.

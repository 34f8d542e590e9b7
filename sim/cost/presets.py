"""Datasheet facts of common GPUs and the shapes of common open models.

``GPU_PRESETS`` and ``MODEL_PRESETS`` are plain dicts keyed by lowercase names;
``sim.cost.roofline`` turns a (model, GPU) pair into an analytic ``Profile``.

Memory sizes are what the CUDA driver reports as total memory (``nvidia-smi``
"MiB" column, MiB = 2**20 bytes), not the marketing "GB" figure: that is the
number an engine's KV-cache sizing starts from.
"""

from __future__ import annotations

import csv
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

from sim.cost.hf_config import model_shape_from_dict, model_shape_from_hf  # noqa: F401 (re-exported)
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
    generation: the architecture (``GENERATIONS``): what a fitted efficiency per
        (generation, precision) is keyed by (``sim.cost.roofline.MATMUL_FLOPS_FIT``).
    peak_flops_fp8, peak_flops_fp4: dense FP8 / FP4 tensor-core peaks; 0 where the
        hardware has none (then vLLM runs such weights weight-only at the BF16 rate:
        ``sim.cost.precision``).
    price_per_gpu_hour: a default on-demand price in $ per GPU-hour for plans
        (``reports.experiments.planspec``), with its source beside each preset; None: unknown.
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
    generation: str = ""
    peak_flops_fp8: float = 0.0
    peak_flops_fp4: float = 0.0
    price_per_gpu_hour: float | None = None


GENERATIONS = ("ampere", "ada", "hopper", "blackwell", "xe2")
PETA = 1e15


GPU_PRESETS: dict[str, GpuSpec] = {
    "a100-40gb": GpuSpec(
        name="a100-40gb",
        memory_bytes=40960 * MIB,               # nvidia-smi: 40960 MiB (A100 SXM4 40GB)
        peak_flops_bf16=312 * TERA,             # A100 datasheet: BF16 tensor core 312 TFLOPS dense
        peak_flops_fp32=19.5 * TERA,            # A100 datasheet: FP32 19.5 TFLOPS
        mem_bandwidth_bytes_s=1555 * GIGA,      # A100 datasheet: 40GB HBM2 1,555 GB/s
        interconnect_bytes_s=300 * GIGA,        # NVLink 3: 600 GB/s total = 300 GB/s per direction
        interconnect_latency_s=10e-6,           # small-message NVLink all-reduce, ~10 us
        generation="ampere",                    # no FP8/FP4 tensor cores: FP8 weights run W8A16 (Marlin)
        price_per_gpu_hour=1.3,                 # assumed: typical on-demand cloud price 2025 ($1.1-1.5)
    ),
    "a100-80gb": GpuSpec(
        name="a100-80gb",
        memory_bytes=81920 * MIB,               # nvidia-smi: 81920 MiB (A100 SXM4 80GB)
        peak_flops_bf16=312 * TERA,             # A100 datasheet: BF16 tensor core 312 TFLOPS dense
        peak_flops_fp32=19.5 * TERA,            # A100 datasheet: FP32 19.5 TFLOPS
        mem_bandwidth_bytes_s=2039 * GIGA,      # A100 datasheet: 80GB HBM2e SXM 2,039 GB/s
        interconnect_bytes_s=300 * GIGA,        # NVLink 3: 600 GB/s total = 300 GB/s per direction
        interconnect_latency_s=10e-6,           # small-message NVLink all-reduce, ~10 us
        generation="ampere",                    # no FP8/FP4 tensor cores: FP8 weights run W8A16 (Marlin)
        price_per_gpu_hour=1.8,                 # assumed: typical on-demand cloud price 2025 ($1.5-2.0)
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
        generation="hopper",
        peak_flops_fp8=1979 * TERA,             # H100 SXM datasheet: FP8 3,958 TFLOPS with sparsity / 2
        price_per_gpu_hour=2.99,                # assumed: common on-demand list price 2025 ($2.5-3.5)
    ),
    "h200": GpuSpec(
        name="h200",
        memory_bytes=143771 * MIB,              # nvidia-smi: 143771 MiB (datasheet says "141 GB")
        peak_flops_bf16=989 * TERA,             # H200 SXM datasheet: BF16 1,979 TFLOPS with sparsity / 2
        peak_flops_fp32=67 * TERA,              # H200 SXM datasheet: FP32 67 TFLOPS
        mem_bandwidth_bytes_s=4800 * GIGA,      # H200 datasheet: 4.8 TB/s
        interconnect_bytes_s=450 * GIGA,        # NVLink 4: 900 GB/s total = 450 GB/s per direction
        interconnect_latency_s=10e-6,           # small-message NVLink all-reduce, ~10 us
        generation="hopper",
        peak_flops_fp8=1979 * TERA,             # H200 SXM datasheet: FP8 3,958 TFLOPS with sparsity / 2
        price_per_gpu_hour=3.8,                 # assumed: on-demand cloud price 2025 ($3.5-4.5)
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
        generation="ada",
        peak_flops_fp8=733 * TERA,              # L40S datasheet: FP8 1,466 TFLOPS with sparsity / 2 (Ada has FP8)
        price_per_gpu_hour=0.95,                # assumed: on-demand cloud price 2025 ($0.8-1.0)
    ),
    "b200-sxm": GpuSpec(
        name="b200-sxm",
        # nvidia-smi on an HGX B200: 183359 MiB (NVIDIA/TensorRT-LLM#10278; "180 GB HBM3e" on the datasheet)
        memory_bytes=183359 * MIB,
        peak_flops_bf16=2.25 * PETA,            # HGX B200 datasheet: FP16/BF16 4.5 PFLOPS with sparsity / 2
        peak_flops_fp32=75 * TERA,              # HGX B200 datasheet: FP32 75 TFLOPS
        mem_bandwidth_bytes_s=8000 * GIGA,      # datasheet 8 TB/s (the driver reports a 7680-bit bus: ~7.7 TB/s,
                                                # pytorch/ao#4002; the HGX table says 7.7 TB/s)
        interconnect_bytes_s=900 * GIGA,        # NVLink 5: 1.8 TB/s total = 900 GB/s per direction
        interconnect_latency_s=10e-6,           # assumed as on Hopper (NVSwitch, small-message all-reduce)
        generation="blackwell",
        peak_flops_fp8=4.5 * PETA,              # HGX B200 datasheet: FP8 9 PFLOPS with sparsity / 2
        peak_flops_fp4=9 * PETA,                # HGX B200 datasheet: FP4 18 PFLOPS with sparsity / 2
        price_per_gpu_hour=5.5,                 # assumed: on-demand cloud price 2025 ($5-6)
    ),
    "gb200": GpuSpec(
        name="gb200",
        # one GPU of a GB200 NVL72: nvidia-smi 189471 MiB (aiconfigurator-core 0.12.0 systems/gb200.yaml;
        # the datasheet says "186 GB HBM3e")
        memory_bytes=189471 * MIB,
        peak_flops_bf16=2.5 * PETA,             # GB200 NVL72 datasheet: FP16/BF16 5 PFLOPS with sparsity / 2
        peak_flops_fp32=80 * TERA,              # GB200 NVL72 datasheet: FP32 80 TFLOPS
        mem_bandwidth_bytes_s=8000 * GIGA,      # GB200 NVL72 datasheet: 8 TB/s per GPU
        interconnect_bytes_s=900 * GIGA,        # NVLink 5: 1.8 TB/s total = 900 GB/s per direction
        interconnect_latency_s=10e-6,           # assumed as on Hopper
        generation="blackwell",
        peak_flops_fp8=5 * PETA,                # GB200 NVL72 datasheet: FP8 10 PFLOPS with sparsity / 2
        peak_flops_fp4=10 * PETA,               # GB200 NVL72 datasheet: FP4 20 PFLOPS with sparsity / 2
        price_per_gpu_hour=6.0,                 # assumed: per-GPU share of NVL72 capacity offers 2025 (unsure)
    ),
    "rtx-pro-6000": GpuSpec(
        name="rtx-pro-6000",
        # RTX PRO 6000 Blackwell (Server Edition): 96 GB GDDR7; nvidia-smi 97887 MiB (reported for the
        # Workstation Edition, same memory; assumed equal for the Server Edition)
        memory_bytes=97887 * MIB,
        # Unsure: the datasheet gives "4 PFLOPS FP4 with sparsity" (4,000 AI TOPS); dense FP4 = 2 PFLOPS,
        # FP8 = 1 PFLOPS and BF16 = 0.5 PFLOPS follow at the usual 2x per halving of the format. The
        # professional (RTX PRO) parts run FP32 accumulation at full rate; GeForce GB202 (RTX 5090) runs
        # FP16/BF16/FP8 with FP32 accumulate at half rate, which does not apply here. Torch BF16 GEMMs
        # measure ~417 TFLOPS on this card (zzc0721/torch-performance-test-data#161), ~83% of 0.5 PFLOPS.
        peak_flops_bf16=500 * TERA,
        peak_flops_fp32=120 * TERA,             # datasheet FP32 ~120-125 TFLOPS (unsure which edition)
        mem_bandwidth_bytes_s=1597 * GIGA,      # Server Edition datasheet: 1,597 GB/s (Workstation: 1,792)
        interconnect_bytes_s=64 * GIGA,         # no NVLink: PCIe Gen5 x16, ~64 GB/s per direction
        interconnect_latency_s=25e-6,           # assumed as L40S: NCCL small-message all-reduce over PCIe
        interconnect_kind="pcie",
        generation="blackwell",
        peak_flops_fp8=1000 * TERA,             # see above (unsure)
        peak_flops_fp4=2000 * TERA,             # datasheet 4 PFLOPS FP4 with sparsity / 2
        price_per_gpu_hour=0.9,                 # assumed: on-demand cloud price 2025 ($0.66-1.0)
    ),
    # The next three take memory, bandwidth, peaks and links from aiconfigurator-core 0.12.0's system
    # specs (systems/<name>.yaml), where their kernel tables were measured.
    "b300-sxm": GpuSpec(
        name="b300-sxm",
        memory_bytes=275040 * MIB,              # b300_sxm.yaml: 275040 MiB reported by nvidia-smi
        peak_flops_bf16=2.25 * PETA,            # b300_sxm.yaml: 2,250 TFLOPS (4.5 PFLOPS sparse / 2)
        peak_flops_fp32=75 * TERA,              # HGX B300 datasheet: FP32 75 TFLOPS
        mem_bandwidth_bytes_s=7750 * GIGA,      # b300_sxm.yaml: 7.75 TB/s (62 TB/s / 8 GPUs)
        interconnect_bytes_s=900 * GIGA,        # b300_sxm.yaml: 1.8 TB/s NVLink bidirectional / 2
        interconnect_latency_s=10e-6,           # b300_sxm.yaml p2p_latency 10 us
        generation="blackwell",
        peak_flops_fp8=4.5 * PETA,              # b300_sxm.yaml: 4.5 PFLOPS (9 PFLOPS sparse / 2)
        peak_flops_fp4=14 * PETA,               # b300_sxm.yaml: 14 PFLOPS dense
        price_per_gpu_hour=7.5,                 # assumed: on-demand cloud price 2026 (unsure; $6.5-8.5 offers)
    ),
    "gb300": GpuSpec(
        name="gb300",
        memory_bytes=284208 * MIB,              # gb300.yaml: 284208 MiB reported by nvidia-smi
        peak_flops_bf16=2.5 * PETA,             # gb300.yaml: 2,500 TFLOPS
        peak_flops_fp32=80 * TERA,              # GB300 NVL72 datasheet: FP32 80 TFLOPS per GPU (unsure)
        mem_bandwidth_bytes_s=8000 * GIGA,      # gb300.yaml: 8 TB/s
        interconnect_bytes_s=900 * GIGA,        # gb300.yaml: NVLink 5, 900 GB/s per direction
        interconnect_latency_s=10e-6,           # gb300.yaml p2p_latency 10 us
        generation="blackwell",
        peak_flops_fp8=5 * PETA,                # gb300.yaml: 5 PFLOPS
        peak_flops_fp4=15 * PETA,               # gb300.yaml: 15 PFLOPS
        price_per_gpu_hour=8.0,                 # assumed: per-GPU share of NVL72 capacity offers 2026 (unsure)
    ),
    "arc-pro-b60": GpuSpec(
        name="arc-pro-b60",
        memory_bytes=24 * 1024 * MIB,           # b60.yaml: 24 GiB (Intel Arc Pro B60)
        peak_flops_bf16=98.3 * TERA,            # b60.yaml: 98.3 TFLOPS
        peak_flops_fp32=12.28 * TERA,           # b60.yaml: 12.28 TFLOPS
        mem_bandwidth_bytes_s=456 * GIGA,       # b60.yaml: 456 GB/s
        interconnect_bytes_s=28.4 * GIGA,       # b60.yaml: PCIe, 28.4 GB/s per direction
        interconnect_latency_s=25e-6,           # assumed as L40S: a collective over PCIe
        interconnect_kind="pcie",
        generation="xe2",                       # Intel Xe2 (Battlemage): no FP8 matrix engines (b60.yaml)
        price_per_gpu_hour=None,                # unknown: no public cloud offer found
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
    # meta-llama/Llama-3.3-70B-Instruct config.json: the 3.1-70B shape
    "llama-3.3-70b": ModelShape("llama-3.3-70b", 8192, 80, 64, 8, 28672, 128256, 131072,
                                rope_theta=500000.0),
    # Qwen/Qwen3-8B config.json: head_dim 128 (= 4096 / 32), 36 layers
    "qwen3-8b": ModelShape("qwen3-8b", 4096, 36, 32, 8, 12288, 151936, 40960, rope_theta=1000000.0,
                           explicit_head_dim=128),
    # Qwen/Qwen3-14B config.json: 40 heads x head_dim 128 = hidden 5120
    "qwen3-14b": ModelShape("qwen3-14b", 5120, 40, 40, 8, 17408, 151936, 40960, rope_theta=1000000.0),
    # mistralai/Mistral-Small-24B-Instruct-2501 config.json: head_dim 128 with hidden 5120 / 32 heads
    "mistral-small-24b": ModelShape("mistral-small-24b", 5120, 40, 32, 8, 32768, 131072, 32768,
                                    rope_theta=100000000.0, explicit_head_dim=128),
    # Qwen/Qwen3-32B config.json: head_dim 128 with hidden 5120 / 64 heads (q, o: 5120 x 8192)
    "qwen3-32b": ModelShape("qwen3-32b", 5120, 64, 64, 8, 25600, 151936, 40960, rope_theta=1000000.0,
                            explicit_head_dim=128),
    # Qwen/Qwen3-30B-A3B config.json: 128 experts of 768, top 8, every layer sparse
    "qwen3-30b-a3b": ModelShape("qwen3-30b-a3b", 2048, 48, 32, 4, 6144, 151936, 40960, rope_theta=1000000.0,
                                explicit_head_dim=128, num_experts=128, num_experts_per_tok=8,
                                moe_intermediate_size=768),
    # Qwen/Qwen3-235B-A22B config.json: 94 layers, 64 heads, 4 KV heads, 128 experts of 1536, top 8
    "qwen3-235b-a22b": ModelShape("qwen3-235b-a22b", 4096, 94, 64, 4, 12288, 151936, 40960,
                                  rope_theta=1000000.0, explicit_head_dim=128, num_experts=128,
                                  num_experts_per_tok=8, moe_intermediate_size=1536),
    # mistralai/Mixtral-8x7B-v0.1 config.json: 8 experts of intermediate_size 14336, top 2
    "mixtral-8x7b": ModelShape("mixtral-8x7b", 4096, 32, 32, 8, 14336, 32000, 32768, rope_theta=1000000.0,
                               num_experts=8, num_experts_per_tok=2),
    # openai/gpt-oss-120b config.json: head_dim 64, layer_types alternating sliding (window 128) and
    # full attention, 128 experts of 2880, top 4; the checkpoint's experts are mxfp4 (MODEL_PRECISIONS)
    "gpt-oss-120b": ModelShape("gpt-oss-120b", 2880, 36, 64, 8, 2880, 201088, 131072, rope_theta=150000.0,
                               explicit_head_dim=64, sliding_window=128, num_sliding_layers=18,
                               num_experts=128, num_experts_per_tok=4),
    # openai/gpt-oss-20b config.json: as the 120b with 24 layers and 32 experts
    "gpt-oss-20b": ModelShape("gpt-oss-20b", 2880, 24, 64, 8, 2880, 201088, 131072, rope_theta=150000.0,
                              explicit_head_dim=64, sliding_window=128, num_sliding_layers=12,
                              num_experts=32, num_experts_per_tok=4),
    # deepseek-ai/DeepSeek-R1 config.json (DeepSeek-V3's shape): 61 layers, the first 3 dense; multi-head
    # latent attention (128 heads, latent 512 + RoPE key 64, q_lora_rank 1536, nope 128, v 128); 256
    # experts of 2048 + 1 shared, top 8; FP8 block-scaled weights (MODEL_PRECISIONS). The MTP layer
    # (num_nextn_predict_layers 1) is not loaded without speculative decoding: not counted.
    "deepseek-r1": ModelShape("deepseek-r1", 7168, 61, 128, 128, 18432, 129280, 163840, rope_theta=10000.0,
                              num_experts=256, num_experts_per_tok=8, moe_intermediate_size=2048,
                              shared_expert_intermediate_size=2048, num_dense_layers=3, kv_lora_rank=512,
                              q_lora_rank=1536, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, num_mtp_layers=1),
    "deepseek-v3": ModelShape("deepseek-v3", 7168, 61, 128, 128, 18432, 129280, 163840, rope_theta=10000.0,
                              num_experts=256, num_experts_per_tok=8, moe_intermediate_size=2048,
                              shared_expert_intermediate_size=2048, num_dense_layers=3, kv_lora_rank=512,
                              q_lora_rank=1536, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, num_mtp_layers=1),
    # deepseek-ai/DeepSeek-V3.2 config.json: DeepSeek-V3's shape with DeepSeek sparse attention (an indexer
    # of 64 heads of 128, each query attending to its top 2,048 keys); FP8 block-scaled weights
    "deepseek-v3.2": ModelShape("deepseek-v3.2", 7168, 61, 128, 128, 18432, 129280, 163840, rope_theta=10000.0,
                                num_experts=256, num_experts_per_tok=8, moe_intermediate_size=2048,
                                shared_expert_intermediate_size=2048, num_dense_layers=3, kv_lora_rank=512,
                                q_lora_rank=1536, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
                                index_topk=2048, index_head_dim=128, index_n_heads=64, num_mtp_layers=1),
    # zai-org/GLM-5 config.json: 78 layers, the first 3 dense, MLA of 64 heads (nope 192, rope 64, v 256,
    # q_lora_rank 2048) with DeepSeek sparse attention (32 indexer heads of 128, top 2,048), 256 experts of
    # 2048 + 1 shared, top 8; bf16 weights (zai-org/GLM-5-FP8 is the FP8 checkpoint)
    "glm-5": ModelShape("glm-5", 6144, 78, 64, 64, 12288, 154880, 202752, rope_theta=1000000.0, explicit_head_dim=64,
                        num_experts=256, num_experts_per_tok=8, moe_intermediate_size=2048,
                        shared_expert_intermediate_size=2048, num_dense_layers=3, kv_lora_rank=512, q_lora_rank=2048,
                        qk_nope_head_dim=192, qk_rope_head_dim=64, v_head_dim=256, index_topk=2048, index_head_dim=128,
                        index_n_heads=32, num_mtp_layers=1),
    # MiniMaxAI/MiniMax-M2.5 config.json: 62 layers, 48 heads of 128 (8 KV heads), 256 experts of 1536, top 8,
    # no shared expert, every layer sparse; FP8 block-scaled weights (MODEL_PRECISIONS); its MTP modules are
    # not loaded without speculative decoding
    "minimax-m2.5": ModelShape("minimax-m2.5", 3072, 62, 48, 8, 1536, 200064, 196608, rope_theta=5000000.0,
                               explicit_head_dim=128, num_experts=256, num_experts_per_tok=8),
    # Qwen/Qwen3.5-397B-A17B config.json's text_config: 60 layers, 3 Gated DeltaNet (16 key heads, 64 value
    # heads of 128, conv 4, fp32 recurrent state) to 1 gated full attention (32 heads of 256, 2 KV heads),
    # 512 experts of 1024 + a shared one of 1024, top 10, every layer sparse; bf16; the MTP layer
    # (mtp_num_hidden_layers 1) is not loaded without speculative decoding; the vision tower is left out
    "qwen3.5-397b-a17b": ModelShape("qwen3.5-397b-a17b", 4096, 60, 32, 2, 1024, 248320, 262144,
                                    rope_theta=10000000, explicit_head_dim=256, num_experts=512,
                                    num_experts_per_tok=10, moe_intermediate_size=1024,
                                    shared_expert_intermediate_size=1024, attn_output_gate=1, num_linear_layers=45,
                                    linear_num_key_heads=16, linear_num_value_heads=64, linear_key_head_dim=128,
                                    linear_value_head_dim=128, linear_conv_kernel_dim=4, linear_state_bytes=4,
                                    num_mtp_layers=1),
    # nvidia/Nemotron-H-56B-Base-8K config.json: 118 single-block layers (hybrid_override_pattern): 54 Mamba2
    # (256 heads of 64, 8 groups, state 256, conv 4, chunk 128; fp32 SSM state, vLLM's default for
    # Nemotron-H), 10 attention (64 heads of 128, 8 KV heads), 54 MLPs of 32768 (relu2: up and down); bf16
    "nemotron-h-56b": ModelShape("nemotron-h-56b", 8192, 118, 64, 8, 32768, 131072, 8192, mlp="gelu",
                                 num_ffn_layers=54, num_mamba_layers=54, mamba_num_heads=256, mamba_head_dim=64,
                                 mamba_n_groups=8, mamba_state_size=256, mamba_conv_kernel=4, mamba_chunk_size=128,
                                 mamba_state_bytes=4),
    # nvidia/NVIDIA-Nemotron-3-Nano-30B-A3B-BF16 config.json: 52 single-block layers: 23 Mamba2 (64 heads of
    # 64, 8 groups, state 128, conv 4, chunk 128, mamba_ssm_cache_dtype float32), 6 attention (32 heads of
    # 128, 2 KV heads), 23 MoE (128 experts of 1856, top 6, a shared expert of 3712; relu2); bf16
    "nemotron-3-nano-30b-a3b": ModelShape("nemotron-3-nano-30b-a3b", 2688, 52, 32, 2, 1856, 131072, 262144,
                                          mlp="gelu", explicit_head_dim=128, num_experts=128, num_experts_per_tok=6,
                                          moe_intermediate_size=1856, shared_expert_intermediate_size=3712,
                                          num_ffn_layers=23, num_mamba_layers=23, mamba_num_heads=64,
                                          mamba_head_dim=64, mamba_n_groups=8, mamba_state_size=128,
                                          mamba_conv_kernel=4, mamba_chunk_size=128, mamba_state_bytes=4),
    # moonshotai/Kimi-K2.5 config.json's text_config (DeepSeek-V3's architecture): 64 heads, 384 experts
    # of 2048 + 1 shared, top 8, the first layer dense, vocabulary 163840; INT4 experts (MODEL_PRECISIONS)
    "kimi-k2.5": ModelShape("kimi-k2.5", 7168, 61, 64, 64, 18432, 163840, 262144, rope_theta=50000.0,
                            num_experts=384, num_experts_per_tok=8, moe_intermediate_size=2048,
                            shared_expert_intermediate_size=2048, num_dense_layers=1, kv_lora_rank=512,
                            q_lora_rank=1536, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128),
}

# The weight format a preset's public checkpoint ships in, when not its activation dtype:
# (weight_dtype, which weights: sim.cost.precision.QUANTIZED_SCOPES). A profile's weight_dtype
# overrides it.
MODEL_PRECISIONS: dict[str, tuple[str, str]] = {
    "gpt-oss-120b": ("mxfp4", "experts"),      # quantization_config: quant_method mxfp4, experts only
    "gpt-oss-20b": ("mxfp4", "experts"),
    "deepseek-r1": ("fp8", "linear"),          # quant_method fp8, 128 x 128 block scales
    "deepseek-v3": ("fp8", "linear"),
    "deepseek-v3.2": ("fp8", "linear"),
    "minimax-m2.5": ("fp8", "linear"),         # quant_method fp8; gate, its bias and lm_head not converted
    "kimi-k2.5": ("int4", "experts"),          # compressed-tensors INT4 (group 32), the routed experts only
}

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


SERVING_ERRORS_PATH = (Path(__file__).resolve().parents[2] / "calibrate" / "profiles" / "public_serving"
                       / "preset_errors.csv")


@lru_cache(maxsize=4)
def _serving_error_table(path: str) -> dict[tuple[str, str, int], dict[str, Any]]:
    p = Path(path)
    if not p.is_file():
        return {}
    out: dict[tuple[str, str, int], dict[str, Any]] = {}
    with p.open(newline="") as f:
        for row in csv.DictReader(f):
            e: dict[str, Any] = {k: ((float(v) if v else None) if "_pct" in k else v) for k, v in row.items()}
            for k in ("tensor_parallel", "num_held_out", "num_all"):
                e[k] = int(row[k])
            out[(e["gpu"], e["weight_dtype"], e["tensor_parallel"])] = e
    return out


def serving_error(gpu: str, weight_dtype: str, tp: int, path: str | Path | None = None) -> dict[str, Any] | None:
    """The TTFT and TPOT error of the analytic preset on ``gpu`` with ``weight_dtype`` weights
    (bf16, fp16, fp8, mxfp4, nvfp4) at TP ``tp`` against public vLLM >= 0.10 serving runs
    (``calibrate/profiles/public_serving/``), or None where none was checked.

    Keys: gpu, weight_dtype, tensor_parallel, engine, held_out (the rule), num_held_out,
    ttft_mae_pct, ttft_bias_pct, tpot_mae_pct, tpot_bias_pct on the held-out models' rows
    (None without any), num_all, ttft_mae_pct_all and tpot_mae_pct_all over every row, source."""
    table = _serving_error_table(str(path or SERVING_ERRORS_PATH))
    return table.get((str(gpu).lower(), str(weight_dtype).lower(), int(tp)))


KERNEL_ERRORS_PATH = SERVING_ERRORS_PATH.with_name("kernel_errors.csv")


@lru_cache(maxsize=4)
def _kernel_error_table(path: str) -> dict[tuple[str, str, str, int], dict[str, Any]]:
    p = Path(path)
    if not p.is_file():
        return {}
    out: dict[tuple[str, str, str, int], dict[str, Any]] = {}
    with p.open(newline="") as f:
        for row in csv.DictReader(f):
            e: dict[str, Any] = {k: ((float(v) if v else None) if "_pct" in k else v) for k, v in row.items()}
            for k in ("tensor_parallel", "num_held_out", "num_all"):
                e[k] = int(row[k])
            out[(e["engine"], e["gpu"], e["weight_dtype"], e["tensor_parallel"])] = e
    return out


def kernel_serving_error(engine: str, gpu: str, weight_dtype: str, tp: int,
                         path: str | Path | None = None) -> dict[str, Any] | None:
    """``serving_error`` for kernel profiles of ``engine``'s tables (vllm, sglang, trtllm):
    their TTFT and TPOT error against the public serving runs of that engine
    (``benchmarks/bench_kernels_public.py --write-errors``), or None where none was checked."""
    table = _kernel_error_table(str(path or KERNEL_ERRORS_PATH))
    return table.get((str(engine).lower(), str(gpu).lower(), str(weight_dtype).lower(), int(tp)))

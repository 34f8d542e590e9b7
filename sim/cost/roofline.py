"""Analytic step-cost profiles: a roofline model of one (model, GPU, TP, dtype).

Every curve of ``sim.cost.profile.Profile`` is a roofline of a compute time c and a
memory time m, where the rates are the GPU's datasheet peaks times *achieved*
fractions (``Efficiency``). Far from the ridge point the time is max(c, m); near
it both limits are partly active and the time is the smooth maximum of a
load -> math pipeline with S tile buffers (``overlap_time``; S =
``Efficiency.pipeline_stages``), up to (S + 1) / S x max(c, m) at c = m.
``Roofline`` holds the direct formulas;
``analytic_profile`` samples them on grids that are refined until the profile's
piecewise-linear interpolation stays within ``GRID_TOLERANCE`` of the formula.
All counts are per GPU: tensor parallelism t splits heads, KV heads, MLP
columns and weights t ways; what it does not shrink (collectives, the
per-layer kernel floor, the engine's host work) is ``sim.cost.collectives``'.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np

from sim.cost.collectives import DEFAULT_ENGINE, ENGINES, EngineOverhead, TpStepCosts
from sim.cost.curves import Curve1D, Curve2D
from sim.cost.efficiency import MATMUL_FLOPS_FIT, Efficiency  # noqa: F401 (re-exported)
from sim.cost.moe import linear_split
from sim.cost.moe import weight_bytes as moe_weight_bytes
from sim.cost.presets import GPU_PRESETS, MODEL_PRECISIONS, MODEL_PRESETS, GpuSpec, model_shape_from_hf
from sim.cost.precision import Precision, precision_from_hf
from sim.cost.profile import FORMAT_VERSION, GIB, ModelShape, Profile

DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}
# Logits are computed only for the positions that get sampled (the last token of
# each sequence in the step), and a step rarely samples more than a few hundred
# sequences; linear() only sees a token count, so it charges the LM head for
# min(tokens, MAX_SAMPLED_ROWS) rows.
MAX_SAMPLED_ROWS = 256
GDN_CHUNK = 64                     # the chunked gated delta rule's chunk (flash-linear-attention's kernels)
# (Mamba2's scan chunk is the config's chunk_size: ModelShape.mamba_chunk_size)
CUDA_CONTEXT_BYTES = GIB // 2       # CUDA context, cuBLAS workspace, captured CUDA graphs
GRID_TOLERANCE = 0.01               # max relative interpolation error at the probe points
_PROBES = np.array([0.1, 0.3, 0.5, 0.7, 0.9])   # where inside a grid interval error is checked
_MAX_REFINE_ROUNDS = 12

LINEAR_TOKENS = [1, 2, 4, 8, 16, 32, 64, 96, 128, 192, 256, 384, 512, 768, 1024, 1536,
                 2048, 3072, 4096, 6144, 8192, 16384, 32768, 65536]
PREFILL_CHUNK = [2**k for k in range(16)]                 # 1 .. 32768
PREFILL_CONTEXT = [0] + [2**k for k in range(7, 18)]      # 0, 128 .. 131072
DECODE_SEQS = [2**k for k in range(11)]                   # 1 .. 1024
MIN_DECODE_CONTEXT_MAX = 2**22                            # 4M tokens over all decodes


def overlap_time(compute_s: Any, memory_s: Any, stages: float) -> Any:
    """Time of a kernel whose memory traffic (m) feeds its math (c) through ``stages``
    tile buffers: (c^(S+1) - m^(S+1)) / (c^S - m^S), max(c, m) when S is inf.

    The two stages of the pipeline are a tandem line with S buffers between them and
    memoryless tile times: with r = c / m the fraction of time the math runs is
    (r - r^(S+1)) / (1 - r^(S+1)). Written as max(c, m) x sum_{i<=S} q^i / sum_{i<S} q^i,
    q = min / max, it is exact at c = m ((S+1)/S x c) and tends to max(c, m) as
    q -> 0; S = 1 (no overlap) gives c + m. Scalars or numpy arrays.
    """
    c = np.asarray(compute_s, dtype=float)
    m = np.asarray(memory_s, dtype=float)
    hi = np.maximum(c, m)
    if math.isinf(stages):
        return hi
    q = np.minimum(c, m) / np.where(hi > 0, hi, 1.0)
    num, den, power = np.ones_like(q), np.ones_like(q), np.ones_like(q)
    for _ in range(int(stages) - 1):
        power = power * q
        num = num + power
        den = den + power
    return hi * (num + power * q) / den


def sliding_prefill_pairs(chunk: Any, context: Any, window: float) -> Any:
    """(query, key) pairs of a causal chunk on a sliding layer: query i sees
    min(context + i + 1, window) keys. With k = clip(window - context, 0, chunk) queries
    still inside the first window: k (2 context + k + 1) / 2 + (chunk - k) window."""
    c = np.asarray(chunk, dtype=float)
    p = np.asarray(context, dtype=float)
    inside = np.clip(window - p, 0.0, c)
    return inside * (2 * p + inside + 1) / 2 + (c - inside) * window


class Roofline:
    """Direct cost formulas (seconds, per step) for one configuration.

    Methods take scalars or numpy arrays (broadcast together) and return the same.
    ``precision`` (sim.cost.precision) overrides ``dtype`` when given: weight and KV
    formats beside the activation dtype. ``expert_parallel``: MoE experts placed whole,
    E / t per GPU, with all-to-all dispatch and combine (sim.cost.moe, sim.cost.collectives).
    """

    def __init__(self, model: ModelShape, gpu: GpuSpec, tensor_parallel: int = 1,
                 dtype: str = "bf16", efficiency: Efficiency | None = None, *,
                 precision: Precision | None = None, expert_parallel: bool = False,
                 data_parallel: int = 1) -> None:
        if precision is None:
            if dtype not in DTYPE_BYTES:
                raise ValueError(f"dtype {dtype!r} is not supported; use one of {sorted(DTYPE_BYTES)}")
            precision = Precision(dtype=dtype)
        dtype = precision.dtype
        t = tensor_parallel
        if isinstance(t, bool) or not isinstance(t, int) or t < 1:
            raise ValueError(f"tensor_parallel must be an integer >= 1, got {t!r}")
        if expert_parallel and not model.is_moe:
            raise ValueError(f"expert parallelism needs a mixture-of-experts model; {model.name} has no experts")
        d = data_parallel
        if isinstance(d, bool) or not isinstance(d, int) or d < 1:
            raise ValueError(f"data_parallel must be an integer >= 1, got {d!r}")
        if t > model.num_heads:
            # (before the KV heads are replicated up to t below, which would report a count of the
            # replication's making, "num_heads 32 is not divisible by num_kv_heads 64")
            raise ValueError(f"tensor_parallel={t} is more than {model.name}'s {model.num_heads} attention heads "
                             f"(num_heads): tensor parallelism splits the heads across the GPUs; pick a divisor "
                             f"of {model.num_heads}")
        if not model.is_mla and model.num_kv_heads < t and t % model.num_kv_heads == 0:
            # NOTE: vLLM replicates KV heads when TP exceeds them (QKVParallelLinear's
            # num_kv_head_replicas): every GPU holds one head's K and V weights and cache, so
            # t heads in all, t / num_kv_heads copies of each.
            model = dataclasses.replace(model, num_kv_heads=t)
        splits = [("num_heads", model.num_heads)] + ([] if model.is_mla else [("num_kv_heads", model.num_kv_heads)])
        if model.num_dense_mlp_layers:
            splits.append(("intermediate_size", model.intermediate_size))
        if model.is_mamba:         # heads and B/C groups split across the ranks (MambaMixer2)
            splits += [("mamba_num_heads", model.mamba_num_heads), ("mamba_n_groups", model.mamba_n_groups)]
        if model.is_moe:
            if model.shared_expert_intermediate_size:
                splits.append(("shared_expert_intermediate_size", model.shared_expert_intermediate_size))
        for what, count in splits:
            if count % t:
                raise ValueError(f"tensor_parallel={t} does not divide {model.name}'s "
                                 f"{what} ({count}); pick a divisor of it")
        if model.is_moe:           # the experts spread over every GPU of the data-parallel group
            what, count = (("num_experts", model.num_experts) if expert_parallel
                           else ("moe_intermediate_size", model.expert_intermediate_size))
            if count % (t * d):
                ways = f"tensor_parallel={t}" if d == 1 else f"tensor_parallel={t} x data_parallel_size={d}"
                raise ValueError(f"{ways} does not divide {model.name}'s {what} ({count}); pick a divisor of it")
        self.model, self.gpu, self.tensor_parallel, self.dtype = model, gpu, t, dtype
        self.precision, self.expert_parallel, self.data_parallel = precision, expert_parallel, d
        self.eff = eff = efficiency or Efficiency.for_gpu(gpu, moe=model.is_moe)
        self.dtype_bytes = db = DTYPE_BYTES[dtype]
        h, n_layers, inter = model.hidden_size, model.num_layers, model.intermediate_size
        q_dim, kv_dim = model.num_heads * model.head_dim, model.num_kv_heads * model.head_dim
        if model.is_mla:
            # the activations' widths: the query heads (nope + rope), the latent and the values
            q_dim = model.num_heads * (model.qk_nope_head_dim + model.qk_rope_head_dim)
            kv_dim = model.mla_latent_dim * t / 2 + model.num_heads * model.v_head_dim / 2
        n_mlp_mats = model.num_mlp_matrices
        # fp32 runs at the plain FP32 rate: vLLM leaves PyTorch's float32 matmul precision at
        # "highest" (no TF32 tensor cores), 1/16 (A100) to 1/4 (L40S) of the BF16 rate.
        peak_flops = gpu.peak_flops_fp32 if dtype == "fp32" else gpu.peak_flops_bf16
        self._s_per_matmul_flop = 1.0 / (peak_flops * eff.matmul_flops)
        self._s_per_weight_byte = 1.0 / (gpu.mem_bandwidth_bytes_s * eff.mem_bw)
        self._s_per_attn_flop = 1.0 / (peak_flops * eff.attn_flops)
        self._s_per_decode_attn_flop = 1.0 / (peak_flops * eff.attn_decode_flops)
        self._s_per_kv_byte = 1.0 / (gpu.mem_bandwidth_bytes_s * eff.attn_mem_bw)
        # A dense model in its activation dtype takes the one-class formula (every weight read
        # once, all GEMMs at one rate); quantized weights or routed experts take sim.cost.moe's split.
        self._one_class = not model.is_moe and not precision.is_quantized
        # Matmul weights of all layers (q, o: h x heads*head_dim; k, v: h x kv_dim; MLP) and the LM head, per GPU.
        # MLA: q_a and kv_a are whole on every rank (ModelShape.attn_replicated_params_per_layer).
        repl = model.attn_replicated_params_per_layer
        attn_params = (model.attn_params_per_layer - repl) / t + repl
        n_attn = model.num_attention_layers
        self._layer_params = (n_attn * attn_params + model.num_linear_layers * model.linear_params_per_layer / t
                              + model.num_mamba_layers * model.mamba_params_per_layer / t
                              + model.num_mlp_layers * n_mlp_mats * h * inter / t)
        self._replicated_params = n_layers * repl * (t - 1)    # the copies beyond one, all ranks
        self._lm_head_params = h * model.vocab_size / t
        gemm = precision.gemm_precision(gpu)
        gemm_peak = {"fp8": gpu.peak_flops_fp8, "fp4": gpu.peak_flops_fp4}.get(gemm, peak_flops)
        self.gemm_precision = gemm
        self._s_per_quant_flop = 1.0 / (gemm_peak * eff.matmul_fraction(gemm))
        self._split = linear_split(model, precision, t, expert_parallel, d)
        self._quant_bytes = precision.weight_bytes_per_param
        # Activation traffic per token, all layers, in elements: ~14 hidden-sized reads and
        # writes (2 norms in/out, residual adds, projection inputs and outputs), the sharded
        # q/k/v write and attention output read, and the sharded MLP intermediate
        # (gated: gate_up write 2I, act read 2I + write I, down read I = 6I; plain: 4I);
        # an MoE layer's intermediate is its k experts' and the shared experts' widths.
        mlp_elems = 6 if n_mlp_mats == 3 else 4
        act_elems = 14 * h + (2 * q_dim + 2 * kv_dim) / t + mlp_elems * inter / t
        if model.num_ffn_layers:
            self._act_bytes_per_token = self._single_block_act_elems(model, t, mlp_elems, q_dim, kv_dim) * db
        elif model.is_moe:
            moe_width = model.num_experts_per_tok * model.expert_intermediate_size + model.shared_expert_intermediate_size
            moe_elems = 14 * h + (2 * q_dim + 2 * kv_dim) / t + mlp_elems * moe_width / t
            num_dense = n_layers - model.num_moe_layers
            self._act_bytes_per_token = (num_dense * act_elems + model.num_moe_layers * moe_elems) * db
        else:
            self._act_bytes_per_token = n_layers * act_elems * db
        # Collectives, the per-layer kernel floor and the engine's host work: the per-step
        # costs that t does not shrink.
        host = EngineOverhead(eff.engine, eff.overhead_s, eff.tp_overhead_s, eff.per_seq_s, "Efficiency")
        self.tp_costs = TpStepCosts(model, gpu, t, db, host, eff.layer_fixed_s, eff.interconnect,
                                    expert_parallel=expert_parallel, data_parallel=d)
        self.overhead_s = self.tp_costs.fixed_step_s
        known = ENGINES.get(eff.engine)
        self.host_overlapped = known is not None and known.overlapped
        # Attention: QK^T and PV are 2 matmuls of 2 flops per (query, key, head, head_dim),
        # split into the full-attention layers and the sliding-window ones.
        n_sliding = model.num_sliding_layers
        n_full = n_attn - n_sliding
        self._window = model.sliding_window
        self._attn_flops_per_pair = 4 * model.num_heads * model.head_dim * n_full / t
        self._attn_flops_per_pair_sliding = 4 * model.num_heads * model.head_dim * n_sliding / t
        self._decode_flops_per_pair = self._attn_flops_per_pair
        self._context_up_flops = 0.0
        self._topk = 0                      # DSA: the keys a query attends to (0: all)
        kv_db = precision.kv_bytes_per_element
        self.kv_bytes_per_token = model.kv_bytes_per_token(kv_db)
        self.kv_bytes_per_seq = model.kv_bytes_per_seq(kv_db)
        # KV traffic per token of context, per GPU: the full layers' and the sliding layers'.
        self._kv_bytes_per_token_gpu = 2 * n_full * model.num_kv_heads * model.head_dim * kv_db / t
        self._kv_bytes_per_token_gpu_sliding = 2 * n_sliding * model.num_kv_heads * model.head_dim * kv_db / t
        if model.is_mla:
            self._mla_terms(model, t, kv_db, peak_flops)
        self._linear_terms(model, t, db)

    @staticmethod
    def _single_block_act_elems(m: ModelShape, t: int, mlp_elems: int, q_dim: float, kv_dim: float) -> float:
        """Activation traffic a token, in elements, of single-block layers (Nemotron-H): half the
        hidden-sized traffic of a two-block layer (7 hidden a block: its norm, residual and
        projection in and out) and the block's own: an attention block's q/k/v and output, a
        Mamba2 block's in_proj output (2 I + 2 groups x N + heads) written and read and its scan's
        output (I) written and read, an MLP block's intermediate, an MoE block's k experts' and
        shared experts' widths."""
        h = m.hidden_size
        attn = 7 * h + (2 * q_dim + 2 * kv_dim) / t
        mamba = 7 * h + (2 * m.mamba_in_proj_width + 2 * m.mamba_intermediate) / t
        dense = 7 * h + mlp_elems * m.intermediate_size / t
        moe_width = m.num_experts_per_tok * m.expert_intermediate_size + m.shared_expert_intermediate_size
        moe = 7 * h + mlp_elems * moe_width / t
        return (m.num_attention_layers * attn + m.num_mamba_layers * mamba + m.num_dense_mlp_layers * dense
                + m.num_moe_layers * moe)

    def _linear_terms(self, m: ModelShape, t: int, db: int) -> None:
        """Gated DeltaNet's layers, per GPU (value heads / t): no KV per token, a state a sequence.

        Prefill runs the chunked gated delta rule (chunks of ``GDN_CHUNK`` tokens): per token and
        value head about 2 (3 key_dim value_dim + 2 GDN_CHUNK (key_dim + value_dim)) FLOPs (the
        state's read-out, the rank-one update and its decay, and the chunk's own triangular
        attention), at the prefill attention rate, and each sequence's state is read and written
        once. Decode runs the fused recurrent update: 2 x 3 key_dim value_dim FLOPs a head, and the
        whole state read and written, so it is memory-bound: 2 x state bytes a sequence and
        layer. The conv window is read and written alike. An estimate from the kernels' work,
        not fitted (the kernel tables measure these ops where a kernel profile is used)."""
        self._linear_state_bytes = 0.0
        if m.is_mamba:
            self._mamba_terms(m, t, db)
            return
        if not m.is_hybrid:
            return
        heads, kd, vd = m.linear_num_value_heads / t, m.linear_key_head_dim, m.linear_value_head_dim
        n = m.num_linear_layers
        conv, ssm = m.linear_state_bytes_per_seq(db, t)
        self._linear_state_bytes = float(n * (conv + ssm))       # one sequence's, this GPU's layers
        self._linear_prefill_flops = n * heads * 2 * (3 * kd * vd + 2 * GDN_CHUNK * (kd + vd))
        self._linear_decode_flops = n * heads * 2 * 3 * kd * vd

    def _mamba_terms(self, m: ModelShape, t: int, db: int) -> None:
        """Mamba2's layers, per GPU (heads and groups / t): no KV per token, a state a sequence.

        Prefill runs the chunked SSD scan (vLLM's mamba_chunk_scan_combined_varlen, chunks of Q =
        ``mamba_chunk_size``; vllm/model_executor/layers/mamba/ops/ssd_combined.py): per token,
        each head builds its chunk's state (B^T x: 2 N P FLOPs), reads the earlier chunks' state out
        (C h: 2 N P) and mixes its chunk (the masked C B^T times x: 2 Q P), and each group forms
        C B^T (2 Q N): heads (4 N P + 2 Q P) + groups 2 Q N, for N the state size and P the head
        dim; the causal conv1d adds 2 conv_dim x kernel; all at the prefill attention rate, and each
        sequence's state (conv window and SSM state) is read and written once. Decode runs
        selective_state_update: the state decayed, updated by B x and read out by C (2 x 3 N P
        FLOPs a head) and the conv window shifted (2 conv_dim x kernel), reading and writing the
        whole state, so memory-bound: 2 x state bytes a sequence and layer. An estimate from the
        kernels' work, not fitted."""
        n, heads, groups = m.num_mamba_layers, m.mamba_num_heads / t, m.mamba_n_groups / t
        p, ns, q, k = m.mamba_head_dim, m.mamba_state_size, m.mamba_chunk_size, m.mamba_conv_kernel
        conv, ssm = m.mamba_state_bytes_per_seq(db, t)
        conv_flops = 2 * m.mamba_conv_dim / t * k
        self._linear_state_bytes = float(n * (conv + ssm))
        self._linear_prefill_flops = n * (heads * (4 * ns * p + 2 * q * p) + groups * 2 * q * ns + conv_flops)
        self._linear_decode_flops = n * (heads * 2 * 3 * ns * p + conv_flops)

    def _mla_terms(self, m: ModelShape, t: int, kv_db: float, peak_flops: float) -> None:
        """Multi-head latent attention as vLLM's MLA backends run it, per GPU (H / t heads).

        The cache holds one latent + RoPE key a token and layer on every rank (not split by
        heads), so each GPU reads all of it: the pool counts t copies (``kv_bytes_per_token``).
        Prefill runs the un-absorbed form: the chunk's own keys and values come from kv_b in
        ``linear_s`` (its weights are among the attention parameters); the ``context`` earlier
        tokens' latents are up-projected again through kv_b (2 kv_lora_rank (nope + v) FLOPs
        a head and token: vLLM's chunked-context prefill), then attention with query/key heads
        of nope + rope and value heads of v: 2 (nope + rope + v) FLOPs a head and pair. Decode
        runs the absorbed form: each head's query is mapped into the latent (W_UK) and its
        output back (W_UV), the same FLOPs as kv_b's and counted there, and attends over the
        latent and RoPE key (scores: kv_lora_rank + rope; values: kv_lora_rank): 2 (2
        kv_lora_rank + rope) FLOPs a head and pair, over latent bytes it reads whole."""
        heads = m.num_heads / t
        layers = m.num_layers
        self.kv_bytes_per_token = m.kv_bytes_per_token(kv_db) * t     # one copy on each rank
        self._kv_bytes_per_token_gpu = layers * (m.mla_bytes_per_token_layer(int(kv_db)) - m.index_bytes_per_token_layer)
        self._kv_bytes_per_token_gpu_sliding = 0.0
        self._attn_flops_per_pair = 2 * heads * (m.qk_nope_head_dim + m.qk_rope_head_dim + m.v_head_dim) * layers
        self._decode_flops_per_pair = 2 * heads * (2 * m.kv_lora_rank + m.qk_rope_head_dim) * layers
        self._context_up_flops = 2 * heads * m.kv_lora_rank * (m.qk_nope_head_dim + m.v_head_dim) * layers
        # NOTE: MLA's decode kernels (FlashMLA, FlashInfer's and CUTLASS's MLA) run on tensor cores:
        # a token's heads share one latent, so the absorbed decode is a (heads x latent) GEMM, not
        # the per-head CUDA-core loop ATTN_DECODE_FLOPS was fitted on. It takes the prefill
        # attention rate (Efficiency.attn_flops): an assumption, not fitted.
        self._s_per_decode_attn_flop = self._s_per_attn_flop
        if m.is_dsa:
            # DeepSeek sparse attention: vLLM's sparse MLA kernels run the absorbed form in prefill
            # too (no chunked-context expansion), each query over its index_topk keys only; the
            # indexer scores every (query, key) pair with its heads (2 index_n_heads x index_head_dim
            # FLOPs, the same on every rank: its weights are replicated) over its own cached keys.
            # Its logits are FP8 GEMMs (DeepGEMM's MQA logits): the FP8 peak where the GPU has it,
            # at the prefill attention's efficiency (an assumption, not fitted).
            self._topk = m.index_topk
            self._s_per_index_flop = 1.0 / ((self.gpu.peak_flops_fp8 or peak_flops) * self.eff.attn_flops)
            self._attn_flops_per_pair = self._decode_flops_per_pair
            self._context_up_flops = 0.0
            self._index_flops_per_pair = 2 * m.index_n_heads * m.index_head_dim * layers
            self._index_bytes_per_token_gpu = layers * m.index_bytes_per_token_layer

    # ---- step-cost terms -------------------------------------------------------
    @property
    def splits_moe(self) -> bool:
        """Data-parallel MoE ranks: ``linear_s`` leaves the routed experts to ``moe_s`` (the experts
        meet every rank's tokens, the rest runs on a rank's own: sim.loop.dp)."""
        return self.data_parallel > 1 and self.model.is_moe

    def moe_s(self, num_tokens: Any) -> Any:
        """The routed experts of every MoE layer when each data-parallel rank runs ``num_tokens``
        tokens: their FLOPs (2 n k P_e / t a GPU), the distinct local experts they touch read
        once, and the layers' gathers across the ranks (0 without ``splits_moe``)."""
        tokens = np.asarray(num_tokens, dtype=float)
        if not self.splits_moe:
            return np.zeros_like(tokens)
        sp = self._split
        rate = self._s_per_quant_flop if sp.experts_quantized else self._s_per_matmul_flop
        compute_s = 2 * tokens * sp.expert_token_params * rate
        experts = sp.expected_local_experts(tokens)
        weight_bytes = experts * (sp.expert_params_hi * self.dtype_bytes + sp.expert_params_q * self._quant_bytes)
        time_s = overlap_time(compute_s, weight_bytes * self._s_per_weight_byte, self.eff.pipeline_stages)
        return time_s + self.tp_costs.dp_comm_s(tokens)

    def linear_s(self, num_tokens: Any) -> Any:
        """QKV/O, MLP (or router, experts and shared experts), norms and LM head for
        ``num_tokens`` tokens, plus TP collectives and the per-layer kernel floor (the routed
        experts apart for data-parallel MoE ranks: ``moe_s``)."""
        tokens = np.asarray(num_tokens, dtype=float)
        if self._one_class:
            flops = 2 * tokens * self._layer_params + 2 * np.minimum(tokens, MAX_SAMPLED_ROWS) * self._lm_head_params
            weight_bytes = (self._layer_params + self._lm_head_params) * self.dtype_bytes
            compute_s = flops * self._s_per_matmul_flop
        else:
            sp, db = self._split, self.dtype_bytes
            hi, q = sp.token_params_hi, sp.token_params_q
            experts = sp.expected_local_experts(tokens)        # distinct experts touched, per GPU, per MoE layer
            expert_hi, expert_q = sp.expert_params_hi, sp.expert_params_q
            if self.splits_moe:                                # the routed experts are moe_s's
                hi, q = (hi, q - sp.expert_token_params) if sp.experts_quantized else (hi - sp.expert_token_params, q)
                expert_hi = expert_q = 0.0
            flops_hi = 2 * tokens * hi + 2 * np.minimum(tokens, MAX_SAMPLED_ROWS) * self._lm_head_params
            flops_q = 2 * tokens * q
            compute_s = flops_hi * self._s_per_matmul_flop + flops_q * self._s_per_quant_flop
            weight_bytes = ((sp.static_params_hi + self._lm_head_params + experts * expert_hi) * db
                            + (sp.static_params_q + experts * expert_q) * self._quant_bytes)
        mem_bytes = weight_bytes + tokens * self._act_bytes_per_token
        time_s = overlap_time(compute_s, mem_bytes * self._s_per_weight_byte, self.eff.pipeline_stages)
        comm = self.tp_costs.comm_s(tokens) - (self.tp_costs.dp_comm_s(tokens) if self.splits_moe else 0.0)
        return time_s + comm + self.tp_costs.layers_fixed_s

    def attn_prefill_s(self, chunk: Any, context: Any) -> Any:
        """Causal attention of a ``chunk`` of new tokens over ``context`` earlier ones.

        Query i (0-based) of the chunk sees context + i + 1 keys, so the chunk
        makes chunk * (context + (chunk + 1) / 2) (query, key) pairs. On a sliding
        layer of window w it sees min(context + i + 1, w): with k = clip(w - context,
        0, chunk) queries still inside the first window, k (2 context + k + 1) / 2
        + (chunk - k) w pairs; its KV reads are min(context, w) + chunk tokens.
        """
        c = np.asarray(chunk, dtype=float)
        p = np.asarray(context, dtype=float)
        if self._topk:
            return self._sparse_prefill_s(c, p)
        flops = self._attn_flops_per_pair * c * (p + (c + 1) / 2) + self._context_up_flops * p * (c > 0)
        kv_bytes = (p + 2 * c) * self._kv_bytes_per_token_gpu     # read p + c, write c
        if self._window:
            w = float(self._window)
            flops = flops + self._attn_flops_per_pair_sliding * sliding_prefill_pairs(c, p, w)
            kv_bytes = kv_bytes + (np.minimum(p, w) + 2 * c) * self._kv_bytes_per_token_gpu_sliding
        if self._linear_state_bytes:
            flops = flops + self._linear_prefill_flops * c
            kv_bytes = kv_bytes + 2 * self._linear_state_bytes * (c > 0)
        time_s = overlap_time(flops * self._s_per_attn_flop, kv_bytes * self._s_per_kv_byte, self.eff.pipeline_stages)
        return time_s + self.tp_costs.per_seq_s

    def attn_decode_s(self, num_seqs: Any, context: Any) -> Any:
        """``num_seqs`` single-token decodes over ``context`` KV tokens in total.

        A sliding layer reads min(context + num_seqs, num_seqs x window) keys: exact when
        the decodes' contexts are equal, an upper bound otherwise (the sum of min(x_i, w)
        is at most min(sum x_i, n w)); the curve only sees the total."""
        n = np.asarray(num_seqs, dtype=float)
        keys = np.asarray(context, dtype=float) + n                # each also sees its new token
        if self._topk:
            # the indexer reads every key; attention only the top k of each decode: min(keys, n k),
            # exact for equal contexts and an upper bound otherwise (as a sliding window's)
            chosen = np.minimum(keys, n * float(self._topk))
            compute_s = (self._index_flops_per_pair * keys * self._s_per_index_flop
                         + self._decode_flops_per_pair * chosen * self._s_per_decode_attn_flop)
            kv_bytes = keys * self._index_bytes_per_token_gpu + chosen * self._kv_bytes_per_token_gpu
            time_s = overlap_time(compute_s, kv_bytes * self._s_per_kv_byte, self.eff.pipeline_stages)
            return time_s + n * self.tp_costs.per_seq_s
        flops = self._decode_flops_per_pair * keys
        kv_bytes = keys * self._kv_bytes_per_token_gpu
        if self._window:
            sliding_keys = np.minimum(keys, n * float(self._window))
            flops = flops + self._attn_flops_per_pair_sliding * sliding_keys
            kv_bytes = kv_bytes + sliding_keys * self._kv_bytes_per_token_gpu_sliding
        if self._linear_state_bytes:
            flops = flops + self._linear_decode_flops * n
            kv_bytes = kv_bytes + 2 * self._linear_state_bytes * n
        time_s = overlap_time(flops * self._s_per_decode_attn_flop, kv_bytes * self._s_per_kv_byte,
                              self.eff.pipeline_stages)
        return time_s + n * self.tp_costs.per_seq_s

    def _sparse_prefill_s(self, c: np.ndarray, p: np.ndarray) -> Any:
        """DSA's prefill: the indexer over all c (p + (c + 1) / 2) pairs and its keys (read p + c,
        write c), attention over each query's min(p + i + 1, topk) keys (the sliding-window count
        with a window of topk) and their latents (read min(p, topk) + c, write c)."""
        k = float(self._topk)
        pairs = c * (p + (c + 1) / 2)
        chosen = sliding_prefill_pairs(c, p, k)
        compute_s = (self._index_flops_per_pair * pairs * self._s_per_index_flop
                     + self._attn_flops_per_pair * chosen * self._s_per_attn_flop)
        kv_bytes = ((p + 2 * c) * self._index_bytes_per_token_gpu
                    + (np.minimum(p, k) + 2 * c) * self._kv_bytes_per_token_gpu)
        time_s = overlap_time(compute_s, kv_bytes * self._s_per_kv_byte, self.eff.pipeline_stages)
        return time_s + self.tp_costs.per_seq_s

    # ---- memory -----------------------------------------------------------------
    @property
    def weight_bytes(self) -> int:
        """All ranks together (sim.cost.moe.weight_bytes: quantized weights at their format's bytes);
        with data parallelism, one data-parallel rank's t GPUs: every weight but the experts, and
        1 / data_parallel of the experts."""
        p = self.precision
        replicated = self._replicated_params * (p.weight_bytes_per_param
                                                if p.is_quantized and p.quantized == "linear" else self.dtype_bytes)
        if self._one_class:
            return int(self.model.num_params * self.dtype_bytes + replicated)
        total = moe_weight_bytes(self.model, p) + replicated
        if self.data_parallel > 1:
            per_param = p.weight_bytes_per_param if p.is_quantized else self.dtype_bytes
            total -= self.model.num_expert_params * per_param * (1 - 1 / self.data_parallel)
        return int(round(total))

    def activation_bytes_per_gpu(self, max_num_batched_tokens: int) -> int:
        """Peak activation memory of one forward pass, per GPU (an estimate).

        The largest live tensors are the MLP intermediate (gate and up, 2I/t per
        token; an MoE layer's k experts' and shared experts' widths in place of I)
        next to a few hidden-sized buffers (residual, normed input, attention
        output, 4h per token); plus fp32 logits of up to MAX_SAMPLED_ROWS sampled
        rows over the full vocabulary (gathered on one rank), plus CUDA context,
        workspace and CUDA graphs.
        """
        m, t = self.model, self.tensor_parallel
        width = m.intermediate_size
        if m.is_moe:
            moe_width = m.num_experts_per_tok * m.expert_intermediate_size + m.shared_expert_intermediate_size
            width = max(moe_width, width if m.num_dense_mlp_layers else 0)
        if m.is_mamba:             # Mamba2's in_proj output (z, x, B, C, dt) may be the widest
            width = max(width, m.mamba_in_proj_width / 2)
        per_token = (2 * width / t + 4 * m.hidden_size) * self.dtype_bytes
        logits = MAX_SAMPLED_ROWS * m.vocab_size * 4
        return int(max_num_batched_tokens * per_token + logits + CUDA_CONTEXT_BYTES)


# ---- grids ----------------------------------------------------------------------
def _rel_err(approx: np.ndarray, exact: np.ndarray) -> np.ndarray:
    return np.abs(approx - exact) / np.maximum(exact, 1e-15)


def _split(x0: np.ndarray, x1: np.ndarray) -> np.ndarray:
    """A new grid point inside each interval: the geometric middle (arithmetic from 0),
    rounded to an integer when that stays strictly inside."""
    mid = np.where(x0 > 0, np.sqrt(x0 * np.maximum(x1, 0)), (x0 + x1) / 2)
    return np.where((np.round(mid) > x0) & (np.round(mid) < x1), np.round(mid), mid)


def _refine_1d(f: Any, xs: list[float], tol: float) -> tuple[np.ndarray, float]:
    """Bisect intervals until linear interpolation of f is within tol at the probes."""
    x = np.asarray(xs, dtype=float)
    err = np.zeros(0)
    for _ in range(_MAX_REFINE_ROUNDS):
        y = f(x)
        probe_x = x[:-1, None] + (x[1:] - x[:-1])[:, None] * _PROBES
        approx = y[:-1, None] + (y[1:] - y[:-1])[:, None] * _PROBES
        err = _rel_err(approx, f(probe_x)).max(axis=1)
        bad = err > tol
        if not bad.any():
            break
        x = np.union1d(x, _split(x[:-1][bad], x[1:][bad]))
    return x, float(err.max())


def _refine_2d(f: Any, xs: list[float], ys: list[float],
               tol: float) -> tuple[np.ndarray, np.ndarray, float]:
    """Refine a tensor grid until bilinear interpolation of f(x, y) is within tol at
    the probes of every cell. A failing cell splits the axis along which the 1-D
    interpolation is worse (both when the two are comparable)."""
    x, y = np.asarray(xs, dtype=float), np.asarray(ys, dtype=float)
    u = _PROBES
    tx, ty = u[None, None, :, None], u[None, None, None, :]
    err = np.zeros((0, 0))
    for _ in range(_MAX_REFINE_ROUNDS):
        px = (x[:-1, None] + (x[1:] - x[:-1])[:, None] * u)[:, None, :, None]
        py = (y[:-1, None] + (y[1:] - y[:-1])[:, None] * u)[None, :, None, :]
        z = f(x[:, None], y[None, :])[:, :, None, None]
        z00, z10, z01, z11 = z[:-1, :-1], z[1:, :-1], z[:-1, 1:], z[1:, 1:]
        exact = f(px, py)
        approx = (z00 * (1 - tx) + z10 * tx) * (1 - ty) + (z01 * (1 - tx) + z11 * tx) * ty
        err = _rel_err(approx, exact).max(axis=(2, 3))
        bad = err > tol
        if not bad.any():
            break
        x0, x1 = x[:-1, None, None, None], x[1:, None, None, None]
        y0, y1 = y[None, :-1, None, None], y[None, 1:, None, None]
        err_x = _rel_err(f(x0, py) * (1 - tx) + f(x1, py) * tx, exact).max(axis=(2, 3))
        err_y = _rel_err(f(px, y0) * (1 - ty) + f(px, y1) * ty, exact).max(axis=(2, 3))
        split_x = (bad & (err_x >= 0.5 * err_y)).any(axis=1)
        split_y = (bad & (err_y >= 0.5 * err_x)).any(axis=0)
        x = np.union1d(x, _split(x[:-1][split_x], x[1:][split_x]))
        y = np.union1d(y, _split(y[:-1][split_y], y[1:][split_y]))
    return x, y, float(err.max())


# ---- profiles -------------------------------------------------------------------
def analytic_profile(model: ModelShape, gpu: GpuSpec, tensor_parallel: int = 1,
                     dtype: str = "bf16", efficiency: Efficiency | None = None, *,
                     precision: Precision | None = None, expert_parallel: bool = False,
                     data_parallel: int = 1) -> Profile:
    """A ``Profile`` whose curves sample the roofline of ``model`` on ``tensor_parallel``
    GPUs of kind ``gpu``; interpolation stays within ``GRID_TOLERANCE`` (relative)
    of ``Roofline``'s formulas at probe points inside the grids. ``precision``,
    ``expert_parallel`` and ``data_parallel``: as ``Roofline`` takes them (one rank's profile)."""
    rf = Roofline(model, gpu, tensor_parallel, dtype, efficiency, precision=precision,
                  expert_parallel=expert_parallel, data_parallel=data_parallel)
    t, eff, prec = tensor_parallel, rf.eff, rf.precision
    dtype = prec.dtype
    # Formats beside dtype, and EP: in the name, the provenance and the file only when used.
    extra = {**({"weight_dtype": prec.weights} if prec.is_quantized else {}),
             **({"kv_cache_dtype": prec.kv_cache_dtype} if prec.kv_cache_dtype != "auto" else {})}
    label = prec.label() + ("-ep" if expert_parallel else "") + (f"-dp{data_parallel}" if data_parallel > 1 else "")
    notes = {**extra, **({"quantized": prec.quantized, "gemm_precision": rf.gemm_precision} if prec.is_quantized
                         else {}), **({"expert_parallel": True} if expert_parallel else {}),
             **({"data_parallel_size": data_parallel} if data_parallel > 1 else {})}
    # The decode axis must cover the largest pool any token budget leaves (a 1-token budget).
    activation_bytes = rf.activation_bytes_per_gpu(1)
    # The decode-context axis reaches past what the KV cache could ever hold (util 1.0).
    max_kv_tokens = max(0, t * (gpu.memory_bytes - activation_bytes) - rf.weight_bytes) // rf.kv_bytes_per_token
    decode_context_max = max(MIN_DECODE_CONTEXT_MAX, 1 << int(max_kv_tokens).bit_length())
    decode_context = [0] + [2**k for k in range(10, decode_context_max.bit_length())]
    lin_x, lin_err = _refine_1d(rf.linear_s, LINEAR_TOKENS, GRID_TOLERANCE)
    moe = None
    if rf.splits_moe:
        moe_x, moe_err = _refine_1d(rf.moe_s, LINEAR_TOKENS, GRID_TOLERANCE)
        moe = Curve1D(moe_x.tolist(), rf.moe_s(moe_x).tolist(), name="curves.moe")
    pre_c, pre_p, pre_err = _refine_2d(rf.attn_prefill_s, PREFILL_CHUNK, PREFILL_CONTEXT, GRID_TOLERANCE)
    dec_n, dec_c, dec_err = _refine_2d(rf.attn_decode_s, DECODE_SEQS, decode_context, GRID_TOLERANCE)

    def curve2d(xs: np.ndarray, ys: np.ndarray, fn: Any, name: str) -> Curve2D:  # plain floats for YAML
        return Curve2D(xs.tolist(), ys.tolist(), fn(xs[:, None], ys[None, :]).tolist(), name=name)

    return Profile(
        name=f"{model.name}@{gpu.name}-tp{t}-{label}", model=model, device=gpu.name,
        dtype=dtype, tensor_parallel=t, data_parallel_size=data_parallel, memory_bytes_per_gpu=gpu.memory_bytes,
        weight_bytes=rf.weight_bytes, activation_bytes_per_gpu=rf.activation_bytes_per_gpu(0),
        activation_bytes_per_token_per_gpu=rf.activation_bytes_per_gpu(1) - rf.activation_bytes_per_gpu(0),
        kv_bytes_per_token=rf.kv_bytes_per_token, kv_bytes_per_seq=rf.kv_bytes_per_seq, overhead_s=rf.overhead_s,
        # The engine's terms as host work (Profile.host_s), unless they were measured on an async
        # loop: then they are the gap its overlap leaves, on the device's path (EngineOverhead.overlapped).
        **({} if rf.host_overlapped else {"host_step_s": rf.overhead_s, "host_per_seq_s": rf.tp_costs.per_seq_s}),
        linear=Curve1D(lin_x.tolist(), rf.linear_s(lin_x).tolist(), name="curves.linear"), moe=moe,
        attn_prefill=curve2d(pre_c, pre_p, rf.attn_prefill_s, "curves.attn_prefill"),
        attn_decode=curve2d(dec_n, dec_c, rf.attn_decode_s, "curves.attn_decode"),
        provenance={"source": "analytic-roofline", "gpu": gpu.name, "model": model.name,
                    "tensor_parallel": t, "dtype": dtype, "generator": "sim.cost.roofline",
                    "batchsim_format": FORMAT_VERSION,
                    "activations": "fixed + per token x the policy's max_num_batched_tokens "
                                   "(vLLM's profiling run)", **notes},
        fit_error={"method": "grid interpolation of the analytic formula",
                   "max_rel_error_at_probes": {"linear": lin_err, "attn_prefill": pre_err,
                                               "attn_decode": dec_err, **({"moe": moe_err} if moe else {})}},
        efficiency=eff.to_dict(),
        **extra,
    )


def _lookup(table: dict[str, Any], key: str, what: str) -> Any:
    value = table.get(key.lower()) if isinstance(key, str) else None
    if value is None:
        raise ValueError(f"unknown {what} {key!r}; known: {', '.join(sorted(table))}")
    return value


def preset_profile(model: str | dict[str, Any], gpu: str, tensor_parallel: int = 1,
                   dtype: str = "bf16", engine: str = DEFAULT_ENGINE, *, weight_dtype: str | None = None,
                   kv_cache_dtype: str | None = None, expert_parallel: bool = False,
                   efficiency: Efficiency | None = None, data_parallel: int = 1) -> Profile:
    """``analytic_profile`` for a preset model name (or an HF-style config dict of a
    custom model) on a preset GPU, with the host-work terms of ``engine``
    (sim.cost.collectives.ENGINES) and the matmul fractions fitted for the GPU's
    generation (``Efficiency.for_gpu``), or ``efficiency`` as given. ``weight_dtype``
    (default: what the config's ``quantization_config`` states, else ``dtype``) and
    ``kv_cache_dtype`` (default auto): sim.cost.precision. Raises ValueError listing
    the known names."""
    scope = "linear"
    if isinstance(model, dict):
        shape = model_shape_from_hf(model)
        stated, stated_scope = precision_from_hf(model, shape.name)
        weight_dtype = weight_dtype or stated
        # The checkpoint's scope (gpt-oss: experts only) holds for its own format.
        if stated is not None and weight_dtype == stated:
            scope = stated_scope
    else:
        shape = _lookup(MODEL_PRESETS, model, "model")
        stated, stated_scope = MODEL_PRECISIONS.get(shape.name, (None, "linear"))
        weight_dtype = weight_dtype or stated
        if stated is not None and weight_dtype == stated:
            scope = stated_scope
    gpu_spec = _lookup(GPU_PRESETS, gpu, "gpu")
    precision = Precision(dtype=dtype, weight_dtype=weight_dtype, kv_cache_dtype=kv_cache_dtype or "auto",
                          quantized=scope)
    if efficiency is None:
        efficiency = Efficiency.for_gpu(gpu_spec, None if engine == DEFAULT_ENGINE else Efficiency.for_engine(engine),
                                        moe=shape.is_moe)
    return analytic_profile(shape, gpu_spec, tensor_parallel, dtype, efficiency, precision=precision,
                            expert_parallel=expert_parallel, data_parallel=data_parallel)


"""The token-parallel layers of a mixture-of-experts or weight-quantized model, per GPU.

``sim.cost.roofline.Roofline.linear_s`` prices a dense bf16 model with one formula (every
weight read once, every parameter 2 FLOPs a token). Once weights are quantized, or experts
are routed, the parameters split into classes that run at different rates and are read
differently; ``LinearSplit`` holds those classes for one (model, precision, TP, EP).

Routing: with ``n`` tokens in a step, each picking ``k`` of ``E`` experts, under uniform
independent routing the expected number of distinct experts a step touches is

    E * (1 - (1 - k / E) ** n)                                  (``expected_distinct_experts``)

since one token leaves a given expert unpicked with probability 1 - k/E. Expert FLOPs are
2 n k x (parameters per expert) whichever experts are hit; expert weight bytes read are the
distinct experts times the bytes of one expert. All experts count in memory.

Parallelism: tensor parallelism t splits every expert t ways (vLLM's default, TP within
each expert). Expert parallelism (``--enable-expert-parallel``, EP degree = t) places E / t
whole experts on each GPU; each token's k picks spread uniformly over all E experts, so a
GPU's expected distinct local experts are (E / t) (1 - (1 - k/E) ** n), and its expected
expert FLOPs are 2 n k P_e / t: both the same per GPU as under TP (what differs is the
collectives, ``sim.cost.collectives``, and load imbalance, which is not modelled).
Attention stays tensor parallel under EP, as in vLLM. The router (hidden x E) is replicated
on every GPU (vLLM's ReplicatedLinear); shared experts are split t ways.

Data parallelism (``data_parallel`` d > 1: vLLM's --data-parallel-size): d ranks of t GPUs each
hold the attention, dense and shared weights whole (split t ways), and the experts spread over
all d x t GPUs (EP: E / (d t) whole experts a GPU; else each expert split d t ways). In a step
every rank runs as many tokens (vLLM pads the ranks to the largest batch, ``sim.loop.dp``), so
the experts see d x n tokens: a GPU's expected distinct local experts are (E / (d t))
(1 - (1 - k/E) ** (d n)), and its expert FLOPs still 2 n k P_e / t.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from sim.cost.precision import Precision
from sim.cost.shape import ModelShape


def expected_distinct_experts(num_experts: int, top_k: int, num_tokens: Any) -> Any:
    """E * (1 - (1 - k/E) ** n): the expected distinct experts ``num_tokens`` tokens touch
    under uniform independent top-``top_k`` routing (scalars or numpy arrays)."""
    n = np.asarray(num_tokens, dtype=float)
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** n)


@dataclass(frozen=True, slots=True)
class LinearSplit:
    """Per-GPU parameter counts of the token-parallel layers, by how they are priced.

    ``*_params_hi``: weights in the activation dtype (GEMMs at its tensor-core rate);
    ``*_params_q``: weights in ``weight_dtype`` (at ``Precision.gemm_precision``'s rate).
    ``token_*``: parameters each token multiplies by (2 FLOPs each), on this GPU;
    ``static_*``: weights read once per step whatever the tokens; ``expert_*``: the
    weights of one expert on this GPU (1/t of it under TP, all of it under EP),
    read once for each distinct expert the step touches (``local_experts`` of them
    live on this GPU: ``expected_local_experts``).
    """

    token_params_hi: float
    token_params_q: float
    static_params_hi: float
    static_params_q: float
    expert_params_hi: float
    expert_params_q: float
    local_experts: float
    num_moe_layers: int
    num_experts: int
    top_k: int
    routed_ranks: int = 1       # data-parallel ranks whose tokens meet at the experts (each with as many)
    expert_token_params: float = 0.0     # the experts' share of token_params_* (per GPU, all MoE layers)
    experts_quantized: bool = False      # ... which is in token_params_q (else token_params_hi)

    def expected_local_experts(self, num_tokens: Any) -> Any:
        """Expected distinct experts a step of ``num_tokens`` tokens (a rank's, every one of
        ``routed_ranks`` ranks as many) touches on one GPU, per MoE layer."""
        if not self.num_experts:
            return np.zeros_like(np.asarray(num_tokens, dtype=float))
        share = self.local_experts / self.num_experts
        routed = np.asarray(num_tokens, dtype=float) * self.routed_ranks
        return share * expected_distinct_experts(self.num_experts, self.top_k, routed)


def linear_split(model: ModelShape, precision: Precision, tensor_parallel: int,
                 expert_parallel: bool = False, data_parallel: int = 1) -> LinearSplit:
    """The ``LinearSplit`` of ``model``'s decoder layers on one of ``tensor_parallel`` GPUs.

    The LM head and embedding are not in it (the roofline adds them, in the activation
    dtype). With ``precision.quantized == "experts"`` only the experts are in weight_dtype."""
    t = tensor_parallel
    m = model
    n_mats = m.num_mlp_matrices
    num_dense = m.num_dense_mlp_layers
    repl = m.attn_replicated_params_per_layer          # MLA's q_a and kv_a: whole on every rank
    attn = (m.num_attention_layers * ((m.attn_params_per_layer - repl) / t + repl)
            + m.num_linear_layers * m.linear_params_per_layer / t    # Gated DeltaNet's projections
            + m.num_mamba_layers * m.mamba_params_per_layer / t)     # Mamba2's in_proj and out_proj
    dense_mlp = num_dense * n_mats * m.hidden_size * m.intermediate_size / t
    shared = m.num_moe_layers * n_mats * m.hidden_size * m.shared_expert_intermediate_size / t
    router = m.num_moe_layers * m.hidden_size * m.num_experts          # replicated on every GPU
    experts_quantized = precision.is_quantized
    rest_quantized = precision.is_quantized and precision.quantized == "linear"
    rest = attn + dense_mlp + shared
    expert_active = m.num_moe_layers * m.num_experts_per_tok * m.params_per_expert / t
    # One expert's weights on this GPU, per MoE layer: a 1/(d t) slice (TP) or whole (EP), the
    # experts spread over all d x t GPUs of the data-parallel group (d = 1: no DP).
    w = t * data_parallel
    per_expert = m.params_per_expert if expert_parallel else m.params_per_expert / w
    local = m.num_experts / w if expert_parallel else float(m.num_experts)
    return LinearSplit(
        token_params_hi=router + (0.0 if rest_quantized else rest) + (0.0 if experts_quantized else expert_active),
        token_params_q=(rest if rest_quantized else 0.0) + (expert_active if experts_quantized else 0.0),
        static_params_hi=router + (0.0 if rest_quantized else rest),
        static_params_q=rest if rest_quantized else 0.0,
        expert_params_hi=0.0 if experts_quantized else m.num_moe_layers * per_expert,
        expert_params_q=m.num_moe_layers * per_expert if experts_quantized else 0.0,
        local_experts=local if m.is_moe else 0.0,
        num_moe_layers=m.num_moe_layers, num_experts=m.num_experts, top_k=m.num_experts_per_tok,
        routed_ranks=data_parallel, expert_token_params=expert_active, experts_quantized=experts_quantized)


def weight_bytes(model: ModelShape, precision: Precision) -> int:
    """Every weight of the model in memory, all ranks together: the quantized ones at
    ``Precision.weight_bytes_per_param`` (block scales included), the rest (embedding,
    LM head, router, and all but the experts for an experts-only scheme) in the activation dtype."""
    hi = precision.activation_bytes
    if not precision.is_quantized:
        return model.num_params * hi
    quantized = model.num_expert_params
    if precision.quantized == "linear":
        router = model.num_moe_layers * model.hidden_size * model.num_experts
        quantized = model.num_params - model.embed_params - router
    return round(quantized * precision.weight_bytes_per_param + (model.num_params - quantized) * hi)

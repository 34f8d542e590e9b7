"""ModelShape: the shape facts of a transformer that costs and memory follow from.

Split from ``sim.cost.profile`` (which re-exports it): attention (explicit head_dim, sliding
windows), the MLP, and mixture-of-experts layers, with the parameter and KV-byte counts the
roofline (``sim.cost.roofline``, ``sim.cost.moe``) and the torch model (``calibrate.model``) read.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

MLP_KINDS = ("swiglu", "gelu")          # gated 3-matrix MLP (Llama) | 2-matrix MLP (OPT)
_POSITIVE_INT_FIELDS = ("hidden_size", "num_layers", "num_heads", "num_kv_heads",
                        "intermediate_size", "vocab_size", "max_position_embeddings")
# Optional shape facts (0: absent), written to a profile file only when set.
OPTIONAL_INT_FIELDS = ("explicit_head_dim", "sliding_window", "num_sliding_layers", "num_experts", "num_experts_per_tok",
                       "moe_intermediate_size", "shared_expert_intermediate_size", "num_dense_layers",
                       "kv_lora_rank", "q_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
                       "index_topk", "index_head_dim", "index_n_heads", "attn_output_gate",
                       "num_linear_layers", "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
                       "linear_value_head_dim", "linear_conv_kernel_dim", "linear_state_bytes", "num_mtp_layers",
                       "num_ffn_layers", "num_mamba_layers", "mamba_num_heads", "mamba_head_dim", "mamba_n_groups",
                       "mamba_state_size", "mamba_conv_kernel", "mamba_chunk_size", "mamba_state_bytes")
# Multi-head latent attention's fields (DeepSeek-V2/V3/R1, Kimi-K2): all set together, or none.
MLA_FIELDS = ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
# DeepSeek sparse attention's indexer (DeepSeek-V3.2, GLM-5), on top of MLA: all set, or none.
DSA_FIELDS = ("index_topk", "index_head_dim", "index_n_heads")
# Gated DeltaNet linear attention (Qwen3-Next, Qwen3.5): all set together with num_linear_layers, or none.
LINEAR_FIELDS = ("num_linear_layers", "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
                 "linear_value_head_dim", "linear_conv_kernel_dim")
# Mamba2 state-space layers (Nemotron-H, Nemotron-3): all set together, or none.
MAMBA_FIELDS = ("num_mamba_layers", "mamba_num_heads", "mamba_head_dim", "mamba_n_groups", "mamba_state_size",
                "mamba_conv_kernel", "mamba_chunk_size")
# The indexer's keys as vLLM caches them: FP8, plus one fp32 scale per 128 values
# (DeepseekV32IndexerCache: head_dim + head_dim // 128 * 4 bytes: 132 for 128).
INDEX_QUANT_BLOCK = 128
# An FP8 DSA latent as vLLM's sparse MLA kernels store it (fp8_ds_mla): the 512 latent values in
# FP8, 4 fp32 scales, the 64 RoPE values in bf16: 512 + 16 + 128 = 656 bytes a layer.
FP8_DS_MLA_BYTES = 656


@dataclass(frozen=True, slots=True)
class ModelShape:
    """The shape facts of a transformer: what costs and memory follow from
    (``sim.cost.roofline``), and what ``calibrate.model`` builds its random-weight
    Llama from. Validated on construction: ValueError naming the field.

    ``explicit_head_dim``: the config's head_dim; 0 means derived, hidden_size /
    num_heads (which must divide). ``head_dim`` is the effective value (a property,
    so ``dataclasses.replace`` of heads or hidden size re-derives it). A profile
    file and ``model_shape_from_dict`` spell the field ``head_dim``. Attention projections are
    q: hidden x heads*head_dim, k and v: hidden x kv_heads*head_dim, o:
    heads*head_dim x hidden (Qwen3: 64 x 128 = 8192 != hidden 5120).

    Sliding-window attention: ``num_sliding_layers`` of the layers attend to the
    last ``sliding_window`` keys only (both 0: none).

    Mixture of experts (``num_experts`` > 0): every layer but the first
    ``num_dense_layers`` (whose MLP is dense, ``intermediate_size`` wide) has a
    router (hidden x num_experts), ``num_experts`` experts of
    ``moe_intermediate_size`` (0: ``intermediate_size``, as Mixtral and gpt-oss
    write it), of which each token uses ``num_experts_per_tok``, and always-on
    shared experts of ``shared_expert_intermediate_size`` in all (0: none).

    Multi-head latent attention (``kv_lora_rank`` > 0; DeepSeek-V2/V3/R1, Kimi-K2): a token's
    keys and values are one compressed latent of ``kv_lora_rank`` plus a shared RoPE key of
    ``qk_rope_head_dim``, which is all the KV cache holds (``mla_latent_dim`` a layer, the
    same on every TP rank: vLLM's and SGLang's MLA caches are not split by heads). Per layer
    the projections are q (``q_lora_rank`` > 0: hidden x q_lora_rank, then q_lora_rank x
    heads*(nope + rope); else hidden x heads*(nope + rope)), kv_a (hidden x latent), kv_b
    (kv_lora_rank x heads*(nope + v): the keys' and values' up-projection) and o
    (heads*v x hidden). q_a and kv_a are replicated on every rank (vLLM's ReplicatedLinear
    of the fused q_a/kv_a projection): ``attn_replicated_params_per_layer``. ``num_kv_heads``
    and ``head_dim`` are not read for an MLA model's attention.

    DeepSeek sparse attention (``index_topk`` > 0, on MLA: DeepSeek-V3.2, GLM-5): a lightning
    indexer of ``index_n_heads`` heads of ``index_head_dim`` scores every cached token with one
    cached key per token (FP8, ``INDEX_QUANT_BLOCK`` scales), and each query attends to its
    ``index_topk`` best keys only. Its weights (wq_b: q_lora_rank x heads*dim, wk: hidden x
    dim, weights_proj: hidden x heads) are replicated on every rank, as vLLM's Indexer holds them.

    ``attn_output_gate`` (1: Qwen3-Next, Qwen3.5): the query projection also yields a sigmoid gate
    of the attention output, so q is hidden x 2 heads*head_dim.

    Gated DeltaNet linear attention (``num_linear_layers`` > 0: Qwen3-Next, Qwen3.5): that many
    of the ``num_layers`` layers mix tokens with a gated delta rule instead of attention, the
    rest (``num_attention_layers``) attend. A linear layer has ``linear_num_key_heads`` query/key
    heads of ``linear_key_head_dim`` and ``linear_num_value_heads`` value heads of
    ``linear_value_head_dim``; its weights (``linear_params_per_layer``) are in_proj_qkv (hidden x
    (2 key_dim + value_dim)), in_proj_z (hidden x value_dim), in_proj_b and in_proj_a (hidden x
    value heads each) and out_proj (value_dim x hidden), the causal conv1d's (conv_dim x
    ``linear_conv_kernel_dim``, conv_dim = 2 key_dim + value_dim) not counted. It caches no KV per
    token: each sequence holds a fixed state a layer (``linear_state_bytes_per_seq``), the conv
    window (conv_dim x (kernel - 1), in the model's dtype) and the recurrent state (value heads x
    value_dim x key_dim, in ``linear_state_bytes`` a value; 0: the model's dtype), split across
    TP ranks by heads. Every layer keeps its MLP (or MoE).

    Single-block layers (``num_ffn_layers`` > 0: Nemotron-H's ``hybrid_override_pattern``): each
    of the ``num_layers`` layers holds one block, a mixer (attention or Mamba2) or an MLP, and
    ``num_ffn_layers`` of them are the MLP (or MoE) ones; the MoE ones are all but
    ``num_dense_layers`` of those. 0: every layer holds a mixer and an MLP.

    Mamba2 state-space layers (``num_mamba_layers`` > 0: Nemotron-H, Nemotron-3; vLLM's
    ``MambaMixer2``, ``vllm/model_executor/layers/mamba/mamba_mixer2.py``): that many of the mixers
    are Mamba2's, the rest attend. A Mamba2 layer has ``mamba_num_heads`` heads of
    ``mamba_head_dim`` (intermediate I = heads x head_dim), ``mamba_n_groups`` groups of B and C
    of ``mamba_state_size`` (N) each, a causal conv1d of ``mamba_conv_kernel`` taps over
    conv_dim = I + 2 groups x N channels, and its prefill scans in chunks of ``mamba_chunk_size``.
    Its weights (``mamba_params_per_layer``) are in_proj (hidden x (2 I + 2 groups x N + heads):
    z, x, B, C and dt) and out_proj (I x hidden); the conv1d's, A, D, dt_bias and the gated
    norm's are not counted. Each sequence holds a fixed state a layer (``mamba_state_bytes_per_seq``):
    the conv window (conv_dim x (kernel - 1), in the model's dtype) and the SSM state (heads x
    head_dim x N, in ``mamba_state_bytes`` a value; 0: the model's dtype).
    """

    name: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    vocab_size: int
    max_position_embeddings: int
    mlp: str = "swiglu"                  # one of MLP_KINDS
    tie_word_embeddings: bool = False
    rope_theta: float = 10000.0          # RoPE base; costs nothing, only the torch model reads it
    explicit_head_dim: int = 0           # 0: hidden_size // num_heads (see head_dim)
    sliding_window: int = 0              # keys a sliding layer attends to (0: no sliding layers)
    num_sliding_layers: int = 0
    num_experts: int = 0                 # 0: a dense model
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0       # 0: intermediate_size
    shared_expert_intermediate_size: int = 0
    num_dense_layers: int = 0            # MoE models: layers with a dense MLP instead
    kv_lora_rank: int = 0                # MLA (0: none): the KV latent's width
    q_lora_rank: int = 0                 # MLA: the query's low-rank width (0: a full q projection)
    qk_nope_head_dim: int = 0            # MLA: a head's query/key width without RoPE
    qk_rope_head_dim: int = 0            # MLA: the RoPE part of a query/key head (one key shared by the heads)
    v_head_dim: int = 0                  # MLA: a head's value width
    index_topk: int = 0                  # DSA (0: dense attention): the keys each query attends to
    index_head_dim: int = 0              # DSA: the indexer's head width
    index_n_heads: int = 0               # DSA: the indexer's heads
    attn_output_gate: int = 0            # 1: q also yields an output gate (q is hidden x 2 heads*head_dim)
    num_linear_layers: int = 0           # Gated DeltaNet layers among num_layers (0: none)
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_conv_kernel_dim: int = 0
    linear_state_bytes: int = 0          # the recurrent state's bytes a value (0: the model's dtype)
    # The multi-token-prediction layers the checkpoint ships (DeepSeek's num_nextn_predict_layers,
    # Qwen3.5's mtp_num_hidden_layers): loaded only as speculative decoding's proposer (method mtp,
    # sim.core.speculative), so not in num_params.
    num_mtp_layers: int = 0
    num_ffn_layers: int = 0              # single-block layers (Nemotron-H): the MLP/MoE ones (0: every layer has both)
    num_mamba_layers: int = 0            # Mamba2 mixers among the layers (0: none)
    mamba_num_heads: int = 0
    mamba_head_dim: int = 0
    mamba_n_groups: int = 0
    mamba_state_size: int = 0
    mamba_conv_kernel: int = 0
    mamba_chunk_size: int = 0            # the prefill scan's chunk (the config's chunk_size)
    mamba_state_bytes: int = 0           # the SSM state's bytes a value (0: the model's dtype)

    def _all_or_none(self, fields: tuple[str, ...], what: str) -> bool:
        """Whether the mechanism of ``fields`` is set; ValueError when only some of them are."""
        given = [f for f in fields if getattr(self, f)]
        if given and len(given) != len(fields):
            missing = [f for f in fields if not getattr(self, f)]
            raise ValueError(f"model {self.name!r}: {what} {', '.join(fields)}; {', '.join(missing)} missing")
        return bool(given)

    def __post_init__(self) -> None:
        for f in _POSITIVE_INT_FIELDS:
            value = getattr(self, f)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"model {self.name!r}: {f} must be a positive integer, got {value!r}")
        for f in OPTIONAL_INT_FIELDS:
            value = getattr(self, f)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"model {self.name!r}: {f} must be a whole number >= 0 (0: absent), got {value!r}")
        if self.mlp not in MLP_KINDS:
            raise ValueError(f"model {self.name!r}: mlp must be one of {', '.join(MLP_KINDS)}, got {self.mlp!r}")
        theta = self.rope_theta
        if isinstance(theta, bool) or not isinstance(theta, (int, float)) or not 0 < theta < math.inf:
            raise ValueError(f"model {self.name!r}: rope_theta must be a positive number, got {theta!r}")
        if self.explicit_head_dim and self.explicit_head_dim * self.num_heads == self.hidden_size:
            # The derived value given explicitly (Llama's head_dim 128 = 4096 / 32): one shape, one
            # spelling, so a config and a preset compare equal.
            object.__setattr__(self, "explicit_head_dim", 0)
        if self.explicit_head_dim == 0 and self.hidden_size % self.num_heads:
            raise ValueError(f"model {self.name!r}: hidden_size {self.hidden_size} is not divisible "
                             f"by num_heads {self.num_heads} (give head_dim explicitly)")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"model {self.name!r}: num_heads {self.num_heads} is not divisible "
                             f"by num_kv_heads {self.num_kv_heads}")
        if (self.sliding_window == 0) != (self.num_sliding_layers == 0):
            raise ValueError(f"model {self.name!r}: sliding_window ({self.sliding_window}) and num_sliding_layers "
                             f"({self.num_sliding_layers}) must both be set or both be 0")
        if self.num_sliding_layers > self.num_layers:
            raise ValueError(f"model {self.name!r}: num_sliding_layers {self.num_sliding_layers} is more than "
                             f"num_layers {self.num_layers}")
        moe_only = ("num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size",
                    "num_dense_layers")
        if self.num_experts == 0:
            given = [f for f in moe_only if getattr(self, f)]
            if given:
                raise ValueError(f"model {self.name!r}: {', '.join(given)} set without num_experts")
        else:
            if not 1 <= self.num_experts_per_tok <= self.num_experts:
                raise ValueError(f"model {self.name!r}: num_experts_per_tok must be in [1, num_experts "
                                 f"{self.num_experts}], got {self.num_experts_per_tok}")
            if self.num_dense_layers >= self.num_layers:
                raise ValueError(f"model {self.name!r}: num_dense_layers {self.num_dense_layers} leaves no MoE "
                                 f"layer of {self.num_layers}")

        mla = self._all_or_none(MLA_FIELDS, "multi-head latent attention needs")
        if self.q_lora_rank and not mla:
            raise ValueError(f"model {self.name!r}: q_lora_rank set without kv_lora_rank (multi-head latent attention)")
        dsa = self._all_or_none(DSA_FIELDS, "DeepSeek sparse attention needs")
        if dsa and not mla:
            raise ValueError(f"model {self.name!r}: DeepSeek sparse attention (index_topk) is modelled on multi-head "
                             f"latent attention only; kv_lora_rank is missing")
        if mla and (self.sliding_window or self.num_sliding_layers):
            raise ValueError(f"model {self.name!r}: sliding windows with multi-head latent attention are not modelled")
        if self.attn_output_gate not in (0, 1):
            raise ValueError(f"model {self.name!r}: attn_output_gate must be 0 or 1, got {self.attn_output_gate}")
        linear = self._all_or_none(LINEAR_FIELDS, "Gated DeltaNet linear attention needs")
        if self.linear_state_bytes and not linear:
            raise ValueError(f"model {self.name!r}: linear_state_bytes set without num_linear_layers")
        if linear:
            if self.num_linear_layers >= self.num_mixer_layers:
                raise ValueError(f"model {self.name!r}: num_linear_layers {self.num_linear_layers} leaves no attention "
                                 f"layer of {self.num_mixer_layers} (attention-free models are not modelled)")
            if mla or self.num_sliding_layers:
                raise ValueError(f"model {self.name!r}: linear attention beside multi-head latent attention or "
                                 f"sliding windows is not modelled")
            if self.linear_num_value_heads % self.linear_num_key_heads:
                raise ValueError(f"model {self.name!r}: linear_num_value_heads {self.linear_num_value_heads} is not "
                                 f"divisible by linear_num_key_heads {self.linear_num_key_heads}")
        if self.num_ffn_layers >= self.num_layers:
            raise ValueError(f"model {self.name!r}: num_ffn_layers {self.num_ffn_layers} leaves no mixer layer "
                             f"of {self.num_layers}")
        if self.num_experts and self.num_dense_layers >= self.num_mlp_layers:
            raise ValueError(f"model {self.name!r}: num_dense_layers {self.num_dense_layers} leaves no MoE layer "
                             f"of {self.num_mlp_layers} MLP layers")
        mamba = self._all_or_none(MAMBA_FIELDS, "Mamba2 state-space layers need")
        if self.mamba_state_bytes and not mamba:
            raise ValueError(f"model {self.name!r}: mamba_state_bytes set without num_mamba_layers")
        if mamba:
            if linear or mla or self.num_sliding_layers:
                raise ValueError(f"model {self.name!r}: Mamba2 layers beside linear attention, multi-head latent "
                                 f"attention or sliding windows are not modelled")
            if self.mamba_num_heads % self.mamba_n_groups:
                raise ValueError(f"model {self.name!r}: mamba_num_heads {self.mamba_num_heads} is not divisible "
                                 f"by mamba_n_groups {self.mamba_n_groups}")
        if self.num_attention_layers <= 0:
            raise ValueError(f"model {self.name!r}: {self.num_linear_layers + self.num_mamba_layers} linear or "
                             f"state-space mixers of {self.num_mixer_layers} leave no attention layer "
                             f"(attention-free models are not modelled)")

    # ---- derived counts ---------------------------------------------------------
    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank > 0

    @property
    def is_dsa(self) -> bool:
        return self.index_topk > 0

    @property
    def is_hybrid(self) -> bool:
        """Some mixers hold a per-sequence state instead of KV per token: linear attention (Gated
        DeltaNet) or Mamba2."""
        return self.num_linear_layers > 0 or self.num_mamba_layers > 0

    @property
    def is_mamba(self) -> bool:
        return self.num_mamba_layers > 0

    @property
    def num_state_layers(self) -> int:
        """The mixers that hold a state a sequence (Gated DeltaNet or Mamba2; a model has one kind)."""
        return self.num_linear_layers + self.num_mamba_layers

    @property
    def state_layer_kind(self) -> str:
        """What the state layers are, for messages."""
        return "Mamba2 state-space layers" if self.is_mamba else "linear-attention layers"

    def state_bytes_per_seq(self, dtype_bytes: int, tensor_parallel: int = 1) -> tuple[int, int]:
        """(conv window, recurrent/SSM state) bytes one sequence holds in one state layer on one rank."""
        if self.is_mamba:
            return self.mamba_state_bytes_per_seq(dtype_bytes, tensor_parallel)
        return self.linear_state_bytes_per_seq(dtype_bytes, tensor_parallel)

    @property
    def num_mixer_layers(self) -> int:
        """The layers that hold a mixer (attention, Gated DeltaNet or Mamba2): all of them, or all
        but the MLP-only ones of single-block layers."""
        return self.num_layers - self.num_ffn_layers

    @property
    def num_mlp_layers(self) -> int:
        """The layers that hold an MLP or MoE: all of them, or the MLP-only ones of single-block layers."""
        return self.num_ffn_layers or self.num_layers

    @property
    def num_dense_mlp_layers(self) -> int:
        """The layers whose MLP is dense (``intermediate_size`` wide)."""
        return self.num_mlp_layers - self.num_moe_layers

    @property
    def num_sublayers(self) -> int:
        """Mixer blocks and MLP blocks together (2 x num_layers where every layer holds both)."""
        return self.num_mixer_layers + self.num_mlp_layers

    @property
    def num_attention_layers(self) -> int:
        """The layers that attend (and cache KV per token): the mixers but the linear and Mamba2 ones."""
        return self.num_mixer_layers - self.num_linear_layers - self.num_mamba_layers

    @property
    def mamba_intermediate(self) -> int:
        """A Mamba2 layer's inner width I: heads x head_dim."""
        return self.mamba_num_heads * self.mamba_head_dim

    @property
    def mamba_conv_dim(self) -> int:
        """The causal conv1d's channels: x, B and C (I + 2 groups x N)."""
        return self.mamba_intermediate + 2 * self.mamba_n_groups * self.mamba_state_size

    @property
    def mamba_in_proj_width(self) -> int:
        """A Mamba2 layer's in_proj output a token: z (I), x, B and C (the conv's channels) and dt
        (heads): 2 I + 2 groups x N + heads."""
        return self.mamba_intermediate + self.mamba_conv_dim + self.mamba_num_heads

    @property
    def mamba_params_per_layer(self) -> int:
        """A Mamba2 layer's matmul weights (the class doc): in_proj and out_proj; 0 without Mamba2 layers."""
        if not self.is_mamba:
            return 0
        h, i = self.hidden_size, self.mamba_intermediate
        return h * self.mamba_in_proj_width + i * h

    def mamba_state_bytes_per_seq(self, dtype_bytes: int, tensor_parallel: int = 1) -> tuple[int, int]:
        """(conv window, SSM state) bytes one sequence holds in one Mamba2 layer on one of
        ``tensor_parallel`` ranks (vLLM's MambaStateShapeCalculator.mamba2_state_shape,
        ``vllm/model_executor/layers/mamba/mamba_utils.py``: conv_dim / t x (kernel - 1) values in
        the conv state's dtype, the model's; heads / t x head_dim x N in ``mamba_state_bytes``);
        (0, 0) without Mamba2 layers. The groups split with the heads (t must divide them)."""
        if not self.is_mamba:
            return 0, 0
        t = tensor_parallel
        conv = self.mamba_conv_dim // t * (self.mamba_conv_kernel - 1) * dtype_bytes
        ssm = (self.mamba_num_heads // t * self.mamba_head_dim * self.mamba_state_size
               * (self.mamba_state_bytes or dtype_bytes))
        return conv, ssm

    @property
    def linear_key_dim(self) -> int:
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def linear_value_dim(self) -> int:
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def linear_conv_dim(self) -> int:
        """The causal conv1d's channels: q, k and v (2 key_dim + value_dim)."""
        return 2 * self.linear_key_dim + self.linear_value_dim

    @property
    def linear_params_per_layer(self) -> int:
        """A Gated DeltaNet layer's matmul weights (the class doc): 0 without linear layers."""
        if not self.is_hybrid:
            return 0
        h, kd, vd, nv = self.hidden_size, self.linear_key_dim, self.linear_value_dim, self.linear_num_value_heads
        return h * (2 * kd + 2 * vd + 2 * nv) + vd * h

    def linear_state_bytes_per_seq(self, dtype_bytes: int, tensor_parallel: int = 1) -> tuple[int, int]:
        """(conv window, recurrent state) bytes one sequence holds in one linear layer on one of
        ``tensor_parallel`` ranks (vLLM's MambaStateShapeCalculator.gated_delta_net_state_shape:
        conv_dim / t x (kernel - 1) values in the model's dtype, value heads / t x value_dim x
        key_dim in ``linear_state_bytes``); (0, 0) without linear layers."""
        if not self.is_hybrid:
            return 0, 0
        t = tensor_parallel
        conv = self.linear_conv_dim // t * (self.linear_conv_kernel_dim - 1) * dtype_bytes
        ssm = (self.linear_num_value_heads // t * self.linear_value_head_dim * self.linear_key_head_dim
               * (self.linear_state_bytes or dtype_bytes))
        return conv, ssm

    @property
    def index_params_per_layer(self) -> int:
        """The DSA indexer's weights a layer (0 without DSA): wq_b, wk and weights_proj."""
        if not self.is_dsa:
            return 0
        return (self.q_lora_rank * self.index_n_heads * self.index_head_dim + self.hidden_size * self.index_head_dim
                + self.hidden_size * self.index_n_heads)

    @property
    def index_bytes_per_token_layer(self) -> int:
        """The indexer's cached key a token and layer: FP8 values and fp32 scales (132 B for 128)."""
        if not self.is_dsa:
            return 0
        return self.index_head_dim + self.index_head_dim // INDEX_QUANT_BLOCK * 4

    def mla_bytes_per_token_layer(self, dtype_bytes: int) -> int:
        """An MLA layer's cache a token: the latent and RoPE key (in FP8 with DSA: ``FP8_DS_MLA_BYTES``),
        plus the DSA indexer's key."""
        latent = (FP8_DS_MLA_BYTES if self.is_dsa and dtype_bytes == 1 and self.kv_lora_rank == 512
                  and self.qk_rope_head_dim == 64 else self.mla_latent_dim * dtype_bytes)
        return latent + self.index_bytes_per_token_layer

    @property
    def mla_latent_dim(self) -> int:
        """What an MLA layer caches per token: the latent and the shared RoPE key (DeepSeek-V3: 512 + 64)."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def head_dim(self) -> int:
        return self.explicit_head_dim or self.hidden_size // self.num_heads

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def num_moe_layers(self) -> int:
        return self.num_mlp_layers - self.num_dense_layers if self.num_experts else 0

    @property
    def expert_intermediate_size(self) -> int:
        return self.moe_intermediate_size or self.intermediate_size

    @property
    def num_mlp_matrices(self) -> int:
        return 3 if self.mlp == "swiglu" else 2

    @property
    def attn_params_per_layer(self) -> int:
        """q, o: hidden x heads*head_dim each; k, v: hidden x kv_heads*head_dim each. MLA: q (or
        q_a and q_b), kv_a, kv_b and o (the class doc)."""
        h, n = self.hidden_size, self.num_heads
        if self.is_mla:
            qk = self.qk_nope_head_dim + self.qk_rope_head_dim
            q = (h * self.q_lora_rank + self.q_lora_rank * n * qk) if self.q_lora_rank else h * n * qk
            kv_a = h * self.mla_latent_dim
            kv_b = self.kv_lora_rank * n * (self.qk_nope_head_dim + self.v_head_dim)
            return q + kv_a + kv_b + n * self.v_head_dim * h + self.index_params_per_layer
        q, kv = n * self.head_dim, self.num_kv_heads * self.head_dim
        return (2 + self.attn_output_gate) * h * q + 2 * h * kv

    @property
    def attn_replicated_params_per_layer(self) -> int:
        """The attention weights every TP rank holds whole: MLA's q_a and kv_a (0 otherwise)."""
        if not self.is_mla:
            return 0
        return self.hidden_size * (self.q_lora_rank + self.mla_latent_dim) + self.index_params_per_layer

    @property
    def params_per_expert(self) -> int:
        return self.num_mlp_matrices * self.hidden_size * self.expert_intermediate_size

    @property
    def shared_params_per_layer(self) -> int:
        """Router (hidden x num_experts) plus the shared experts of one MoE layer."""
        return (self.hidden_size * self.num_experts
                + self.num_mlp_matrices * self.hidden_size * self.shared_expert_intermediate_size)

    @property
    def embed_params(self) -> int:
        return self.vocab_size * self.hidden_size * (1 if self.tie_word_embeddings else 2)

    @property
    def num_expert_params(self) -> int:
        """Every expert of every MoE layer (what an mxfp4 checkpoint quantizes)."""
        return self.num_moe_layers * self.num_experts * self.params_per_expert

    @property
    def num_params(self) -> int:
        """Matmul weights and embeddings (norms and biases are < 0.1%: not counted)."""
        dense_mlp = self.num_mlp_matrices * self.hidden_size * self.intermediate_size
        num_dense = self.num_dense_mlp_layers
        return (self.num_attention_layers * self.attn_params_per_layer
                + self.num_linear_layers * self.linear_params_per_layer
                + self.num_mamba_layers * self.mamba_params_per_layer + num_dense * dense_mlp
                + self.num_moe_layers * self.shared_params_per_layer + self.num_expert_params + self.embed_params)

    @property
    def num_active_params(self) -> int:
        """Parameters one token computes with: num_params with num_experts_per_tok experts a layer."""
        unused = self.num_moe_layers * (self.num_experts - self.num_experts_per_tok) * self.params_per_expert
        return self.num_params - unused

    @property
    def num_kv_pool_layers(self) -> int:
        """Layers whose KV the per-token pool holds: the full-attention layers; all layers when
        every layer slides (Mistral v0.1): vLLM then keeps one uniform pool of every layer's
        bytes a token (kv_cache_utils: one SlidingWindowSpec group) and frees the blocks that
        leave the window. NOTE: batchsim's pool (sim.core) frees nothing before a request ends,
        so such a request longer than the window is charged all its tokens: a conservative
        capacity, exact for requests within the window."""
        full = self.num_attention_layers - self.num_sliding_layers
        return full if full else self.num_layers

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """K and V of the pooled layers (``num_kv_pool_layers``): 2 * layers * kv_heads * head_dim * bytes.
        MLA: layers * (kv_lora_rank + qk_rope_head_dim) * bytes (DSA: ``mla_bytes_per_token_layer``), one
        copy (each TP rank holds one: ``sim.cost.roofline.Roofline.kv_bytes_per_token`` counts them all)."""
        if self.is_mla:
            return self.num_layers * self.mla_bytes_per_token_layer(dtype_bytes)
        return 2 * self.num_kv_pool_layers * self.num_kv_heads * self.head_dim * dtype_bytes

    def kv_bytes_per_seq(self, dtype_bytes: int) -> int:
        """The sliding layers' KV a running request holds at most, when some layers are full
        attention (else 0): sliding_window tokens x 2 * sliding layers * kv_heads * head_dim * bytes.
        vLLM's SlidingWindowManager frees the blocks that fall out of the window, so a request's
        sliding-layer KV plateaus at about the window (window - 1 + the tokens in flight, + 1
        block; the chunk and the block are not counted here)."""
        if self.num_sliding_layers in (0, self.num_layers):
            return 0
        return 2 * self.num_sliding_layers * self.num_kv_heads * self.head_dim * dtype_bytes * self.sliding_window

    def to_dict(self) -> dict[str, Any]:
        """The profile file's ``model`` mapping: the optional facts only when set."""
        d: dict[str, Any] = {
            "name": self.name, "hidden_size": self.hidden_size, "num_layers": self.num_layers,
            "num_heads": self.num_heads, "num_kv_heads": self.num_kv_heads,
            "intermediate_size": self.intermediate_size, "vocab_size": self.vocab_size,
            "max_position_embeddings": self.max_position_embeddings, "mlp": self.mlp,
            "tie_word_embeddings": self.tie_word_embeddings, "rope_theta": self.rope_theta,
        }
        if self.explicit_head_dim:
            d["head_dim"] = self.head_dim
        for f in OPTIONAL_INT_FIELDS[1:]:
            if getattr(self, f):
                d[f] = getattr(self, f)
        return d

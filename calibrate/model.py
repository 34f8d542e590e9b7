"""A compact Llama-style decoder with random weights, for timing real kernels.

The weights are seeded noise (normal, std 0.02): the model computes nothing
useful, but every matmul, norm, RoPE and attention has the shape and dtype of
the real model, so it costs what the real model costs. Llama 3.1's RoPE
frequency scaling is not modelled; it changes values, not cost.

Its shape is a ``sim.cost.profile.ModelShape``, the type the roofline costs, so a
preset or an HF config (``sim.cost.presets.model_shape_from_hf``) means the same
model to both; ``check_buildable`` refuses what this model cannot be.

The model exposes its layers as pieces (``embed``, ``qkv``, ``finish_layer``,
``logits``) so that ``calibrate.engine.LiveEngine`` can run attention against
a paged KV cache between them; ``forward_dense`` is the plain reference.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from sim.cost.presets import MODEL_PRESETS as SHAPE_PRESETS
from sim.cost.presets import model_shape_from_dict
from sim.cost.profile import ModelShape

RMS_NORM_EPS = 1e-5
INIT_STD = 0.02

# Tiny models that run fast on 2 CPU cores, plus every Llama-style (SwiGLU)
# shape the roofline presets know, taken from sim.cost.presets so the two never drift.
MODEL_PRESETS: dict[str, ModelShape] = {
    "tiny-llama-2l": ModelShape("tiny-llama-2l", 64, 2, 4, 2, 172, 512, 2048),
    "tiny-llama": ModelShape("tiny-llama", 256, 4, 8, 4, 688, 4096, 4096),
    **{name: shape for name, shape in SHAPE_PRESETS.items()
       if shape.mlp == "swiglu" and not shape.is_moe and not shape.is_mla and not shape.num_sliding_layers},
}


def get_model_shape(spec: str | Mapping[str, Any] | ModelShape) -> ModelShape:
    """A ModelShape as given, a preset by name, or a dict
    (``sim.cost.presets.model_shape_from_dict``: HF config.json fields or
    ModelShape's own). Raises ValueError naming the bad name or field."""
    if isinstance(spec, ModelShape):
        return spec
    if isinstance(spec, str):
        if spec not in MODEL_PRESETS:
            raise ValueError(f"unknown model {spec!r}; presets: {', '.join(MODEL_PRESETS)}")
        return MODEL_PRESETS[spec]
    if isinstance(spec, Mapping):
        return model_shape_from_dict(spec)
    raise ValueError(f"model must be a preset name or a dict, got {type(spec).__name__}")


def check_buildable(shape: ModelShape) -> None:
    """Refuse (ValueError) a shape this Llama-style model cannot be: a 2-matrix
    (non-SwiGLU) MLP, mixture-of-experts layers, multi-head latent attention, linear attention or gated
    attention outputs, sliding-window attention, or an odd
    head_dim (RoPE rotates pairs of dimensions). An explicit head_dim is built (q, o:
    heads x head_dim wide; Qwen3's q_norm / k_norm are left out: they cost ~nothing)."""
    if shape.is_moe:
        raise ValueError(f"model {shape.name!r}: num_experts is {shape.num_experts}, but the torch model builds "
                         f"dense MLPs only; mixture-of-experts models are costed by the roofline "
                         f"(sim.cost.roofline), not calibrated here")
    if shape.is_mla:
        raise ValueError(f"model {shape.name!r}: kv_lora_rank is {shape.kv_lora_rank} (multi-head latent "
                         f"attention), but the torch model builds K and V heads only; MLA models are costed by "
                         f"the roofline (sim.cost.roofline) or the kernel tables, not calibrated here")
    if shape.is_mamba or shape.num_ffn_layers:
        raise ValueError(f"model {shape.name!r}: num_mamba_layers is {shape.num_mamba_layers} (Mamba2 state-space "
                         f"layers, single-block layers), but the torch model builds Llama layers only; such models "
                         f"are costed by the roofline or the kernel tables")
    if shape.is_hybrid or shape.attn_output_gate:
        raise ValueError(f"model {shape.name!r}: num_linear_layers is {shape.num_linear_layers} (Gated DeltaNet "
                         f"linear attention) or attn_output_gate is set, but the torch model builds plain "
                         f"attention layers only; such models are costed by the roofline or the kernel tables")
    if shape.num_sliding_layers:
        raise ValueError(f"model {shape.name!r}: sliding_window is {shape.sliding_window} on "
                         f"{shape.num_sliding_layers} layers, but the torch model attends to the full "
                         f"context; sliding-window models are costed by the roofline (sim.cost.roofline)")
    if shape.mlp != "swiglu":
        raise ValueError(f"model {shape.name!r}: mlp is {shape.mlp!r}, but the torch model is "
                         f"Llama-style and builds only a SwiGLU MLP")
    if shape.head_dim % 2:
        raise ValueError(f"model {shape.name!r}: head_dim {shape.head_dim} must be even for RoPE")


class DecoderLayer(nn.Module):
    """Weights of one layer: fused QKV, output projection, fused gate/up, down."""

    def __init__(self, cfg: ModelShape, device: torch.device, dtype: torch.dtype) -> None:
        super().__init__()
        h, hd, i = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
        kw: dict[str, Any] = {"device": device, "dtype": dtype}
        self.attn_norm = nn.Parameter(torch.ones(h, **kw), requires_grad=False)
        self.w_qkv = nn.Parameter(torch.empty((cfg.num_heads + 2 * cfg.num_kv_heads) * hd, h, **kw),
                                  requires_grad=False)
        self.w_o = nn.Parameter(torch.empty(h, cfg.num_heads * hd, **kw), requires_grad=False)
        self.mlp_norm = nn.Parameter(torch.ones(h, **kw), requires_grad=False)
        self.w_gate_up = nn.Parameter(torch.empty(2 * i, h, **kw), requires_grad=False)
        self.w_down = nn.Parameter(torch.empty(h, i, **kw), requires_grad=False)


class LlamaModel(nn.Module):
    """Random-weight Llama decoder, created directly on ``device`` in ``dtype``.

    Weights are drawn from a generator on ``device`` seeded with ``seed``, so
    the same (shape, device, dtype, seed) gives the same weights. The LM head
    is the embedding matrix when the shape ties them. Raises ValueError for a
    shape ``check_buildable`` refuses or an unsupported dtype.
    """

    def __init__(self, cfg: ModelShape, device: str | torch.device = "cpu",
                 dtype: torch.dtype = torch.float32, seed: int = 0) -> None:
        super().__init__()
        check_buildable(cfg)
        if dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise ValueError(f"dtype must be float32, bfloat16 or float16, got {dtype}")
        self.cfg = cfg
        self.device = torch.device(device)
        self.dtype = dtype
        kw: dict[str, Any] = {"device": self.device, "dtype": dtype}
        h = cfg.hidden_size
        self.embed_tokens = nn.Parameter(torch.empty(cfg.vocab_size, h, **kw), requires_grad=False)
        self.layers = nn.ModuleList(DecoderLayer(cfg, self.device, dtype) for _ in range(cfg.num_layers))
        self.final_norm = nn.Parameter(torch.ones(h, **kw), requires_grad=False)
        self.lm_head = (self.embed_tokens if cfg.tie_word_embeddings else
                        nn.Parameter(torch.empty(cfg.vocab_size, h, **kw), requires_grad=False))
        self._cos = torch.empty(0, 1, cfg.head_dim // 2, **kw)   # [P, 1, hd/2], grown lazily
        self._sin = torch.empty(0, 1, cfg.head_dim // 2, **kw)
        if self.device.type == "meta":     # shapes only (parameter counting), no values
            return
        gen = torch.Generator(device=self.device).manual_seed(seed)
        with torch.no_grad():
            for p in self.parameters():
                if p.dim() == 2:
                    p.normal_(0.0, INIT_STD, generator=gen)

    def rope_tables(self, num_positions: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin: [>= num_positions, 1, head_dim/2] in the model dtype (grown by doubling)."""
        if num_positions > self._cos.shape[0]:
            if num_positions > self.cfg.max_position_embeddings:
                raise ValueError(f"position {num_positions - 1} is beyond max_position_embeddings "
                                 f"{self.cfg.max_position_embeddings} of {self.cfg.name!r}")
            size = min(max(num_positions, 2 * self._cos.shape[0], 256), self.cfg.max_position_embeddings)
            hd = self.cfg.head_dim
            inv_freq = 1.0 / (self.cfg.rope_theta ** (torch.arange(0, hd, 2, device=self.device,
                                                                   dtype=torch.float64) / hd))
            angles = torch.outer(torch.arange(size, device=self.device, dtype=torch.float64), inv_freq)
            self._cos = angles.cos().to(self.dtype).unsqueeze(1)
            self._sin = angles.sin().to(self.dtype).unsqueeze(1)
        return self._cos, self._sin

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        """token_ids: [T] int64 -> x: [T, hidden]."""
        return F.embedding(token_ids, self.embed_tokens)

    def qkv(self, layer: int, x: torch.Tensor, positions: torch.Tensor
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Norm, fused QKV projection and RoPE for the rows of x.

        x: [T, hidden], positions: [T] int64 -> q: [T, nh, hd], k, v: [T, nkv, hd].
        """
        cfg, w = self.cfg, self.layers[layer]
        nh, nkv, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        h = F.rms_norm(x, (cfg.hidden_size,), w.attn_norm, RMS_NORM_EPS)
        qkv = F.linear(h, w.w_qkv).view(-1, nh + 2 * nkv, hd)       # [T, nh+2nkv, hd]
        cos, sin = self.rope_tables(0)
        cos, sin = cos.index_select(0, positions), sin.index_select(0, positions)  # [T, 1, hd/2]
        qk = qkv[:, : nh + nkv]
        x1, x2 = qk.chunk(2, dim=-1)
        qk = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
        return qk[:, :nh], qk[:, nh:], qkv[:, nh + nkv:]

    def finish_layer(self, layer: int, x: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """Output projection, residual, SwiGLU MLP, residual.

        x: [T, hidden] (layer input), attn: [T, nh*hd] -> [T, hidden].
        """
        w = self.layers[layer]
        x = x + F.linear(attn, w.w_o)
        h = F.rms_norm(x, (self.cfg.hidden_size,), w.mlp_norm, RMS_NORM_EPS)
        gate, up = F.linear(h, w.w_gate_up).chunk(2, dim=-1)        # [T, inter] each
        return x + F.linear(F.silu(gate) * up, w.w_down)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """x: [S, hidden] -> logits: [S, vocab] (final norm + LM head)."""
        h = F.rms_norm(x, (self.cfg.hidden_size,), self.final_norm, RMS_NORM_EPS)
        return F.linear(h, self.lm_head)

    @torch.inference_mode()
    def forward_dense(self, token_ids: torch.Tensor) -> torch.Tensor:
        """Reference: plain causal forward without a cache. token_ids: [1, S] -> logits [S, vocab]."""
        if token_ids.dim() != 2 or token_ids.shape[0] != 1:
            raise ValueError(f"token_ids must have shape [1, S], got {tuple(token_ids.shape)}")
        ids = token_ids[0].to(self.device)
        num_tokens = ids.shape[0]
        self.rope_tables(num_tokens)
        positions = torch.arange(num_tokens, device=self.device)
        x = self.embed(ids)                                          # [S, hidden]
        for layer in range(self.cfg.num_layers):
            q, k, v = self.qkv(layer, x, positions)
            o = F.scaled_dot_product_attention(
                q.transpose(0, 1).unsqueeze(0), k.transpose(0, 1).unsqueeze(0),
                v.transpose(0, 1).unsqueeze(0), is_causal=True, enable_gqa=True)  # [1, nh, S, hd]
            x = self.finish_layer(layer, x, o[0].transpose(0, 1).reshape(num_tokens, -1))
        return self.logits(x)

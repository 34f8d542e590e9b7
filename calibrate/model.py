"""A compact Llama-style decoder with random weights, for timing real kernels.

The weights are seeded noise (normal, std 0.02): the model computes nothing
useful, but every matmul, norm, RoPE and attention has the shape and dtype of
the real model, so it costs what the real model costs. Llama 3.1's RoPE
frequency scaling is not modelled; it changes values, not cost.

The model exposes its layers as pieces (``embed``, ``qkv``, ``finish_layer``,
``logits``) so that ``calibrate.engine.LiveEngine`` can run attention against
a paged KV cache between them; ``forward_dense`` is the plain reference.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from sim.presets import MODEL_PRESETS as SHAPE_PRESETS
from sim.profile import ModelShape

RMS_NORM_EPS = 1e-5
INIT_STD = 0.02


@dataclass(frozen=True)
class ModelConfig:
    """Shape of a Llama-style decoder. Validated on construction (ValueError)."""

    name: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    vocab_size: int
    max_position_embeddings: int = 4096
    rope_theta: float = 10000.0

    def __post_init__(self) -> None:
        for f in ("hidden_size", "num_layers", "num_heads", "num_kv_heads",
                  "intermediate_size", "vocab_size", "max_position_embeddings"):
            value = getattr(self, f)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"model {self.name!r}: {f} must be a positive integer, got {value!r}")
        if isinstance(self.rope_theta, bool) or not isinstance(self.rope_theta, (int, float)) \
                or self.rope_theta <= 0:
            raise ValueError(f"model {self.name!r}: rope_theta must be a positive number, "
                             f"got {self.rope_theta!r}")
        if self.hidden_size % self.num_heads:
            raise ValueError(f"model {self.name!r}: hidden_size {self.hidden_size} is not divisible "
                             f"by num_heads {self.num_heads}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"model {self.name!r}: num_heads {self.num_heads} is not divisible "
                             f"by num_kv_heads {self.num_kv_heads}")
        if self.head_dim % 2:
            raise ValueError(f"model {self.name!r}: head_dim {self.head_dim} must be even for RoPE")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def num_parameters(self) -> int:
        """Weights in the model (embedding and LM head untied)."""
        h, hd = self.hidden_size, self.head_dim
        qkv = h * (self.num_heads + 2 * self.num_kv_heads) * hd
        per_layer = qkv + self.num_heads * hd * h + 3 * h * self.intermediate_size + 2 * h
        return self.num_layers * per_layer + 2 * self.vocab_size * h + h

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """Bytes of K and V cache one token occupies over all layers."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype_bytes

    @classmethod
    def from_hf(cls, hf: Mapping[str, Any], name: str | None = None) -> ModelConfig:
        """Build from a Hugging Face ``config.json`` dict.

        Required: hidden_size, num_hidden_layers, num_attention_heads,
        intermediate_size, vocab_size. Optional, with HF's defaults:
        num_key_value_heads (= num_attention_heads), max_position_embeddings
        (4096), rope_theta (10000.0). A ``head_dim`` that differs from
        hidden_size / num_attention_heads is rejected. Raises ValueError
        naming the missing or bad field.
        """
        if not isinstance(hf, Mapping):
            raise ValueError(f"HF config must be a mapping, got {type(hf).__name__}")
        for f in ("hidden_size", "num_hidden_layers", "num_attention_heads",
                  "intermediate_size", "vocab_size"):
            if f not in hf:
                raise ValueError(f"HF config is missing required field {f!r}")
        label = name or str(hf.get("_name_or_path") or hf.get("model_type") or "hf-model")
        num_heads = hf["num_attention_heads"]
        cfg = cls(
            name=label,
            hidden_size=hf["hidden_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=hf.get("num_key_value_heads") or num_heads,
            intermediate_size=hf["intermediate_size"],
            vocab_size=hf["vocab_size"],
            max_position_embeddings=hf.get("max_position_embeddings", 4096),
            rope_theta=hf.get("rope_theta", 10000.0),
        )
        head_dim = hf.get("head_dim")
        if head_dim is not None and head_dim != cfg.head_dim:
            raise ValueError(f"HF config field 'head_dim' = {head_dim!r} differs from hidden_size / "
                             f"num_attention_heads = {cfg.head_dim}; not supported")
        return cfg


# RoPE base of the real models (a shape fact the cost model does not need).
ROPE_THETA = {"llama-3.1-8b": 500000.0, "llama-3.1-70b": 500000.0}


def _from_shape(shape: ModelShape) -> ModelConfig:
    return ModelConfig(shape.name, shape.hidden_size, shape.num_layers, shape.num_heads,
                       shape.num_kv_heads, shape.intermediate_size, shape.vocab_size,
                       shape.max_position_embeddings, ROPE_THETA.get(shape.name, 10000.0))


# Tiny models that run fast on 2 CPU cores, plus every Llama-style (SwiGLU)
# shape the roofline presets know, taken from sim.presets so the two never drift.
MODEL_PRESETS: dict[str, ModelConfig] = {
    "tiny-llama-2l": ModelConfig("tiny-llama-2l", 64, 2, 4, 2, 172, 512, 2048),
    "tiny-llama": ModelConfig("tiny-llama", 256, 4, 8, 4, 688, 4096, 4096),
    **{name: _from_shape(shape) for name, shape in SHAPE_PRESETS.items() if shape.mlp == "swiglu"},
}


def get_model_config(spec: str | Mapping[str, Any] | ModelConfig) -> ModelConfig:
    """A preset by name, an HF ``config.json`` dict, or a dict of ModelConfig fields."""
    if isinstance(spec, ModelConfig):
        return spec
    if isinstance(spec, str):
        if spec not in MODEL_PRESETS:
            raise ValueError(f"unknown model {spec!r}; presets: {', '.join(MODEL_PRESETS)}")
        return MODEL_PRESETS[spec]
    if isinstance(spec, Mapping):
        if "num_hidden_layers" in spec:
            return ModelConfig.from_hf(spec)
        allowed = [f.name for f in dataclasses.fields(ModelConfig)]
        unknown = sorted(set(spec) - set(allowed))
        if unknown:
            raise ValueError(f"unknown model field(s) {unknown}; allowed: {', '.join(allowed)}")
        missing = [f.name for f in dataclasses.fields(ModelConfig)
                   if f.default is dataclasses.MISSING and f.name not in spec]
        if missing:
            raise ValueError(f"model config is missing field(s) {missing}")
        return ModelConfig(**spec)
    raise ValueError(f"model must be a preset name or a dict, got {type(spec).__name__}")


class DecoderLayer(nn.Module):
    """Weights of one layer: fused QKV, output projection, fused gate/up, down."""

    def __init__(self, cfg: ModelConfig, device: torch.device, dtype: torch.dtype) -> None:
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
    the same (config, device, dtype, seed) gives the same weights.
    """

    def __init__(self, cfg: ModelConfig, device: str | torch.device = "cpu",
                 dtype: torch.dtype = torch.float32, seed: int = 0) -> None:
        super().__init__()
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
        self.lm_head = nn.Parameter(torch.empty(cfg.vocab_size, h, **kw), requires_grad=False)
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

"""HF ``config.json`` -> ``ModelShape``: the one importer, for the roofline and the torch model alike.

Beyond the dense Llama fields it reads an explicit ``head_dim`` (Qwen3, gpt-oss, Gemma), which
layers slide (``sliding_layer_count``) and the mixture-of-experts fields (``moe_fields``).
Qwen3's q_norm / k_norm (implied by model_type qwen3*, no config flag) cost nothing to model
and are accepted as is. Multi-head latent attention (DeepSeek-V2/V3's ``kv_lora_rank``) is
refused: its KV cache is a latent vector, not K and V heads.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import MISSING, fields
from typing import Any

from sim.cost.shape import ModelShape

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
# Spellings of the expert count and the routing width across model families.
_EXPERT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")
_TOP_K_KEYS = ("num_experts_per_tok", "experts_per_token", "num_experts_per_token")


def _positive_int(cfg: Mapping[str, Any], key: str, name: str) -> int:
    value = cfg[key]
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"model '{name}': field '{key}' must be a positive integer, got {value!r}")
    return value


def _first(cfg: Mapping[str, Any], keys: tuple[str, ...]) -> str | None:
    return next((k for k in keys if cfg.get(k) is not None), None)


# Families whose MLP is gated with a GELU (GeGLU: gate, up and down projections): three matrices,
# costed as "swiglu" (the kind names the gated 3-matrix shape, not the activation).
_GATED_GELU_MODEL_TYPES = {"gemma", "gemma2", "gemma3", "gemma3_text"}


def _mlp_kind(cfg: Mapping[str, Any], name: str) -> str:
    """batchsim's ``mlp`` key as given, else the kind hidden_act (or OPT's activation_function) implies;
    Gemma's gated GELU MLP (``_GATED_GELU_MODEL_TYPES``) is the gated 3-matrix kind."""
    if "mlp" in cfg:
        return str(cfg["mlp"])                    # ModelShape checks it is one of MLP_KINDS
    if str(cfg.get("model_type", "")) in _GATED_GELU_MODEL_TYPES:
        return "swiglu"
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


def sliding_layer_count(cfg: Mapping[str, Any], num_layers: int, name: str) -> tuple[int, int]:
    """(window, number of sliding layers) of a HF config; (0, 0) without sliding windows.

    In order: ``layer_types`` (gpt-oss, Gemma 3, newer transformers) counts its
    "sliding_attention" entries; ``use_sliding_window: false`` (Qwen2/Qwen3) means none;
    Qwen2's ``use_sliding_window: true`` slides the layers from ``max_window_layers`` on;
    Gemma 2 (model_type gemma2) slides every other layer (the even ones);
    ``sliding_window_pattern`` N (Gemma 3) makes every N-th layer global, the rest
    local (5 local : 1 global for N = 6); otherwise a set ``sliding_window``
    (Mistral v0.1's 4096, Phi-3) slides every layer.
    """
    window = cfg.get("sliding_window")
    if window is None or window is False:
        return 0, 0
    if isinstance(window, bool) or not isinstance(window, int) or window <= 0:
        raise ValueError(f"model '{name}': field 'sliding_window' must be a positive integer or null, got {window!r}")
    types = cfg.get("layer_types")
    if types is not None:
        if not isinstance(types, list) or len(types) != num_layers:
            raise ValueError(f"model '{name}': field 'layer_types' must list one type per layer "
                             f"({num_layers}), got {types!r}")
        count = sum(1 for t in types if t == "sliding_attention")
        return (window, count) if count else (0, 0)
    use = cfg.get("use_sliding_window")
    if use is False:
        return 0, 0
    if use is True and cfg.get("max_window_layers") is not None:
        count = max(0, num_layers - int(cfg["max_window_layers"]))
        return (window, count) if count else (0, 0)
    if str(cfg.get("model_type", "")) == "gemma2":
        return window, (num_layers + 1) // 2
    pattern = cfg.get("sliding_window_pattern")
    if pattern is not None:
        if isinstance(pattern, bool) or not isinstance(pattern, int) or pattern <= 0:
            raise ValueError(f"model '{name}': field 'sliding_window_pattern' must be a positive integer, "
                             f"got {pattern!r}")
        count = num_layers - num_layers // pattern        # layer i is global when (i + 1) % pattern == 0
        return (window, count) if count else (0, 0)
    return window, num_layers


def moe_fields(cfg: Mapping[str, Any], num_layers: int, name: str) -> dict[str, int]:
    """ModelShape's MoE fields from a HF config ({} for a dense model).

    Experts: num_experts (Qwen), num_local_experts (Mixtral, gpt-oss) or n_routed_experts
    (DeepSeek); top-k: num_experts_per_tok or experts_per_token (gpt-oss). Expert width:
    moe_intermediate_size (Qwen-MoE, DeepSeek), else intermediate_size (Mixtral, gpt-oss).
    Shared experts: n_shared_experts x moe_intermediate_size (DeepSeek) or
    shared_expert_intermediate_size (Qwen2-MoE). Dense layers: first_k_dense_replace
    (DeepSeek), or Qwen's mlp_only_layers and decoder_sparse_step (layer i is sparse when
    i is not in mlp_only_layers and (i + 1) % decoder_sparse_step == 0).
    """
    e_key = _first(cfg, _EXPERT_KEYS)
    if e_key is None:
        return {}
    num_experts = _positive_int(cfg, e_key, name)
    k_key = _first(cfg, _TOP_K_KEYS)
    if k_key is None:
        raise ValueError(f"model '{name}': field '{e_key}' is set but the routing width is missing "
                         f"(num_experts_per_tok or experts_per_token)")
    out = {"num_experts": num_experts, "num_experts_per_tok": _positive_int(cfg, k_key, name)}
    if cfg.get("moe_intermediate_size") is not None:
        out["moe_intermediate_size"] = _positive_int(cfg, "moe_intermediate_size", name)
    if cfg.get("shared_expert_intermediate_size"):
        out["shared_expert_intermediate_size"] = _positive_int(cfg, "shared_expert_intermediate_size", name)
    elif cfg.get("n_shared_experts"):
        width = out.get("moe_intermediate_size") or _positive_int(cfg, "intermediate_size", name)
        out["shared_expert_intermediate_size"] = _positive_int(cfg, "n_shared_experts", name) * width
    if cfg.get("first_k_dense_replace"):
        out["num_dense_layers"] = _positive_int(cfg, "first_k_dense_replace", name)
    else:
        only = cfg.get("mlp_only_layers") or []
        step = cfg.get("decoder_sparse_step") or 1
        if not isinstance(only, list) or isinstance(step, bool) or not isinstance(step, int) or step < 1:
            raise ValueError(f"model '{name}': fields 'mlp_only_layers' (a list of layer indices) and "
                             f"'decoder_sparse_step' (an integer >= 1) got {only!r} and {step!r}")
        num_dense = sum(1 for i in range(num_layers) if i in only or (i + 1) % step)
        if num_dense:
            # NOTE: counted as "the first num_dense layers"; which layers they are changes no cost.
            out["num_dense_layers"] = num_dense
    return out


def model_shape_from_hf(cfg: Mapping[str, Any], name: str | None = None) -> ModelShape:
    """A ``ModelShape`` from HF ``config.json`` fields.

    Required (no default, since a wrong guess changes costs or memory silently):
    hidden_size, num_hidden_layers, num_attention_heads, intermediate_size (or
    ffn_dim), vocab_size, max_position_embeddings, and the MLP kind: hidden_act
    (or activation_function, OPT) -- silu/swish means a gated 3-matrix MLP
    ("swiglu"), anything else a 2-matrix one ("gelu") -- or batchsim's own
    ``mlp`` key. Optional: num_key_value_heads (default: the number of heads);
    tie_word_embeddings (default True, as in HF's PretrainedConfig); rope_theta,
    or rope_parameters.rope_theta as transformers 5 writes it (default 10000.0);
    head_dim (default hidden_size / num_attention_heads); sliding windows
    (``sliding_layer_count``); MoE fields (``moe_fields``). ``name`` defaults to
    the config's ``name`` or ``_name_or_path``, else "custom". Raises ValueError
    naming the missing or bad field.
    """
    if not isinstance(cfg, Mapping):
        raise ValueError(f"model '{name}': expected a mapping of config fields, got {type(cfg).__name__}")
    name = name or str(cfg.get("name") or cfg.get("_name_or_path") or "custom")
    if cfg.get("kv_lora_rank") is not None:
        raise ValueError(f"model '{name}': field 'kv_lora_rank' means multi-head latent attention (DeepSeek "
                         f"MLA), whose KV cache batchsim does not model; use a model with K/V heads")
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
    head_dim = _positive_int(cfg, "head_dim", name) if cfg.get("head_dim") is not None else 0
    window, num_sliding = sliding_layer_count(cfg, values["num_layers"], name)
    return ModelShape(name=name, num_kv_heads=num_kv_heads, mlp=_mlp_kind(cfg, name),
                      tie_word_embeddings=bool(cfg.get("tie_word_embeddings", True)),
                      rope_theta=rope_theta, explicit_head_dim=head_dim, sliding_window=window,
                      num_sliding_layers=num_sliding, **moe_fields(cfg, values["num_layers"], name), **values)


def model_shape_from_dict(spec: Mapping[str, Any]) -> ModelShape:
    """A ModelShape from HF ``config.json`` fields (a dict with
    ``num_hidden_layers``: ``model_shape_from_hf``) or from ModelShape's own
    fields, as a profile file's ``model`` section holds them (their defaults
    apply). Unknown or missing own fields are a ValueError that lists them."""
    if "num_hidden_layers" in spec:
        return model_shape_from_hf(spec)
    if "head_dim" in spec:                   # the file's spelling of explicit_head_dim
        spec = {**{k: v for k, v in spec.items() if k != "head_dim"}, "explicit_head_dim": spec["head_dim"] or 0}
    allowed = [f.name for f in fields(ModelShape)]
    unknown = sorted(set(spec) - set(allowed))
    if unknown:
        raise ValueError(f"unknown model field(s) {unknown}; allowed: {', '.join(allowed)}")
    missing = [f.name for f in fields(ModelShape) if f.default is MISSING and f.name not in spec]
    if missing:
        raise ValueError(f"model config is missing field(s) {missing}")
    return ModelShape(**spec)

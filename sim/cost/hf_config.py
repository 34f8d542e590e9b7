"""HF ``config.json`` -> ``ModelShape``: the one importer, for the roofline and the torch model alike.

Beyond the dense Llama fields it reads an explicit ``head_dim`` (Qwen3, gpt-oss, Gemma), which
layers slide (``sliding_layer_count``) and the mixture-of-experts fields (``moe_fields``).
Qwen3's q_norm / k_norm (implied by model_type qwen3*, no config flag) cost nothing to model
and are accepted as is. Mechanisms that change the architecture and that batchsim does not
model (``UNMODELLED_MECHANISMS``: compressed sparse attention, latent MoE, state-space layers
outside Nemotron-H; ...) are refused by name. Gated DeltaNet (Qwen3.5, Qwen3-Next:
``linear_attention_fields``) and Nemotron-H's Mamba2 and single-block layers (``mamba_fields``)
are read. Multi-head latent attention (DeepSeek-V3/R1, Kimi-K2) is read
from ``kv_lora_rank``, ``q_lora_rank``, ``qk_nope_head_dim``, ``qk_rope_head_dim`` and
``v_head_dim``, DeepSeek sparse attention (DeepSeek-V3.2, GLM-5) from ``index_topk``,
``index_head_dim`` and ``index_n_heads`` (``ModelShape``'s class doc). A multimodal config's language model (``text_config``: Kimi-K2.5,
Qwen3.5) is read in its place; its vision tower is left out (``language_model_config``).

Read strictly: a field batchsim reads must have its type (a boolean is true or false, not the
string "false"; a count a positive integer), an enumerated value is matched case-insensitively or
refused, and a key batchsim does not know that is one letter or two away from one it reads, the
one it reads being absent (``num_key_value_head``), gets a did-you-mean warning: left unread, it
would quietly mean the default (there: full multi-head attention, 4x the KV cache of 8 KV heads).
"""

from __future__ import annotations

import difflib
import warnings
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
# What a config's fields say about mechanisms batchsim does not model yet (one line each): the one
# table, which sim.cost.kernel_models reads too for the configs the kernel tables' wheel bundles.
UNMODELLED_MECHANISMS = (
    ("compress_ratios", "compressed sparse attention (DeepSeek-V4)"),
    ("moe_latent_size", "latent MoE projections (Nemotron-3 Super, Ultra)"),
    # read for Nemotron-H (model_type nemotron_h, as vLLM's nemotron_h.py reads them: mamba_fields) only
    ("hybrid_override_pattern", "hybrid Mamba2 state-space layers outside Nemotron-H (model_type nemotron_h)"),
    ("layers_block_type", "hybrid state-space / linear-attention layers"),
    ("block_configs", "per-layer heterogeneous blocks (Nemotron NAS)"),
    ("interleave_moe_layer_step", "interleaved MoE and chunked-attention layers (Llama 4)"),
)
WRAPPER_KEYS = ("text_config", "llm_config")       # a multimodal config's language model
# layer_types entries: the two batchsim prices (lower case, as transformers writes them).
LAYER_TYPES = ("full_attention", "sliding_attention", "linear_attention")
# Gated DeltaNet's config keys (Qwen3-Next, Qwen3.5) -> ModelShape's fields.
_LINEAR_KEYS = ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim",
                "linear_conv_kernel_dim")
# The multi-token-prediction layers a checkpoint ships: DeepSeek-V3/R1, GLM-5, Kimi-K2; Qwen3-Next, Qwen3.5.
_MTP_KEYS = ("num_nextn_predict_layers", "mtp_num_hidden_layers")
# mamba_ssm_dtype (Qwen3.5's recurrent-state dtype, which vLLM takes for mamba_ssm_cache_dtype "auto").
_STATE_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
# Nemotron-H's mixers and MLPs, one a layer: hybrid_override_pattern's letters (vLLM's
# ALL_DECODER_LAYER_TYPES, vllm/model_executor/models/nemotron_h.py) and layers_block_type's words.
_NEMOTRON_BLOCKS = {"M": "mamba", "*": "attention", "-": "mlp", "E": "moe"}
_MAMBA_KEYS = {"mamba_num_heads": "mamba_num_heads", "mamba_head_dim": "mamba_head_dim", "n_groups": "mamba_n_groups",
               "ssm_state_size": "mamba_state_size", "conv_kernel": "mamba_conv_kernel",
               "chunk_size": "mamba_chunk_size"}
# vLLM's NemotronHForCausalLMConfig.DEFAULT_MAMBA_SSM_CACHE_DTYPE (vllm/model_executor/models/config.py).
NEMOTRON_H_SSM_DTYPE = "float32"
_REQUIRED_KEYS = frozenset(k for keys in _HF_FIELDS.values() for k in keys)
# Every key the importer reads (one set for the did-you-mean check of unknown keys).
READ_KEYS = frozenset({k for keys in _HF_FIELDS.values() for k in keys} | set(_EXPERT_KEYS) | set(_TOP_K_KEYS) | {
    "num_key_value_heads", "num_kv_heads", "head_dim", "hidden_act", "activation_function", "mlp", "model_type",
    "tie_word_embeddings", "rope_theta", "rope_parameters", "sliding_window", "layer_types", "use_sliding_window",
    "max_window_layers", "sliding_window_pattern", "moe_intermediate_size", "shared_expert_intermediate_size",
    "n_shared_experts", "first_k_dense_replace", "mlp_only_layers", "decoder_sparse_step", "quantization_config",
    *_LINEAR_KEYS, "full_attention_interval", "mamba_ssm_dtype", "attn_output_gate", *_MTP_KEYS,
    "name", "_name_or_path", "kv_lora_rank", "q_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
    "index_topk", "index_head_dim", "index_n_heads", "hybrid_override_pattern", "layers_block_type", *_MAMBA_KEYS,
    "mamba_ssm_cache_dtype", "mlp_hidden_act", "attention_head_dim", "moe_shared_expert_intermediate_size",
    "moe_latent_size",
    # grouped expert routing (DeepSeek-V3, Nemotron-3): costs nothing, accepted as is; named here so that
    # DeepSeek's n_group is not taken for a misspelt n_groups (Mamba2's B/C groups)
    "n_group", "topk_group"})
_MLA_KEYS = ("kv_lora_rank", "q_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "index_topk",
             "index_head_dim", "index_n_heads")


def language_model_config(cfg: Mapping[str, Any]) -> tuple[dict[str, Any], str | None]:
    """The decoder's config: ``cfg``, or the language model a multimodal config wraps (its
    ``text_config`` or ``llm_config``, when the outer config has no ``hidden_size``), with a
    one-line note that the vision tower is left out (None when nothing was unwrapped)."""
    for key in WRAPPER_KEYS:
        inner = cfg.get(key)
        if isinstance(inner, Mapping) and "hidden_size" not in cfg:
            merged = {**inner, "name": cfg.get("name") or inner.get("name"),
                      "architectures": cfg.get("architectures") or inner.get("architectures")}
            if "quantization_config" in cfg and "quantization_config" not in inner:
                merged["quantization_config"] = cfg["quantization_config"]
            if cfg.get("tie_word_embeddings") is not None:     # the composite model's own (Qwen3.5 writes it there)
                merged["tie_word_embeddings"] = cfg["tie_word_embeddings"]
            return merged, f"the language model of {cfg.get('name') or 'the config'} ({key}); its vision tower is left out"
    return dict(cfg), None


def unmodelled_mechanism(cfg: Mapping[str, Any]) -> str | None:
    """The first mechanism of ``cfg`` (or of its wrapped language model) batchsim cannot price."""
    for inner in (cfg, *(cfg[k] for k in WRAPPER_KEYS if isinstance(cfg.get(k), Mapping))):
        nemotron_h = str(inner.get("model_type", "")).lower() == "nemotron_h"
        for key, mechanism in UNMODELLED_MECHANISMS:
            if key in ("hybrid_override_pattern", "layers_block_type") and nemotron_h:
                continue                 # Nemotron-H's layer pattern (mamba_fields)
            if inner.get(key) is not None:
                return mechanism
        if any("mamba" in str(t) for t in _as_list(inner.get("layer_types"))):
            return "hybrid Mamba2 state-space layers"
        if inner.get("layer_types") is not None and all(
                "linear" in str(t) for t in _as_list(inner.get("layer_types"))):
            return "linear attention in every layer (attention-free models)"
    return None


def _as_list(value: Any) -> list[Any]:
    return value if isinstance(value, list) else []


def warn_unknown_keys(cfg: Mapping[str, Any], name: str) -> None:
    """A did-you-mean warning for each key batchsim does not read that is close to one it reads
    (difflib ratio >= 0.9: a letter or two) while that one is absent: a misspelt field would
    silently mean its default."""
    for key in cfg:
        if not isinstance(key, str) or key in READ_KEYS:
            continue
        close = difflib.get_close_matches(key, READ_KEYS, n=1, cutoff=0.9)
        if close and close[0] not in cfg and close[0] not in _REQUIRED_KEYS:    # (a missing one is refused)
            warnings.warn(f"model '{name}': config field '{key}' is not one batchsim reads (did you mean "
                          f"'{close[0]}'?); without it, {close[0]} takes its default", stacklevel=3)


def _boolean(cfg: Mapping[str, Any], key: str, name: str, default: bool) -> bool:
    """A JSON boolean field (null or absent: ``default``); the string "false" is refused, not read as true."""
    value = cfg.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise ValueError(f"model '{name}': field '{key}' must be true or false, got {value!r}")
    return value


def _count(cfg: Mapping[str, Any], key: str, name: str, least: int) -> int | None:
    """An integer field >= ``least`` (None: null or absent)."""
    value = cfg.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        what = "a positive integer" if least == 1 else f"an integer >= {least}"
        raise ValueError(f"model '{name}': field '{key}' must be {what}, got {value!r}")
    return value


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
        return str(cfg["mlp"]).lower()            # ModelShape checks it is one of MLP_KINDS
    if str(cfg.get("model_type", "")).lower() in _GATED_GELU_MODEL_TYPES:
        return "swiglu"
    act = cfg.get("hidden_act", cfg.get("activation_function", cfg.get("mlp_hidden_act")))
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
    types = _layer_types(cfg, num_layers, name)
    use = cfg.get("use_sliding_window")
    if use is not None and not isinstance(use, bool):
        raise ValueError(f"model '{name}': field 'use_sliding_window' must be true or false, got {use!r}")
    max_window_layers = _count(cfg, "max_window_layers", name, 0)
    window = cfg.get("sliding_window")
    if window is None or window is False:
        return 0, 0
    if isinstance(window, bool) or not isinstance(window, int) or window <= 0:
        raise ValueError(f"model '{name}': field 'sliding_window' must be a positive integer or null, got {window!r}")
    if types is not None:
        count = types.count("sliding_attention")
        return (window, count) if count else (0, 0)
    if use is False:
        return 0, 0
    if use is True and max_window_layers is not None:
        count = max(0, num_layers - max_window_layers)
        return (window, count) if count else (0, 0)
    if str(cfg.get("model_type", "")).lower() == "gemma2":
        return window, (num_layers + 1) // 2
    pattern = cfg.get("sliding_window_pattern")
    if pattern is not None:
        if isinstance(pattern, bool) or not isinstance(pattern, int) or pattern <= 0:
            raise ValueError(f"model '{name}': field 'sliding_window_pattern' must be a positive integer, "
                             f"got {pattern!r}")
        count = num_layers - num_layers // pattern        # layer i is global when (i + 1) % pattern == 0
        return (window, count) if count else (0, 0)
    return window, num_layers


def _layer_types(cfg: Mapping[str, Any], num_layers: int, name: str) -> list[str] | None:
    """``layer_types``, one of ``LAYER_TYPES`` per layer (any case), or None when absent."""
    types = cfg.get("layer_types")
    if types is None:
        return None
    if not isinstance(types, list) or len(types) != num_layers or not all(isinstance(t, str) for t in types):
        raise ValueError(f"model '{name}': field 'layer_types' must list one type per layer "
                         f"({num_layers}), got {types!r}")
    types = [t.lower() for t in types]
    other = next((t for t in types if t not in LAYER_TYPES), None)
    if other is not None:
        raise ValueError(f"model '{name}': field 'layer_types' has layers of type {other!r}, which batchsim does "
                         f"not model; it prices {' and '.join(LAYER_TYPES)} layers")
    return types


def linear_attention_fields(cfg: Mapping[str, Any], num_layers: int, name: str) -> dict[str, int]:
    """ModelShape's Gated DeltaNet fields ({} without linear layers), as vLLM's Qwen3-Next and
    Qwen3.5 models read them: the linear layers are ``layer_types``' "linear_attention" entries,
    else (Qwen3-Next) all but every ``full_attention_interval``-th layer; the heads and widths
    from ``linear_*`` (all required); the recurrent state's dtype from ``mamba_ssm_dtype``
    (Qwen3.5; absent: the model's dtype, vLLM's "auto"); ``attn_output_gate`` (absent: true, as
    both models' attention reads it)."""
    types = _layer_types(cfg, num_layers, name)
    interval = _count(cfg, "full_attention_interval", name, 1)
    if types is not None:
        num_linear = types.count("linear_attention")
    elif interval is not None and any(cfg.get(k) is not None for k in _LINEAR_KEYS):
        num_linear = num_layers - num_layers // interval     # layer i is full when (i + 1) % interval == 0
    else:
        given = next((k for k in _LINEAR_KEYS if cfg.get(k) is not None), None)
        if given is not None:
            raise ValueError(f"model '{name}': field '{given}' describes linear-attention layers, but neither "
                             f"'layer_types' nor 'full_attention_interval' says which layers they are")
        num_linear = 0
    if not num_linear:
        gate = _boolean(cfg, "attn_output_gate", name, False)
        return {"attn_output_gate": int(gate)} if gate else {}
    out = {"num_linear_layers": num_linear}
    for key in _LINEAR_KEYS:
        value = _count(cfg, key, name, 1)
        if value is None:
            raise ValueError(f"model '{name}': config field '{key}' is missing (its linear-attention layers need it)")
        out[key] = value
    dtype = cfg.get("mamba_ssm_dtype")
    if dtype is not None:
        if str(dtype).lower() not in _STATE_DTYPE_BYTES:
            raise ValueError(f"model '{name}': field 'mamba_ssm_dtype' must be one of "
                             f"{', '.join(_STATE_DTYPE_BYTES)}, got {dtype!r}")
        out["linear_state_bytes"] = _STATE_DTYPE_BYTES[str(dtype).lower()]
    out["attn_output_gate"] = int(_boolean(cfg, "attn_output_gate", name, True))
    return out


def nemotron_blocks(cfg: Mapping[str, Any], num_layers: int, name: str) -> list[str] | None:
    """Nemotron-H's layers, one block each ("mamba", "attention", "mlp" or "moe"), from
    ``hybrid_override_pattern`` (a letter a layer: M, *, - or E, as vLLM's NemotronHModel reads
    it) or ``layers_block_type`` (Nemotron-3.5: a word a layer); None when neither is given."""
    pattern, words = cfg.get("hybrid_override_pattern"), cfg.get("layers_block_type")
    if pattern is not None and words is not None:
        raise ValueError(f"model '{name}': fields 'hybrid_override_pattern' and 'layers_block_type' both given; "
                         f"give one")
    if pattern is not None:
        if not isinstance(pattern, str) or len(pattern) != num_layers:
            raise ValueError(f"model '{name}': field 'hybrid_override_pattern' must be a string of one letter a "
                             f"layer ({num_layers}, num_hidden_layers), got {pattern!r}")
        other = next((c for c in pattern if c not in _NEMOTRON_BLOCKS), None)
        if other is not None:
            raise ValueError(f"model '{name}': field 'hybrid_override_pattern' has a layer {other!r}; expected "
                             f"M (Mamba2), * (attention), - (MLP) or E (MoE)")
        return [_NEMOTRON_BLOCKS[c] for c in pattern]
    if words is not None:
        kinds = set(_NEMOTRON_BLOCKS.values())
        if (not isinstance(words, list) or len(words) != num_layers
                or not all(isinstance(w, str) and w.lower() in kinds for w in words)):
            raise ValueError(f"model '{name}': field 'layers_block_type' must list one of "
                             f"{', '.join(sorted(kinds))} a layer ({num_layers}, num_hidden_layers), got {words!r}")
        return [w.lower() for w in words]
    return None


def mamba_fields(cfg: Mapping[str, Any], num_layers: int, name: str, moe: Mapping[str, int]) -> dict[str, int]:
    """ModelShape's single-block and Mamba2 fields of a Nemotron-H config ({} for any other), as
    vLLM 0.32's ``nemotron_h.py`` builds the model: one block a layer (``nemotron_blocks``);
    ``num_ffn_layers`` the MLP and MoE ones, ``num_dense_layers`` the MLP ones of an MoE model;
    the Mamba2 mixers' shape from ``mamba_num_heads``, ``mamba_head_dim``, ``n_groups``,
    ``ssm_state_size``, ``conv_kernel`` and ``chunk_size`` (all required); the SSM state's dtype
    from ``mamba_ssm_cache_dtype``, absent: float32 (vLLM's NemotronHForCausalLMConfig,
    ``vllm/model_executor/models/config.py``, sets it so when mamba_ssm_cache_dtype is "auto")."""
    blocks = nemotron_blocks(cfg, num_layers, name)
    if blocks is None:
        return {}
    if "moe" in blocks and not moe:
        raise ValueError(f"model '{name}': its layers include MoE (E) blocks, but the config names no experts "
                         f"(n_routed_experts)")
    if moe and "moe" not in blocks:
        raise ValueError(f"model '{name}': the config names experts but no layer is an MoE (E) block")
    out = {"num_ffn_layers": blocks.count("mlp") + blocks.count("moe"), "num_mamba_layers": blocks.count("mamba")}
    if moe:
        out["num_dense_layers"] = blocks.count("mlp")
    if not blocks.count("attention"):
        raise ValueError(f"model '{name}': no layer of its pattern attends (attention-free models are not modelled)")
    if out["num_mamba_layers"]:
        for key, field in _MAMBA_KEYS.items():
            value = _count(cfg, key, name, 1)
            if value is None:
                raise ValueError(f"model '{name}': config field '{key}' is missing (its Mamba2 layers need it)")
            out[field] = value
        dtype = cfg.get("mamba_ssm_cache_dtype") or NEMOTRON_H_SSM_DTYPE
        if str(dtype).lower() not in _STATE_DTYPE_BYTES:
            raise ValueError(f"model '{name}': field 'mamba_ssm_cache_dtype' must be one of "
                             f"{', '.join(_STATE_DTYPE_BYTES)}, got {dtype!r}")
        out["mamba_state_bytes"] = _STATE_DTYPE_BYTES[str(dtype).lower()]
    return out


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
    shared_width, num_shared = (_count(cfg, k, name, 0) for k in ("shared_expert_intermediate_size", "n_shared_experts"))
    shared_each = _count(cfg, "moe_shared_expert_intermediate_size", name, 1)
    if shared_width:
        out["shared_expert_intermediate_size"] = shared_width
    elif shared_each and num_shared:          # Nemotron-H: each shared expert's width x their number
        out["shared_expert_intermediate_size"] = num_shared * shared_each
    elif num_shared:
        width = out.get("moe_intermediate_size") or _positive_int(cfg, "intermediate_size", name)
        out["shared_expert_intermediate_size"] = num_shared * width
    first_dense = _count(cfg, "first_k_dense_replace", name, 0)
    if first_dense:
        out["num_dense_layers"] = first_dense
    else:
        only = cfg.get("mlp_only_layers") or []
        step = _count(cfg, "decoder_sparse_step", name, 1) or 1
        if not isinstance(only, list) or not all(isinstance(i, int) and not isinstance(i, bool)
                                                 and 0 <= i < num_layers for i in only):
            raise ValueError(f"model '{name}': field 'mlp_only_layers' must list layer indices in [0, "
                             f"{num_layers}), got {only!r}")
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
    mechanism = unmodelled_mechanism(cfg)
    if mechanism is not None:                   # sim.cost.kernel_models says it in the same words
        raise ValueError(f"model {name!r} uses {mechanism}, which batchsim does not model yet")
    cfg, _ = language_model_config(cfg)
    warn_unknown_keys(cfg, name)
    values: dict[str, int] = {}
    for field_name, keys in _HF_FIELDS.items():
        key = next((k for k in keys if k in cfg), None)
        if key is None and field_name == "intermediate_size" and cfg.get("moe_intermediate_size") is not None:
            continue                  # every layer MoE (Qwen3.5): no dense width; checked below
        if key is None:
            close = next((k for k in cfg if isinstance(k, str) and k not in READ_KEYS
                          and difflib.get_close_matches(k, keys, n=1, cutoff=0.9)), None)
            raise ValueError(f"model '{name}': config field '{keys[0]}' is missing"
                             + (f" (or '{keys[1]}')" if len(keys) > 1 else "")
                             + (f"; the config has '{close}': a typo of it?" if close else ""))
        values[field_name] = _positive_int(cfg, key, name)
    kv_key = next((k for k in ("num_key_value_heads", "num_kv_heads") if cfg.get(k) is not None), None)
    num_kv_heads = _positive_int(cfg, kv_key, name) if kv_key else values["num_heads"]
    rope_parameters = cfg.get("rope_parameters") or {}
    if not isinstance(rope_parameters, Mapping):
        raise ValueError(f"model '{name}': field 'rope_parameters' must be a mapping (rope_theta, rope_type, ...), "
                         f"got {rope_parameters!r}")
    rope_theta = cfg.get("rope_theta")
    if rope_theta is None:
        rope_theta = rope_parameters.get("rope_theta", 10000.0)
    head_dim = _positive_int(cfg, "head_dim", name) if cfg.get("head_dim") is not None else 0
    if cfg.get("attention_head_dim") is not None:          # Nemotron-H-8B/47B/56B's spelling of head_dim
        spelt = _positive_int(cfg, "attention_head_dim", name)
        if head_dim and head_dim != spelt:
            raise ValueError(f"model '{name}': fields 'head_dim' ({head_dim}) and 'attention_head_dim' ({spelt}) "
                             f"disagree")
        head_dim = spelt
    window, num_sliding = sliding_layer_count(cfg, values["num_layers"], name)
    mla = {k: _count(cfg, k, name, 0) or 0 for k in _MLA_KEYS}
    moe = moe_fields(cfg, values["num_layers"], name)
    mamba = mamba_fields(cfg, values["num_layers"], name, moe)      # Nemotron-H's blocks ({} otherwise)
    mtp = next((_count(cfg, k, name, 0) for k in _MTP_KEYS if cfg.get(k) is not None), 0) or 0
    moe = {**moe, **mamba}            # (mamba_fields' num_dense_layers: the MLP blocks of an MoE model)
    if "intermediate_size" not in values:
        if not moe or moe.get("num_dense_layers"):
            raise ValueError(f"model '{name}': config field 'intermediate_size' is missing (or 'ffn_dim'); "
                             f"only a model whose every layer is MoE may leave it out")
        values["intermediate_size"] = moe["moe_intermediate_size"]        # no dense MLP reads it
    return ModelShape(name=name, num_kv_heads=num_kv_heads, mlp=_mlp_kind(cfg, name), **mla,
                      **({} if mamba else linear_attention_fields(cfg, values["num_layers"], name)),
                      tie_word_embeddings=_boolean(cfg, "tie_word_embeddings", name, True),
                      rope_theta=rope_theta, explicit_head_dim=head_dim, sliding_window=window,
                      num_sliding_layers=num_sliding, num_mtp_layers=mtp, **moe, **values)


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

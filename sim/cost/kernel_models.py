"""The models of a kernel profile (``sim.cost.kernels``): a preset, a Hugging Face id the
aiconfigurator-core wheel bundles, or an HF config mapping, resolved to the config batchsim
reads its shape and memory from and to what the wheel builds its op graph from (never
fetched from the Hub); the mechanisms batchsim cannot price yet, refused by name; and the
wheel's quant modes for batchsim's number formats.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sim.cost import aic
from sim.cost.aic import KernelsError
from sim.cost.hf_config import language_model_config, unmodelled_mechanism   # the importer's own


# ---- models -----------------------------------------------------------------------------
# batchsim presets whose exact config the wheel bundles (Llama 3.3 70B has Llama 3.1 70B's).
PRESET_IDS = {
    "llama-3.1-8b": "meta-llama/Meta-Llama-3.1-8B", "llama-3.1-70b": "meta-llama/Meta-Llama-3.1-70B",
    "llama-3.3-70b": "meta-llama/Meta-Llama-3.1-70B", "qwen3-8b": "Qwen/Qwen3-8B", "qwen3-32b": "Qwen/Qwen3-32B",
    "qwen3-30b-a3b": "Qwen/Qwen3-30B-A3B", "qwen3-235b-a22b": "Qwen/Qwen3-235B-A22B",
    "mixtral-8x7b": "mistralai/Mixtral-8x7B-v0.1", "gpt-oss-20b": "openai/gpt-oss-20b",
    "gpt-oss-120b": "openai/gpt-oss-120b", "deepseek-r1": "deepseek-ai/DeepSeek-R1",
    "deepseek-v3": "deepseek-ai/DeepSeek-V3", "kimi-k2.5": "moonshotai/Kimi-K2.5",
    "deepseek-v3.2": "deepseek-ai/DeepSeek-V3.2", "glm-5": "zai-org/GLM-5", "minimax-m2.5": "MiniMaxAI/MiniMax-M2.5",
    "qwen3.5-397b-a17b": "Qwen/Qwen3.5-397B-A17B",
}
# Presets the wheel bundles no config of: the architecture its graph builder reads them as
# (Mistral's decoder is Llama's; Qwen3 dense adds the QK norms).
PRESET_ARCHITECTURES = {
    "llama-2-7b": "LlamaForCausalLM", "llama-2-13b": "LlamaForCausalLM", "mistral-7b": "LlamaForCausalLM",
    "mistral-small-24b": "LlamaForCausalLM", "qwen3-14b": "Qwen3ForCausalLM",
}


def preset_hf_config(name: str) -> dict[str, Any]:
    """The HF config.json fields of a dense preset (``MODEL_PRESETS``) the wheel bundles no config
    of, as its graph builder reads them; ``model_shape_from_hf`` gives the preset back."""
    from sim.cost.presets import MODEL_PRESETS
    m = MODEL_PRESETS[name]
    return {"name": name, "architectures": [PRESET_ARCHITECTURES[name]], "hidden_size": m.hidden_size,
            "num_hidden_layers": m.num_layers, "num_attention_heads": m.num_heads,
            "num_key_value_heads": m.num_kv_heads, "intermediate_size": m.intermediate_size,
            "vocab_size": m.vocab_size, "max_position_embeddings": m.max_position_embeddings,
            "head_dim": m.head_dim, "hidden_act": "silu", "tie_word_embeddings": m.tie_word_embeddings,
            "rope_theta": m.rope_theta}


@dataclass(frozen=True)
class ResolvedModel:
    """A model as a kernel profile needs it: its HF config (batchsim's shape and memory are
    read from it) and what the wheel builds its op graph from (a bundled id or a folder)."""

    name: str
    config: dict[str, Any]
    wheel_path: str
    note: str | None = None


def resolve_model(model: str | dict[str, Any], folder: Path) -> ResolvedModel:
    """``model`` as a preset name, a Hugging Face id the wheel bundles, or an HF config
    mapping; a config the wheel does not bundle is written to ``folder``/<hash>/config.json
    for its graph builder (which never fetches). KernelsError naming what is missing."""
    from sim.cost.presets import MODEL_PRESETS
    if isinstance(model, str) and model.lower() in MODEL_PRESETS and model.lower() not in PRESET_IDS:
        if model.lower() not in PRESET_ARCHITECTURES:
            raise KernelsError(f"model {model!r}: the kernel tables' graphs are for gated (SwiGLU) decoders "
                               f"and the {aic.WHEEL} wheel bundles no config of this preset; give a Hugging "
                               f"Face id it bundles (e.g. Qwen/Qwen3-32B) or the model's config.json")
        model = preset_hf_config(model.lower())
    if isinstance(model, str):
        model_id = PRESET_IDS.get(model.lower(), model)
        cfg = aic.model_config(model_id)
        name, path = (model.lower() if model.lower() in PRESET_IDS else model_id), model_id
    else:
        cfg, name, path = dict(model), str(model.get("name") or model.get("_name_or_path") or "custom"), ""
    mechanism = unmodelled_mechanism(cfg)
    if mechanism is not None:
        raise KernelsError(f"model {name!r} uses {mechanism}, which batchsim does not model yet")
    decoder, note = language_model_config(cfg)
    if not path:
        body = json.dumps({k: v for k, v in decoder.items() if k != "name"}, sort_keys=True)
        target = folder / "models" / hashlib.sha256(body.encode()).hexdigest()[:16]
        target.mkdir(parents=True, exist_ok=True)
        if "architectures" not in decoder:
            raise KernelsError(f"model {name!r}: its config has no 'architectures' field, which the kernel "
                               f"tables' graph builder needs (e.g. [\"LlamaForCausalLM\"])")
        (target / "config.json").write_text(body)
        path = str(target)
    return ResolvedModel(name, {**decoder, "name": name}, path, note)


# ---- precisions ---------------------------------------------------------------------------
def quant_modes(weights: str | None, stated: str | None, scope: str, kv_cache_dtype: str, generation: str,
                mla: bool = False) -> dict[str, str | None]:
    """The wheel's quant modes for batchsim's formats: None where the checkpoint's config
    states the format (the wheel reads it there, block scales included); else the kernel
    class vLLM runs that format in on this generation (FP4 weight-only before Blackwell).

    ``mla``: a multi-head latent attention model. NOTE: the wheel measured MLA's kernels with
    bf16 attention math only (its MLA tables' mla_dtype), while it takes an FP8 checkpoint's
    attention on SGLang and TensorRT-LLM as FP8, which those tables lack: MLA's attention is
    priced at the bf16 kernels measured."""
    # The KV cache always as batchsim sizes it (vLLM's --kv-cache-dtype: auto is the activation
    # dtype, even for an FP8 checkpoint, whose KV the wheel would otherwise take as FP8).
    modes: dict[str, str | None] = {"gemm_quant_mode": None, "moe_quant_mode": None,
                                    "kvcache_quant_mode": "fp8" if kv_cache_dtype.startswith("fp8") else "bfloat16",
                                    **({"fmha_quant_mode": "bfloat16"} if mla else {})}
    if weights is None or weights == stated:
        return modes
    blackwell = generation == "blackwell"
    if weights == "int4":
        raise KernelsError("weight_dtype int4 on a checkpoint that does not state it: the kernel tables price INT4 "
                           "for MoE experts only (int4_wo), as a Kimi-K2 checkpoint states it; give such a "
                           "checkpoint's config, or use the analytic profile (no kernels) for INT4 everywhere")
    gemm = {"bf16": "bfloat16", "fp16": "bfloat16", "fp8": "fp8",
            "nvfp4": "nvfp4" if blackwell else "w4a16_nvfp4", "mxfp4": None}.get(weights)
    moe = {"bf16": "bfloat16", "fp16": "bfloat16", "fp8": "fp8", "nvfp4": "nvfp4" if blackwell else "nvfp4_wo",
           "mxfp4": "w4a16_mxfp4"}.get(weights)
    if scope == "experts":
        gemm = None
    modes.update(gemm_quant_mode=gemm, moe_quant_mode=moe)
    return modes



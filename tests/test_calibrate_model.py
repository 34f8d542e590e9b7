"""ModelConfig validation, presets, HF import, and the dense reference model (CPU)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from calibrate.model import MODEL_PRESETS, LlamaModel, ModelConfig, get_model_config  # noqa: E402

LLAMA31_8B_HF = {
    "_name_or_path": "meta-llama/Llama-3.1-8B",
    "hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32,
    "num_key_value_heads": 8, "intermediate_size": 14336, "vocab_size": 128256,
    "max_position_embeddings": 131072, "rope_theta": 500000.0, "head_dim": 128,
}


def test_presets_have_the_real_shapes() -> None:
    cfg = MODEL_PRESETS["llama-3.1-8b"]
    assert (cfg.hidden_size, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads) == (4096, 32, 32, 8)
    assert (cfg.intermediate_size, cfg.vocab_size, cfg.head_dim) == (14336, 128256, 128)
    assert cfg.max_position_embeddings == 131072 and cfg.rope_theta == 500000.0
    # 8.03 B weights: the published parameter count of Llama 3.1 8B
    assert 8.0e9 < cfg.num_parameters < 8.1e9
    # 2 (K, V) * 32 layers * 8 kv heads * 128 dims * 2 bytes = 131072 bytes per token
    assert cfg.kv_bytes_per_token(2) == 131072
    assert 6.6e9 < MODEL_PRESETS["llama-2-7b"].num_parameters < 6.8e9
    assert 69e9 < MODEL_PRESETS["llama-3.1-70b"].num_parameters < 72e9
    for name in ("tiny-llama", "tiny-llama-2l", "llama-2-13b", "mistral-7b"):
        assert get_model_config(name) is MODEL_PRESETS[name]


def test_meta_device_model_counts_8b_parameters_without_allocating() -> None:
    model = LlamaModel(MODEL_PRESETS["llama-3.1-8b"], device="meta", dtype=torch.bfloat16)
    assert sum(p.numel() for p in model.parameters()) == MODEL_PRESETS["llama-3.1-8b"].num_parameters


def test_from_hf_reads_hf_field_names() -> None:
    cfg = ModelConfig.from_hf(LLAMA31_8B_HF)
    assert cfg == ModelConfig("meta-llama/Llama-3.1-8B", 4096, 32, 32, 8, 14336, 128256,
                              131072, 500000.0)
    assert get_model_config(LLAMA31_8B_HF) == cfg
    no_kv = {k: v for k, v in LLAMA31_8B_HF.items() if k != "num_key_value_heads"}
    assert ModelConfig.from_hf(no_kv).num_kv_heads == 32      # HF default: MHA


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"vocab_size": -1}, "vocab_size"),
        ({"hidden_size": "4096"}, "hidden_size"),
        ({"num_key_value_heads": 5}, "num_kv_heads"),
        ({"head_dim": 64}, "head_dim"),
        ({"rope_theta": 0}, "rope_theta"),
    ],
)
def test_from_hf_rejects_bad_fields_by_name(change: dict[str, object], field: str) -> None:
    with pytest.raises(ValueError, match=field):
        ModelConfig.from_hf({**LLAMA31_8B_HF, **change})


def test_from_hf_names_a_missing_field() -> None:
    hf = {k: v for k, v in LLAMA31_8B_HF.items() if k != "num_hidden_layers"}
    with pytest.raises(ValueError, match="missing required field 'num_hidden_layers'"):
        ModelConfig.from_hf(hf)


def test_get_model_config_errors_are_clear() -> None:
    with pytest.raises(ValueError, match="unknown model 'gpt-5'.*tiny-llama"):
        get_model_config("gpt-5")
    with pytest.raises(ValueError, match="unknown model field.*hidden"):
        get_model_config({"name": "x", "hidden": 64})
    with pytest.raises(ValueError, match="missing field.*num_layers"):
        get_model_config({"name": "x", "hidden_size": 64})
    own = {"name": "mine", "hidden_size": 64, "num_layers": 1, "num_heads": 2, "num_kv_heads": 1,
           "intermediate_size": 128, "vocab_size": 100}
    assert get_model_config(own).head_dim == 32


def test_dense_forward_is_seeded_finite_and_causal() -> None:
    cfg = MODEL_PRESETS["tiny-llama-2l"]
    a, b = LlamaModel(cfg, seed=3), LlamaModel(cfg, seed=3)
    ids = torch.randint(0, cfg.vocab_size, (1, 12), generator=torch.Generator().manual_seed(0))
    logits = a.forward_dense(ids)
    assert logits.shape == (12, cfg.vocab_size) and torch.isfinite(logits).all()
    assert torch.equal(logits, b.forward_dense(ids))
    assert not torch.equal(logits, LlamaModel(cfg, seed=4).forward_dense(ids))
    # causal: the first 7 positions do not see the last 5 tokens
    torch.testing.assert_close(a.forward_dense(ids[:, :7]), logits[:7], atol=1e-5, rtol=1e-5)


def test_rope_beyond_max_positions_raises() -> None:
    model = LlamaModel(MODEL_PRESETS["tiny-llama-2l"])
    with pytest.raises(ValueError, match="max_position_embeddings"):
        model.rope_tables(2049)


def test_bad_dtype_raises() -> None:
    with pytest.raises(ValueError, match="dtype"):
        LlamaModel(MODEL_PRESETS["tiny-llama-2l"], dtype=torch.int32)

"""The torch model's shapes (sim.cost.profile.ModelShape), presets, HF import, and the dense reference model (CPU)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from calibrate.model import MODEL_PRESETS, LlamaModel, get_model_shape  # noqa: E402
from sim.cost.presets import MODEL_PRESETS as SHAPE_PRESETS  # noqa: E402
from sim.cost.presets import model_shape_from_hf  # noqa: E402
from sim.cost.profile import ModelShape  # noqa: E402
from sim.cost.roofline import preset_profile  # noqa: E402

LLAMA31_8B_HF = {
    "_name_or_path": "meta-llama/Llama-3.1-8B",
    "hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32,
    "num_key_value_heads": 8, "intermediate_size": 14336, "vocab_size": 128256,
    "max_position_embeddings": 131072, "rope_theta": 500000.0, "head_dim": 128,
    "hidden_act": "silu", "tie_word_embeddings": False,
}
# Llama 3.1 8B without its 66 norm vectors (2 per layer + the final one):
#   per layer: q, o 2 x 4096 x 4096 + k, v 2 x 4096 x 1024 = 41_943_040
#              gate, up, down 3 x 4096 x 14336            = 176_160_768
#   32 x 218_103_808 + embedding and LM head 2 x 128256 x 4096 = 8_029_995_008
LLAMA31_8B_MATRIX_PARAMS = 8_029_995_008
LLAMA31_8B_NORM_PARAMS = (2 * 32 + 1) * 4096                   # 266_240


def test_presets_have_the_real_shapes() -> None:
    cfg = MODEL_PRESETS["llama-3.1-8b"]
    assert cfg is SHAPE_PRESETS["llama-3.1-8b"]                  # one shape, shared with the roofline
    assert (cfg.hidden_size, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads) == (4096, 32, 32, 8)
    assert (cfg.intermediate_size, cfg.vocab_size, cfg.head_dim) == (14336, 128256, 128)
    assert cfg.max_position_embeddings == 131072 and cfg.rope_theta == 500000.0
    assert cfg.num_params == LLAMA31_8B_MATRIX_PARAMS
    # 2 (K, V) * 32 layers * 8 kv heads * 128 dims * 2 bytes = 131072 bytes per token
    assert cfg.kv_bytes_per_token(2) == 131072
    assert MODEL_PRESETS["llama-2-7b"].rope_theta == 10000.0
    assert "opt-13b" not in MODEL_PRESETS                        # a 2-matrix MLP: not a Llama
    for name in ("tiny-llama", "tiny-llama-2l", "llama-2-13b", "mistral-7b"):
        assert get_model_shape(name) is MODEL_PRESETS[name]


def test_meta_device_model_counts_8b_parameters_without_allocating() -> None:
    model = LlamaModel(MODEL_PRESETS["llama-3.1-8b"], device="meta", dtype=torch.bfloat16)
    # 8_029_995_008 + 266_240 = 8_030_261_248, the published parameter count of Llama 3.1 8B
    assert sum(p.numel() for p in model.parameters()) == 8_030_261_248
    assert 8_030_261_248 == LLAMA31_8B_MATRIX_PARAMS + LLAMA31_8B_NORM_PARAMS


def test_tied_shape_shares_the_embedding_as_lm_head() -> None:
    tied = ModelShape("tied", 64, 2, 4, 2, 172, 512, 2048, tie_word_embeddings=True)
    model = LlamaModel(tied, device="meta")
    assert model.lm_head is model.embed_tokens
    # one 512 x 64 matrix for both, as num_params counts it, plus the norms: 2 per layer x 2 + 1 final, 64 each
    assert sum(p.numel() for p in model.parameters()) == tied.num_params + 5 * 64


def test_one_importer_gives_the_roofline_and_the_torch_model_the_same_shape() -> None:
    roofline = preset_profile(LLAMA31_8B_HF, "h100-sxm")
    engine_shape = LlamaModel(get_model_shape(LLAMA31_8B_HF), device="meta").cfg
    expected = ModelShape("meta-llama/Llama-3.1-8B", 4096, 32, 32, 8, 14336, 128256, 131072,
                          rope_theta=500000.0)
    assert roofline.model == engine_shape == model_shape_from_hf(LLAMA31_8B_HF) == expected
    # bf16 weights on one GPU: 8_029_995_008 x 2 bytes
    assert roofline.weight_bytes == 2 * LLAMA31_8B_MATRIX_PARAMS
    no_kv = {k: v for k, v in LLAMA31_8B_HF.items() if k != "num_key_value_heads"}
    assert get_model_shape(no_kv).num_kv_heads == 32            # HF default: MHA


def test_torch_model_refuses_a_gelu_shape_in_one_line() -> None:
    opt_hf = {"hidden_size": 5120, "ffn_dim": 20480, "num_hidden_layers": 40, "num_attention_heads": 40,
              "vocab_size": 50272, "max_position_embeddings": 2048, "activation_function": "relu"}
    for shape in (SHAPE_PRESETS["opt-13b"], get_model_shape(opt_hf)):
        with pytest.raises(ValueError, match=r"mlp is 'gelu'.*SwiGLU") as exc:
            LlamaModel(shape, device="meta")
        assert "\n" not in str(exc.value)


def test_torch_model_refuses_an_odd_head_dim() -> None:
    odd = ModelShape("odd", 12, 1, 4, 4, 32, 100, 64)            # head_dim 12 / 4 = 3: fine for costs
    with pytest.raises(ValueError, match="head_dim 3 must be even for RoPE"):
        LlamaModel(odd, device="meta")


def test_torch_model_builds_an_explicit_head_dim() -> None:
    # Qwen3-style: 4 heads of 32 with hidden 64, so q and o are 64 x 128 and k, v 64 x 2*32.
    shape = ModelShape("hd", 64, 2, 4, 2, 172, 512, 2048, explicit_head_dim=32)
    model = LlamaModel(shape)
    assert tuple(model.layers[0].w_qkv.shape) == ((4 + 2 * 2) * 32, 64)
    assert tuple(model.layers[0].w_o.shape) == (64, 4 * 32)
    assert model.forward_dense(torch.tensor([[1, 2, 3]])).shape == (3, 512)


@pytest.mark.parametrize(("change", "field"), [
    ({"num_experts": 8, "num_experts_per_tok": 2}, "num_experts"),
    ({"sliding_window": 128, "num_sliding_layers": 1}, "sliding_window"),
])
def test_torch_model_refuses_moe_and_sliding_windows(change: dict[str, int], field: str) -> None:
    shape = ModelShape("x", 64, 2, 4, 2, 172, 512, 2048, **change)
    with pytest.raises(ValueError, match=f"{field}.*the roofline"):
        LlamaModel(shape, device="meta")


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"vocab_size": -1}, "vocab_size"),
        ({"hidden_size": "4096"}, "hidden_size"),
        ({"num_key_value_heads": 5}, "num_kv_heads 5"),
        ({"head_dim": -64}, "head_dim"),
        ({"rope_theta": 0}, "rope_theta"),
        ({"rope_parameters": [1]}, "field 'rope_parameters' must be a mapping"),
        ({"hidden_act": ["silu"]}, "field 'hidden_act' must be the activation's name"),
        # a typo became a two-matrix GELU MLP in silence (a SwiGLU model's MLP costs 3/2 of that)
        ({"hidden_act": "slu"}, "field 'hidden_act' is 'slu', an activation batchsim does not know"),
    ],
)
def test_hf_import_rejects_bad_fields_by_name(change: dict[str, object], field: str) -> None:
    with pytest.raises(ValueError, match=field):
        get_model_shape({**LLAMA31_8B_HF, **change})


def test_hf_import_names_a_missing_field() -> None:
    hf = {k: v for k, v in LLAMA31_8B_HF.items() if k != "hidden_act"}
    with pytest.raises(ValueError, match="config field 'hidden_act' is missing"):
        get_model_shape(hf)


def test_get_model_shape_errors_are_clear() -> None:
    with pytest.raises(ValueError, match="unknown model 'gpt-5'.*tiny-llama"):
        get_model_shape("gpt-5")
    with pytest.raises(ValueError, match="unknown model field.*hidden"):
        get_model_shape({"name": "x", "hidden": 64})
    with pytest.raises(ValueError, match="missing field.*num_layers"):
        get_model_shape({"name": "x", "hidden_size": 64})
    own = {"name": "mine", "hidden_size": 64, "num_layers": 1, "num_heads": 2, "num_kv_heads": 1,
           "intermediate_size": 128, "vocab_size": 100, "max_position_embeddings": 256}
    assert get_model_shape(own).head_dim == 32                   # 64 / 2


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

"""Explicit head_dim, sliding windows, precisions and mixture-of-experts, checked by hand
against the real config.json files under tests/fixtures/hf_configs/."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from sim.cli import main
from sim.cost.collectives import TpStepCosts
from sim.cost.moe import expected_distinct_experts, linear_split
from sim.cost.precision import Precision, precision_from_hf
from sim.cost.presets import GPU_PRESETS, MODEL_PRESETS, model_shape_from_hf
from sim.cost.profile import load_profile
from sim.cost.roofline import Efficiency, Roofline, analytic_profile, preset_profile, sliding_prefill_pairs

CONFIGS = Path(__file__).resolve().parents[1] / "fixtures" / "hf_configs"
NAMES = ["Qwen3-32B", "Qwen3-30B-A3B", "Meta-Llama-3.1-70B-Instruct-FP8", "Mixtral-8x7B-v0.1", "gpt-oss-120b"]


def config(name: str) -> dict:
    return json.loads((CONFIGS / name / "config.json").read_text())


def shape(name: str):
    return model_shape_from_hf(config(name), name)


def test_qwen3_32b_head_dim_sets_kv_and_projections() -> None:
    m = shape("Qwen3-32B")
    assert m.head_dim == 128                      # explicit, not 5120 / 64 = 80
    # K and V, 64 layers, 8 KV heads of 128, 2 bytes: 2 * 64 * 8 * 128 * 2 = 262,144 (not the
    # 163,840 that head_dim 80 would give)
    assert m.kv_bytes_per_token(2) == 2 * 64 * 8 * 128 * 2 == 262_144
    # q, o: 5120 x 64*128 = 5120 x 8192 each; k, v: 5120 x 8*128 each:
    # 2*5120*8192 + 2*5120*1024 = 83,886,080 + 10,485,760 = 94,371,840 a layer
    assert m.attn_params_per_layer == 94_371_840
    # + MLP 3*5120*25600 = 393,216,000 a layer; x 64 layers + 2 * 151936 * 5120 (untied):
    # 64 * 487,587,840 + 1,555,824,640 = 32,761,446,400 (Qwen: "32.8B")
    assert m.num_params == 32_761_446_400
    assert preset_profile(config("Qwen3-32B"), "h200").kv_bytes_per_token == 262_144


def test_moe_parameter_counts_match_the_published_ones() -> None:
    # Qwen3-30B-A3B: per layer attention 2*2048*4096 + 2*2048*512 = 18,874,368; router 2048*128 =
    # 262,144; 128 experts of 3*2048*768 = 4,718,592. 48 layers and 2 * 151936 * 2048 embeddings:
    # 48 * (18,874,368 + 262,144 + 128 * 4,718,592) + 622,329,856 = 30,531,911,680 (Qwen: 30.5B total)
    q = shape("Qwen3-30B-A3B")
    assert (q.num_experts, q.num_experts_per_tok, q.expert_intermediate_size) == (128, 8, 768)
    assert q.num_params == 30_531_911_680
    # active: 8 experts instead of 128: 30,531,911,680 - 48 * 120 * 4,718,592 = 3,352,821,760 (3.3B)
    assert q.num_active_params == 3_352_821_760
    # Mixtral-8x7B: attention 2*4096*4096 + 2*4096*1024 = 41,943,040; router 32,768; 8 experts of
    # 3*4096*14336 = 176,160,768; 32 layers + 2*32000*4096: 46,702,526,464 total (46.7B) and
    # 12,879,659,008 active with 2 experts (12.9B)
    mx = shape("Mixtral-8x7B-v0.1")
    assert mx.num_params == 46_702_526_464 and mx.num_active_params == 12_879_659_008
    # gpt-oss-120b: head_dim 64: attention 2*2880*4096 + 2*2880*512 = 26,542,080; router
    # 2880*128 = 368,640; 128 experts of 3*2880*2880 = 24,883,200; 36 layers + 2*201088*2880:
    # 36 * (26,542,080 + 368,640 + 128 * 24,883,200) + 1,158,266,880 = 36 * 3,211,960,320 + 1,158,266,880
    # = 116,788,838,400 (OpenAI: 116.83B; biases, sinks and norms are not counted). Active, 4 experts:
    # 36 * 126,443,520 + 1,158,266,880 = 5,710,233,600; OpenAI's 5.13B counts the unembedding but not the embedding:
    # 5,710,233,600 - 201088*2880 = 5,131,100,160.
    g = shape("gpt-oss-120b")
    assert g.num_params == 116_788_838_400
    assert g.num_active_params - g.vocab_size * g.hidden_size == 5_131_100_160


def test_sliding_windows_of_gpt_oss_bound_the_kv_a_request_keeps() -> None:
    g = shape("gpt-oss-120b")
    assert (g.sliding_window, g.num_sliding_layers) == (128, 18)          # layer_types: 18 of 36 slide
    # The pool holds the 18 full layers: 2 * 18 * 8 * 64 * 2 = 36,864 bytes a token; each request
    # keeps at most a window of the sliding ones: 36,864 * 128 = 4,718,592 bytes.
    assert g.kv_bytes_per_token(2) == 36_864 and g.kv_bytes_per_seq(2) == 4_718_592
    prof = preset_profile(config("gpt-oss-120b"), "h200")
    assert prof.kv_bytes_per_seq == 4_718_592
    # 256 running sequences reserve 256 windows: 256 * 4,718,592 / 36,864 = 32,768 pool tokens.
    assert prof.kv_capacity_tokens(0.9, 8192, max_num_seqs=0) - prof.kv_capacity_tokens(0.9, 8192, max_num_seqs=256) == 32_768
    # Qwen3 says use_sliding_window: false; Mistral v0.1 slides every layer (one uniform pool, as
    # vLLM sizes it then: every layer's bytes a token, no per-request window charge).
    assert shape("Qwen3-32B").num_sliding_layers == 0
    mistral = model_shape_from_hf({**config("Mixtral-8x7B-v0.1"), "sliding_window": 4096}, "m")
    assert mistral.num_sliding_layers == 32 and mistral.kv_bytes_per_token(2) == 131_072
    assert mistral.kv_bytes_per_seq(2) == 0
    # Gemma 3's pattern 6: 5 local layers to 1 global; Gemma 2 every other layer.
    gemma = {"hidden_size": 2560, "num_hidden_layers": 34, "num_attention_heads": 8, "head_dim": 256,
             "intermediate_size": 10240, "vocab_size": 262208, "max_position_embeddings": 131072,
             "hidden_act": "silu", "sliding_window": 1024, "sliding_window_pattern": 6}
    assert model_shape_from_hf(gemma, "g3").num_sliding_layers == 34 - 34 // 6 == 29
    # Gemma's MLP is gated (GeGLU: gate, up, down) although its activation is a GELU: 3 matrices.
    assert model_shape_from_hf({**gemma, "model_type": "gemma3_text", "hidden_act": "gelu_pytorch_tanh"},
                               "g3").num_mlp_matrices == 3
    assert model_shape_from_hf({**gemma, "sliding_window_pattern": None, "model_type": "gemma2"},
                               "g2").num_sliding_layers == 17


def test_sliding_prefill_pairs_by_hand() -> None:
    # window 128, 256 new tokens from context 0: queries 0..127 see 1..128 keys (128*129/2 = 8,256),
    # queries 128..255 see 128 each (128*128 = 16,384): 24,640 (full attention: 256*257/2 = 32,896)
    assert sliding_prefill_pairs(256, 0, 128.0) == 24_640
    # context already past the window: every query sees 128 keys
    assert sliding_prefill_pairs(10, 1000, 128.0) == 1280
    # chunk inside the window: the full causal count, 4 * (100 + 5/2) = 410
    assert sliding_prefill_pairs(4, 100, 128.0) == 410
    g = shape("gpt-oss-120b")
    rf = Roofline(g, GPU_PRESETS["h200"], efficiency=Efficiency.peak())
    no_window = Roofline(dataclasses.replace(g, sliding_window=0, num_sliding_layers=0), GPU_PRESETS["h200"],
                         efficiency=Efficiency.peak())
    assert rf.attn_prefill_s(256, 100_000) < 0.6 * no_window.attn_prefill_s(256, 100_000)
    assert rf.attn_prefill_s(64, 0) == pytest.approx(no_window.attn_prefill_s(64, 0))   # inside the window
    assert rf.attn_decode_s(64, 64 * 10_000) < 0.6 * no_window.attn_decode_s(64, 64 * 10_000)


def test_expected_distinct_experts_by_hand() -> None:
    # E = 8, k = 2: one token touches 2 experts; two tokens 8 * (1 - (6/8)^2) = 3.5; three
    # 8 * (1 - 27/64) = 4.625; many tokens touch all 8.
    assert expected_distinct_experts(8, 2, 1) == pytest.approx(2.0)
    assert expected_distinct_experts(8, 2, 2) == pytest.approx(3.5)
    assert expected_distinct_experts(8, 2, 3) == pytest.approx(4.625)
    assert expected_distinct_experts(8, 2, 10_000) == pytest.approx(8.0)
    # Under EP 4, each GPU holds 2 experts and expects a quarter of them: 3.5 / 4 = 0.875.
    mx = shape("Mixtral-8x7B-v0.1")
    ep = linear_split(mx, Precision(), 4, expert_parallel=True)
    tp = linear_split(mx, Precision(), 4)
    assert ep.local_experts == 2 and ep.expected_local_experts(2) == pytest.approx(0.875)
    # Bytes read per GPU agree: EP reads 0.875 whole experts, TP 3.5 quarter-experts.
    assert ep.expected_local_experts(2) * ep.expert_params_hi == pytest.approx(
        tp.expected_local_experts(2) * tp.expert_params_hi)


def test_moe_decode_reads_few_experts_and_prefill_all() -> None:
    q = shape("Qwen3-30B-A3B")
    peak = Roofline(q, GPU_PRESETS["h200"], efficiency=Efficiency.peak())
    # One token: attention, router and 8 of 128 experts stream from HBM, not all 30.5B params.
    all_weights_s = q.num_params * 2 / GPU_PRESETS["h200"].mem_bandwidth_bytes_s
    assert peak.linear_s(1) < 0.2 * all_weights_s
    assert peak.linear_s(8192) > all_weights_s      # a big prefill touches every expert


def test_weight_precisions_and_scales() -> None:
    llama = MODEL_PRESETS["llama-3.1-70b"]
    bf16 = preset_profile("llama-3.1-70b", "h200", 2)
    fp8 = preset_profile("llama-3.1-70b", "h200", 2, weight_dtype="fp8")
    embed = llama.embed_params                     # embedding + LM head stay in bf16
    # FP8 halves every decoder-layer weight: 2 bytes -> 1 byte a parameter.
    assert bf16.weight_bytes - fp8.weight_bytes == llama.num_params - embed
    # nvfp4: 4 bits + one fp8 scale per 16 = 0.5625 bytes; mxfp4: + one e8m0 per 32 = 0.53125.
    nv = preset_profile("llama-3.1-70b", "b200-sxm", 2, weight_dtype="nvfp4")
    assert nv.weight_bytes == round((llama.num_params - embed) * 0.5625 + embed * 2)
    # The checkpoint's quantization_config sets the format; gpt-oss quantizes only its experts.
    assert precision_from_hf(config("Meta-Llama-3.1-70B-Instruct-FP8"), "x") == ("fp8", "linear")
    assert preset_profile(config("Meta-Llama-3.1-70B-Instruct-FP8"), "h200", 2).weight_bytes == fp8.weight_bytes
    g = shape("gpt-oss-120b")
    oss = preset_profile(config("gpt-oss-120b"), "h200")
    experts = g.num_expert_params                  # 36 * 128 * 24,883,200 = 114,661,785,600
    assert experts == 114_661_785_600
    assert oss.weight_bytes == round(experts * 0.53125 + (g.num_params - experts) * 2)   # ~65.2 GB
    assert oss.weight_dtype == "mxfp4" and "w_mxfp4-experts" in oss.name


def test_gemm_rate_follows_the_hardware() -> None:
    fp8 = Precision(weight_dtype="fp8")
    assert fp8.gemm_precision(GPU_PRESETS["h100-sxm"]) == "fp8"       # W8A8 on FP8 tensor cores
    assert fp8.gemm_precision(GPU_PRESETS["l40s"]) == "fp8"           # Ada has FP8
    assert fp8.gemm_precision(GPU_PRESETS["a100-80gb"]) == "w8a16"    # Marlin W8A16 on Ampere
    fp4 = Precision(weight_dtype="mxfp4")
    assert fp4.gemm_precision(GPU_PRESETS["h200"]) == "w4a16"         # weight-only on Hopper
    assert fp4.gemm_precision(GPU_PRESETS["b200-sxm"]) == "fp4"
    llama = MODEL_PRESETS["llama-3.1-70b"]
    # Compute-bound prefill: FP8 on H100 at 2x the peak runs faster than bf16. On A100 the Marlin
    # W8A16 kernels do bf16 math at the fraction fitted on the public runs (0.378 of the peak against
    # dense bf16's 0.68: vLLM serves Qwen3-32B-FP8 there slower than BF16), so a 16k-token step
    # costs more: about 0.68 / 0.378 = 1.8x the GEMM time.
    b = Roofline(llama, GPU_PRESETS["h100-sxm"]).linear_s(16384)
    assert Roofline(llama, GPU_PRESETS["h100-sxm"], precision=fp8).linear_s(16384) < 0.75 * b
    b = Roofline(llama, GPU_PRESETS["a100-80gb"]).linear_s(16384)
    f = Roofline(llama, GPU_PRESETS["a100-80gb"], precision=fp8).linear_s(16384)
    assert 1.7 < f / b < 1.85


def test_fp8_kv_doubles_the_pool() -> None:
    bf16 = preset_profile("llama-3.1-8b", "h100-sxm")
    fp8 = preset_profile("llama-3.1-8b", "h100-sxm", kv_cache_dtype="fp8")
    # 2 * 32 * 8 * 128 * 1 byte = 65,536: half of bf16's 131,072, so twice the tokens fit
    assert fp8.kv_bytes_per_token == 65_536 and bf16.kv_bytes_per_token == 131_072
    assert fp8.kv_capacity_tokens(0.9) in (2 * bf16.kv_capacity_tokens(0.9), 2 * bf16.kv_capacity_tokens(0.9) + 1)
    assert fp8.weight_bytes == bf16.weight_bytes and fp8.kv_cache_dtype == "fp8"


def test_expert_parallel_all_to_all_bytes() -> None:
    q = shape("Qwen3-30B-A3B")
    costs = TpStepCosts(q, GPU_PRESETS["h200"], 4, 2, expert_parallel=True)
    # 256 tokens x 8 experts x 2048 hidden x 2 bytes = 8,388,608 bytes per dispatch (and combine)
    assert costs.alltoall_bytes(256) == 8_388_608
    # two all-to-alls per MoE layer; the MoE all-reduce goes: 2 * 48 + 1 - 48 = 49 all-reduces
    assert costs.alltoall_calls == 96 and costs.allreduce_calls == 49
    tp = TpStepCosts(q, GPU_PRESETS["h200"], 4, 2)
    assert tp.alltoall_calls == 0 and tp.allreduce_calls == 97
    prof = preset_profile(config("Qwen3-30B-A3B"), "h200", 4, expert_parallel=True)
    assert prof.name.endswith("-ep") and prof.provenance["expert_parallel"] is True
    with pytest.raises(ValueError, match="needs a mixture-of-experts model"):
        preset_profile("llama-3.1-8b", "h200", 2, expert_parallel=True)


def test_dense_bf16_default_path_is_unchanged() -> None:
    # The one-class formula: a Precision equal to the dtype gives the very same floats.
    m, g = MODEL_PRESETS["llama-3.1-8b"], GPU_PRESETS["h100-sxm"]
    a, b = Roofline(m, g, 2), Roofline(m, g, 2, precision=Precision("bf16"))
    assert a.linear_s(777) == b.linear_s(777) and a.attn_prefill_s(300, 5000) == b.attn_prefill_s(300, 5000)


def test_new_shape_facts_survive_a_profile_file(tmp_path) -> None:
    prof = analytic_profile(shape("gpt-oss-120b"), GPU_PRESETS["b200-sxm"], 2,
                            precision=Precision(weight_dtype="mxfp4", kv_cache_dtype="fp8", quantized="experts"))
    prof.save(tmp_path / "p.json")
    back = load_profile(tmp_path / "p.json")
    assert back.model == prof.model and back.model.head_dim == 64
    assert (back.weight_dtype, back.kv_cache_dtype, back.kv_bytes_per_seq) == ("mxfp4", "fp8", 2_359_296)
    data = json.loads((tmp_path / "p.json").read_text())
    data["weight_dtype"] = "int3"
    (tmp_path / "bad.json").write_text(json.dumps(data))
    with pytest.raises(ValueError, match="field 'weight_dtype' must be one of"):
        load_profile(tmp_path / "bad.json")


@pytest.mark.parametrize("name", NAMES)
def test_sim_run_takes_each_config_unchanged(tmp_path, capsys, name: str) -> None:
    (tmp_path / "w.yaml").write_text(
        f"name: t\nnum_requests: 12\narrivals: {{kind: poisson, rate: 4}}\n"
        f"lengths: {{kind: fixed, prompt_tokens: 300, output_tokens: 8}}\npolicy: {{kind: vllm}}\n"
        f"server: {{max_model_len: 8192}}\n"
        f"profile: {{model: {CONFIGS / name / 'config.json'}, gpu: h200}}\n")
    rc = main(["run", str(tmp_path / "w.yaml"), "--out", str(tmp_path / "out"), "--quiet"])
    assert rc == 0, capsys.readouterr().err
    meta = json.loads((tmp_path / "out" / "meta.json").read_text())
    assert name in json.dumps(meta)


@pytest.mark.parametrize("model, words", [
    ("missing/config.json", "config file"),
    ("bad.json", "is not valid JSON"),
])
def test_a_bad_config_path_is_one_clear_error(tmp_path, capsys, model: str, words: str) -> None:
    (tmp_path / "bad.json").write_text("{nope")
    (tmp_path / "w.yaml").write_text(f"name: t\nnum_requests: 4\narrivals: {{kind: poisson, rate: 1}}\n"
                                     f"lengths: {{kind: fixed, prompt_tokens: 10, output_tokens: 2}}\n"
                                     f"profile: {{model: {model}, gpu: h200}}\n")
    assert main(["run", str(tmp_path / "w.yaml"), "--quiet"]) != 0
    err = capsys.readouterr().err
    assert "field 'profile.model'" in err and words in err and "Traceback" not in err


def test_bad_precision_fields_name_the_field(tmp_path, capsys) -> None:
    (tmp_path / "w.yaml").write_text("name: t\nnum_requests: 4\narrivals: {kind: poisson, rate: 1}\n"
                                     "lengths: {kind: fixed, prompt_tokens: 10, output_tokens: 2}\n"
                                     "profile: {weight_dtype: int3}\n")
    assert main(["run", str(tmp_path / "w.yaml"), "--quiet"]) != 0
    err = capsys.readouterr().err
    assert "field 'profile.weight_dtype'" in err and "fp8" in err


@pytest.mark.parametrize("preset, folder", [("qwen3-32b", "Qwen3-32B"), ("qwen3-30b-a3b", "Qwen3-30B-A3B"),
                                            ("mixtral-8x7b", "Mixtral-8x7B-v0.1"), ("gpt-oss-120b", "gpt-oss-120b"),
                                            ("llama-3.1-70b", "Meta-Llama-3.1-70B-Instruct-FP8")])
def test_model_presets_are_their_configs(preset: str, folder: str) -> None:
    assert model_shape_from_hf(config(folder), preset) == MODEL_PRESETS[preset]


def test_more_model_presets_by_hand() -> None:
    # Qwen3-235B-A22B: attention 2*4096*8192 + 2*4096*512 = 71,303,168; router 4096*128 = 524,288;
    # 128 experts of 3*4096*1536 = 18,874,368; 94 layers + 2*151936*4096 = 1,244,659,712:
    # 94 * 2,487,719,936 + 1,244,659,712 = 235,090,... (Qwen: 235B total), 22.2B active (A22B)
    q = MODEL_PRESETS["qwen3-235b-a22b"]
    assert q.num_params == 94 * (71_303_168 + 524_288 + 128 * 18_874_368) + 1_244_659_712
    assert round(q.num_params / 1e9) == 235 and round(q.num_active_params / 1e9, 1) == 22.2
    # gpt-oss-20b: 20.9B total; OpenAI's 3.61B active leaves out the embedding (201088 * 2880)
    g = MODEL_PRESETS["gpt-oss-20b"]
    assert round(g.num_params / 1e9, 1) == 20.9
    assert round((g.num_active_params - g.vocab_size * g.hidden_size) / 1e9, 2) == 3.61
    assert MODEL_PRESETS["llama-3.3-70b"].num_params == MODEL_PRESETS["llama-3.1-70b"].num_params
    assert MODEL_PRESETS["qwen3-8b"].kv_bytes_per_token(2) == 2 * 36 * 8 * 128 * 2 == 147_456
    # A preset whose checkpoint ships mxfp4 experts is priced so by default, as its config.
    assert preset_profile("gpt-oss-120b", "h200").weight_bytes == preset_profile(config("gpt-oss-120b"),
                                                                                  "h200").weight_bytes


def test_a_fitted_matmul_fraction_is_a_table_lookup(monkeypatch) -> None:
    from sim.cost import efficiency
    monkeypatch.setattr(efficiency, "MATMUL_FLOPS_FIT", {("hopper", "fp8", "dense"): 0.5, ("hopper", "fp8", "moe"): 0.2})
    assert Efficiency.for_gpu(GPU_PRESETS["h200"]).matmul_flops_fp8 == 0.5
    assert Efficiency.for_gpu(GPU_PRESETS["h200"], moe=True).matmul_flops_fp8 == 0.2
    assert Efficiency.for_gpu(GPU_PRESETS["b200-sxm"]).matmul_flops_fp8 == Efficiency().matmul_flops
    prof = preset_profile("llama-3.1-70b", "h200", 2, weight_dtype="fp8")
    assert prof.efficiency["matmul_flops_fp8"] == 0.5 and prof.provenance["gemm_precision"] == "fp8"
    assert preset_profile("qwen3-30b-a3b", "h200", weight_dtype="fp8").efficiency["matmul_flops_fp8"] == 0.2


@pytest.mark.parametrize("change, words", [
    ({"kv_lora_rank": 512}, "multi-head latent attention"),
    ({"quantization_config": {"quant_method": "gptq", "bits": 4}}, "quant_method 'gptq' is not supported"),
    ({"num_local_experts": 8, "num_experts_per_tok": None}, "routing width is missing"),
    ({"layer_types": ["full_attention"]}, "field 'layer_types' must list one type per layer"),
])
def test_configs_batchsim_cannot_cost_are_refused_by_field(change: dict, words: str) -> None:
    cfg = {**config("Qwen3-32B"), "sliding_window": 4096, **change}
    with pytest.raises(ValueError, match=words):
        preset_profile(cfg, "h200")


def test_a_config_is_read_strictly_and_its_reading_otherwise_unchanged() -> None:
    # Typed fields: a string "false" is no boolean (bool("false") was True: a tied 151,936 x 5,120
    # embedding, 0.8 GB too few); decoder_sparse_step 0 is no step (it was read as 1).
    qwen = config("Qwen3-32B")
    with pytest.raises(ValueError, match=r"field 'tie_word_embeddings' must be true or false, got 'false'"):
        model_shape_from_hf({**qwen, "tie_word_embeddings": "false"}, "q")
    with pytest.raises(ValueError, match=r"field 'decoder_sparse_step' must be a positive integer, got 0"):
        model_shape_from_hf({**config("Qwen3-30B-A3B"), "decoder_sparse_step": 0}, "q")
    # linear-attention layers need their heads and widths; attention-free models and other types are refused
    with pytest.raises(ValueError, match=r"config field 'linear_num_key_heads' is missing \(its linear-attention "
                                         r"layers need it\)"):
        model_shape_from_hf({**qwen, "layer_types": ["linear_attention", "full_attention"] * 32}, "q")
    with pytest.raises(ValueError, match=r"uses linear attention in every layer \(attention-free models\)"):
        model_shape_from_hf({**qwen, "layer_types": ["linear_attention"] * 64}, "q")
    with pytest.raises(ValueError, match=r"field 'linear_num_value_heads' describes linear-attention layers, but "
                                         r"neither 'layer_types' nor 'full_attention_interval'"):
        model_shape_from_hf({**qwen, "linear_num_value_heads": 32}, "q")
    with pytest.raises(ValueError, match=r"layers of type 'chunked_attention'"):
        model_shape_from_hf({**qwen, "layer_types": ["chunked_attention"] * 64}, "q")
    # names in any case mean what they mean in lower case
    same = model_shape_from_hf({**qwen, "hidden_act": "SiLU", "layer_types": ["Full_Attention"] * 64}, "q")
    assert same == model_shape_from_hf(qwen, "q")
    # layer_types of 5 sliding layers and 1 full (Gemma 3's pattern), window 1024: 5 sliding layers
    gemma = {**config("Qwen3-32B"), "num_hidden_layers": 6, "sliding_window": 1024,
             "layer_types": ["sliding_attention"] * 5 + ["full_attention"]}
    assert (model_shape_from_hf(gemma, "g").sliding_window, model_shape_from_hf(gemma, "g").num_sliding_layers) == (1024, 5)


def test_a_misspelt_key_warns_did_you_mean_and_a_missing_one_says_which_it_may_be() -> None:
    # num_key_value_head (no s) left unread meant 64 KV heads, not 8: 8x the KV cache, in silence
    qwen = {k: v for k, v in config("Qwen3-32B").items() if k != "num_key_value_heads"}
    with pytest.warns(UserWarning, match=r"config field 'num_key_value_head' is not one batchsim reads \(did you "
                                         r"mean 'num_key_value_heads'\?\)"):
        shape = model_shape_from_hf({**qwen, "num_key_value_head": 8}, "q")
    assert shape.num_kv_heads == 64                       # the default it warned of: one KV head per head
    with pytest.raises(ValueError, match=r"config field 'num_hidden_layers' is missing \(or 'num_layers'\); the config "
                                         r"has 'num_hidden_layer': a typo of it\?"):
        model_shape_from_hf({**{k: v for k, v in qwen.items() if k != "num_hidden_layers"}, "num_hidden_layer": 64}, "q")
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")                     # no warning where the read key is there too
        model_shape_from_hf({**config("Qwen3-32B"), "num_key_value_head": 8}, "q")


def test_a_workload_sets_precisions_and_expert_parallel(tmp_path, capsys) -> None:
    (tmp_path / "w.yaml").write_text(
        "name: t\nnum_requests: 12\narrivals: {kind: poisson, rate: 4}\n"
        "lengths: {kind: fixed, prompt_tokens: 300, output_tokens: 8}\npolicy: {kind: vllm}\n"
        "profile: {model: qwen3-30b-a3b, gpu: h100-sxm, tensor_parallel: 2, weight_dtype: fp8,\n"
        "          kv_cache_dtype: fp8, enable_expert_parallel: true}\n")
    rc = main(["run", str(tmp_path / "w.yaml"), "--out", str(tmp_path / "out"), "--quiet"])
    assert rc == 0, capsys.readouterr().err
    assert "qwen3-30b-a3b@h100-sxm-tp2-bf16-w_fp8-kv_fp8-ep" in (tmp_path / "out" / "meta.json").read_text()


def test_shared_experts_and_dense_first_layers_by_hand() -> None:
    # Qwen/Qwen1.5-MoE-A2.7B (Qwen2-MoE) config.json's cost fields: 60 experts of 1408, top 4, one
    # shared expert of shared_expert_intermediate_size 5632 (its 1-wide sigmoid gate is not counted).
    qwen2 = {"model_type": "qwen2_moe", "hidden_size": 2048, "num_hidden_layers": 24, "num_attention_heads": 16,
             "num_key_value_heads": 16, "intermediate_size": 5632, "moe_intermediate_size": 1408,
             "shared_expert_intermediate_size": 5632, "num_experts": 60, "num_experts_per_tok": 4,
             "decoder_sparse_step": 1, "mlp_only_layers": [], "vocab_size": 151936,
             "max_position_embeddings": 8192, "hidden_act": "silu", "tie_word_embeddings": False,
             "use_sliding_window": False, "sliding_window": 32768}
    q = model_shape_from_hf(qwen2, "qwen1.5-moe-a2.7b")
    # a layer: attention 4*2048^2 = 16,777,216; experts 60 * 3*2048*1408 = 519,045,120; shared
    # 3*2048*5632 = 34,603,008; router 2048*60 = 122,880: 570,548,224. x 24 + 2*151936*2048
    # (622,329,856) = 14,315,487,232 (Qwen: 14.3B); active, 4 experts: 24 * (16,777,216 + 4 * 8,650,752
    # + 34,603,008 + 122,880) + 622,329,856 = 24 * 86,106,112 + 622,329,856 = 2,688,876,544 (A2.7B)
    assert q.num_params == 24 * 570_548_224 + 622_329_856 == 14_315_487_232
    assert q.num_active_params == 2_688_876_544
    # deepseek-ai/deepseek-moe-16b-base config.json's cost fields: standard attention (no kv_lora_rank),
    # the first layer dense (first_k_dense_replace 1, intermediate 10944), then 64 routed experts of
    # 1408, top 6, and 2 shared experts (2 x 1408 wide).
    ds = {"model_type": "deepseek", "hidden_size": 2048, "num_hidden_layers": 28, "num_attention_heads": 16,
          "num_key_value_heads": 16, "intermediate_size": 10944, "moe_intermediate_size": 1408,
          "n_routed_experts": 64, "num_experts_per_tok": 6, "n_shared_experts": 2, "first_k_dense_replace": 1,
          "vocab_size": 102400, "max_position_embeddings": 4096, "hidden_act": "silu",
          "tie_word_embeddings": False}
    d = model_shape_from_hf(ds, "deepseek-moe-16b")
    assert (d.num_dense_layers, d.num_moe_layers, d.shared_expert_intermediate_size) == (1, 27, 2816)
    # 28 * 16,777,216 attention + 3*2048*10944 dense MLP + 27 * (64 * 8,650,752 + 2 * 8,650,752 + 2048*64)
    # + 2*102400*2048 = 469,762,048 + 67,239,936 + 27 * 571,080,704 + 419,430,400 = 16,375,611,392 (16.4B)
    assert d.num_params == 469_762_048 + 67_239_936 + 27 * 571_080_704 + 419_430_400
    assert round(d.num_active_params / 1e9, 1) == 2.8                     # DeepSeek: 2.8B activated
    # The shared experts and the dense layer run on every token: in both the TP split and the FLOPs.
    split = linear_split(d, Precision(), 2)
    per_token = 28 * 16_777_216 / 2 + 67_239_936 / 2 + 27 * (2 * 8_650_752 / 2 + 2048 * 64 + 6 * 8_650_752 / 2)
    assert split.token_params_hi == pytest.approx(per_token)


def test_tensor_parallel_beyond_the_kv_heads_replicates_them():
    """Qwen3-235B-A22B has 4 KV heads: at TP 8 vLLM gives every GPU one head, so each is held twice.
    KV per token, all ranks: TP 4: 2 x 94 layers x 4 heads x 128 x 2 B = 192,512 B;
    TP 8: 2 x 94 x 8 x 128 x 2 = 385,024 B (twice). TP 3 divides neither way: refused."""
    assert preset_profile("qwen3-235b-a22b", "h100-sxm", 4).kv_bytes_per_token == 192_512
    tp8 = preset_profile("qwen3-235b-a22b", "h100-sxm", 8)
    assert tp8.kv_bytes_per_token == 385_024
    assert tp8.model.num_kv_heads == 4                      # the profile keeps the model's own shape
    with pytest.raises(ValueError, match="does not divide"):
        preset_profile("qwen3-235b-a22b", "h100-sxm", 3)


def test_qwen3_14b_and_mistral_small_24b_presets():
    """Parameters from the configs: Qwen3-14B 14.77B (published 14.8B), Mistral-Small-24B 23.57B (24B);
    both keep 2 x 40 layers x 8 KV heads x 128 x 2 B = 163,840 B of KV per token."""
    q14, m24 = MODEL_PRESETS["qwen3-14b"], MODEL_PRESETS["mistral-small-24b"]
    assert q14.num_params == 14_767_882_240 and m24.num_params == 23_571_988_480
    assert q14.kv_bytes_per_token(2) == m24.kv_bytes_per_token(2) == 163_840
    assert m24.head_dim == 128 and m24.hidden_size // m24.num_heads == 160

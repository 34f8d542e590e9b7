"""Tests of the GPU/model presets and the analytic roofline profiles."""

from __future__ import annotations

import dataclasses
import random
import time

import pytest

from sim.batch import Batch, BatchItem
from sim.presets import GPU_PRESETS, MODEL_PRESETS, model_shape_from_hf
from sim.profile import FORMAT_VERSION, load_profile
from sim.roofline import Efficiency, Roofline, analytic_profile, preset_profile

LLAMA_31_8B_HF = {  # fields of meta-llama/Llama-3.1-8B config.json
    "model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336,
    "max_position_embeddings": 131072, "num_attention_heads": 32, "num_hidden_layers": 32,
    "num_key_value_heads": 8, "vocab_size": 128256, "hidden_act": "silu",
    "tie_word_embeddings": False, "rope_theta": 500000.0,
}
OPT_13B_HF = {  # fields of facebook/opt-13b config.json (no tie_word_embeddings: HF default True)
    "model_type": "opt", "hidden_size": 5120, "ffn_dim": 20480, "num_hidden_layers": 40,
    "num_attention_heads": 40, "vocab_size": 50272, "max_position_embeddings": 2048,
    "activation_function": "relu", "word_embed_proj_dim": 5120,
}


def decode_batch(num_seqs: int, context_len: int) -> Batch:
    return Batch(tuple(BatchItem(i, 1, context_len) for i in range(num_seqs)))


def prefill_batch(chunk: int, context_len: int = 0) -> Batch:
    return Batch((BatchItem(0, chunk, context_len),))


# ---- presets -------------------------------------------------------------------
def test_model_preset_arithmetic() -> None:
    opt = MODEL_PRESETS["opt-13b"]
    assert opt.kv_bytes_per_token(2) == 819200 == 800 * 1024      # the vLLM paper's 800 KB/token
    assert abs(MODEL_PRESETS["llama-2-7b"].num_params - 6.74e9) < 0.01e9
    assert abs(MODEL_PRESETS["llama-3.1-8b"].num_params - 8.03e9) < 0.01e9
    assert abs(MODEL_PRESETS["llama-3.1-70b"].num_params - 70.55e9) < 0.1e9


def test_gpu_presets_are_sane() -> None:
    for key, gpu in GPU_PRESETS.items():
        assert gpu.name == key
        assert 30 * 2**30 < gpu.memory_bytes < 150 * 2**30
        assert 100e12 < gpu.peak_flops_bf16 < 1100e12          # dense, not the sparsity figure
        assert 0 < gpu.interconnect_latency_s < 1e-4
    assert GPU_PRESETS["h100-sxm"].interconnect_bytes_s == 450e9
    assert GPU_PRESETS["l40s"].interconnect_bytes_s < 50e9       # PCIe only


def test_hf_config_gives_the_preset_shape() -> None:
    assert model_shape_from_hf(LLAMA_31_8B_HF, "llama-3.1-8b") == MODEL_PRESETS["llama-3.1-8b"]
    assert model_shape_from_hf(OPT_13B_HF, "opt-13b") == MODEL_PRESETS["opt-13b"]
    no_kv = {k: v for k, v in LLAMA_31_8B_HF.items() if k != "num_key_value_heads"}
    assert model_shape_from_hf(no_kv, "x").num_kv_heads == 32   # default: one KV head per head


@pytest.mark.parametrize("missing", ["hidden_size", "num_hidden_layers", "num_attention_heads",
                                     "intermediate_size", "vocab_size", "max_position_embeddings",
                                     "hidden_act"])
def test_hf_config_missing_field_is_named(missing: str) -> None:
    cfg = {k: v for k, v in LLAMA_31_8B_HF.items() if k != missing}
    with pytest.raises(ValueError, match=missing):
        model_shape_from_hf(cfg, "custom")


def test_hf_config_bad_values() -> None:
    with pytest.raises(ValueError, match="hidden_size"):
        model_shape_from_hf({**LLAMA_31_8B_HF, "hidden_size": -1}, "custom")
    with pytest.raises(ValueError, match="num_key_value_heads"):
        model_shape_from_hf({**LLAMA_31_8B_HF, "num_key_value_heads": 5}, "custom")


# ---- memory --------------------------------------------------------------------
def test_opt_13b_on_a100_40gb_matches_vllm_paper_arithmetic() -> None:
    prof = preset_profile("opt-13b", "a100-40gb")
    assert 24e9 <= prof.weight_bytes <= 26e9                     # ~13B params x 2 bytes
    assert prof.kv_bytes_per_token == 819200
    capacity = prof.kv_capacity_tokens(0.9)
    assert capacity > 0
    # 40 GiB x 0.9 - 25.7 GB weights - activations leaves ~10 GB: ~12-15k tokens.
    assert 10_000 < capacity < 16_000


def test_70b_needs_two_h100s() -> None:
    assert preset_profile("llama-3.1-70b", "h100-sxm").kv_capacity_tokens(0.9) == 0
    assert preset_profile("llama-3.1-70b", "h100-sxm", tensor_parallel=2).kv_capacity_tokens(0.9) > 0


def test_memory_facts() -> None:
    prof = preset_profile("llama-3.1-8b", "h200", dtype="fp32")
    model = MODEL_PRESETS["llama-3.1-8b"]
    assert prof.memory_bytes_per_gpu == GPU_PRESETS["h200"].memory_bytes
    assert prof.weight_bytes == model.num_params * 4
    assert prof.kv_bytes_per_token == model.kv_bytes_per_token(4)
    assert 0.5 * 2**30 < prof.activation_bytes_per_gpu < 4 * 2**30


# ---- costs ---------------------------------------------------------------------
def test_decode_at_batch_one_is_weight_bound() -> None:
    for model, gpu, tp in [("llama-2-7b", "a100-80gb", 1), ("llama-3.1-8b", "h100-sxm", 1),
                           ("llama-2-13b", "l40s", 1), ("llama-3.1-70b", "h200", 2)]:
        prof = preset_profile(model, gpu, tensor_parallel=tp)
        eff, g = Efficiency(), GPU_PRESETS[gpu]
        weights_s = prof.weight_bytes / tp / (g.mem_bandwidth_bytes_s * eff.mem_bw)
        expected_s = weights_s + eff.overhead_s
        assert abs(prof.step_time_s(decode_batch(1, 500)) / expected_s - 1) < 0.10, (model, gpu)


def test_efficiencies_put_costs_1_3_to_1_8x_above_peak_roofline() -> None:
    model, gpu = MODEL_PRESETS["llama-2-7b"], GPU_PRESETS["a100-80gb"]
    real = analytic_profile(model, gpu)
    peak = analytic_profile(model, gpu, efficiency=Efficiency.peak())
    assert peak.overhead_s == 0
    for batch in (decode_batch(1, 1000), prefill_batch(2048)):
        ratio = real.step_time_s(batch) / peak.step_time_s(batch)
        assert 1.3 <= ratio <= 1.8, ratio


def test_tensor_parallel_speeds_up_prefill_less_than_linearly() -> None:
    tp1 = preset_profile("llama-3.1-8b", "h100-sxm")
    tp2 = preset_profile("llama-3.1-8b", "h100-sxm", tensor_parallel=2)
    batch = prefill_batch(8192)
    speedup = tp1.step_time_s(batch) / tp2.step_time_s(batch)
    assert 1.2 < speedup < 1.95, speedup


def test_costs_grow_with_work() -> None:
    prof = preset_profile("mistral-7b", "a100-80gb")
    rf = Roofline(MODEL_PRESETS["mistral-7b"], GPU_PRESETS["a100-80gb"])
    for curve, fn in ((prof.attn_prefill, rf.attn_prefill_s), (prof.attn_decode, rf.attn_decode_s)):
        for i, x in enumerate(curve.xs):           # the formula is monotone: no clipping happened
            assert curve.zs[i] == pytest.approx([float(fn(x, y)) for y in curve.ys], rel=1e-12)
    assert prof.linear.ys == pytest.approx([float(rf.linear_s(x)) for x in prof.linear.xs], rel=1e-12)
    times = [prof.step_time_s(decode_batch(n, 1000)) for n in (1, 8, 64, 256)]
    assert times == sorted(times) and times[0] < times[-1]
    times = [prof.step_time_s(prefill_batch(512, ctx)) for ctx in (0, 4096, 32768)]
    assert times == sorted(times) and times[0] < times[-1]
    assert prof.step_time_s(Batch(())) == prof.overhead_s


def test_fp32_is_slower_than_bf16() -> None:
    bf16 = preset_profile("llama-2-7b", "a100-80gb")
    fp32 = preset_profile("llama-2-7b", "a100-80gb", dtype="fp32")
    for batch in (decode_batch(1, 100), prefill_batch(4096)):
        assert fp32.step_time_s(batch) > 1.8 * bf16.step_time_s(batch) - bf16.overhead_s


def test_interpolation_matches_the_formula_off_grid() -> None:
    rng = random.Random(7)
    for model, gpu, tp in [("llama-3.1-8b", "h100-sxm", 1), ("llama-2-7b", "a100-40gb", 1),
                           ("opt-13b", "l40s", 2), ("llama-3.1-70b", "h200", 4)]:
        prof = preset_profile(model, gpu, tensor_parallel=tp)
        rf = Roofline(MODEL_PRESETS[model], GPU_PRESETS[gpu], tp)

        def log_uniform(lo: float, hi: float) -> float:
            return lo * (hi / lo) ** rng.random()

        for _ in range(400):
            tokens = log_uniform(1, 65536)
            assert prof.linear(tokens) == pytest.approx(float(rf.linear_s(tokens)), rel=0.03)
            chunk = log_uniform(1, 32768)
            ctx = log_uniform(1, 131072) if rng.random() < 0.7 else rng.uniform(0, 131072)
            assert prof.attn_prefill(chunk, ctx) == pytest.approx(float(rf.attn_prefill_s(chunk, ctx)), rel=0.03)
            seqs = log_uniform(1, 1024)
            ctx = rng.uniform(0, seqs * 4096)
            assert prof.attn_decode(seqs, ctx) == pytest.approx(float(rf.attn_decode_s(seqs, ctx)), rel=0.03)
        assert prof.num_out_of_range == 0


def test_every_preset_pair_builds_fast() -> None:
    for model in MODEL_PRESETS:
        for gpu in GPU_PRESETS:
            prof = preset_profile(model, gpu)
            assert prof.name == f"{model}@{gpu}-tp1-bf16"
            assert prof.step_time_s(decode_batch(4, 100)) > prof.overhead_s > 0
            assert prof.provenance == {"source": "analytic-roofline", "gpu": gpu, "model": model,
                                       "tensor_parallel": 1, "dtype": "bf16",
                                       "generator": "sim.roofline", "batchsim_format": FORMAT_VERSION,
                                       "max_num_batched_tokens_for_activations": 8192}
            assert "justification" in prof.efficiency
    best_s = min(_timed(lambda: preset_profile("llama-3.1-70b", "h100-sxm", 8)) for _ in range(3))
    assert best_s < 0.05


def _timed(fn) -> float:  # type: ignore[no-untyped-def]
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def test_decode_grid_covers_the_kv_capacity() -> None:
    prof = preset_profile("llama-3.1-8b", "h200", tensor_parallel=8)
    assert prof.attn_decode.ys[-1] >= prof.kv_capacity_tokens(1.0)
    assert prof.attn_decode.xs[-1] >= 1024


def test_custom_hf_dict_equals_the_preset() -> None:
    preset = preset_profile("llama-3.1-8b", "a100-80gb")
    custom = preset_profile({**LLAMA_31_8B_HF, "name": "llama-3.1-8b"}, "a100-80gb")
    assert custom.to_dict() == preset.to_dict()
    opt = preset_profile({**OPT_13B_HF, "_name_or_path": "opt-13b"}, "a100-40gb")
    assert opt.to_dict() == preset_profile("opt-13b", "a100-40gb").to_dict()


def test_unknown_names_and_bad_settings() -> None:
    with pytest.raises(ValueError, match="llama-3.1-8b"):      # the message lists the known names
        preset_profile("gpt-5", "h100-sxm")
    with pytest.raises(ValueError, match="h100-sxm"):
        preset_profile("llama-2-7b", "tpu-v5")
    with pytest.raises(ValueError, match="dtype"):
        preset_profile("llama-2-7b", "h100-sxm", dtype="int3")
    with pytest.raises(ValueError, match="tensor_parallel"):
        preset_profile("llama-3.1-8b", "h100-sxm", tensor_parallel=3)
    with pytest.raises(ValueError, match="tensor_parallel"):
        preset_profile("llama-3.1-8b", "h100-sxm", tensor_parallel=0)
    with pytest.raises(ValueError, match="mem_bw"):
        Efficiency(mem_bw=0.0)
    assert preset_profile("Llama-2-7B", "H100-SXM").device == "h100-sxm"


@pytest.mark.parametrize("suffix", [".yaml", ".json"])
def test_profile_round_trips_through_files(tmp_path, suffix: str) -> None:  # type: ignore[no-untyped-def]
    prof = preset_profile("llama-3.1-8b", "h100-sxm", tensor_parallel=2)
    path = tmp_path / f"profile{suffix}"
    prof.save(path)
    loaded = load_profile(path)
    batches = [decode_batch(1, 1000), decode_batch(64, 1000), prefill_batch(2048),
               prefill_batch(512, 4096),
               Batch((BatchItem(0, 300, 700), BatchItem(1, 1, 90), BatchItem(2, 0, 5, 1)))]
    for batch in batches:
        assert loaded.step_time_s(batch) == prof.step_time_s(batch)
    assert loaded.kv_capacity_tokens(0.9) == prof.kv_capacity_tokens(0.9)
    assert loaded.model == prof.model
    assert loaded.efficiency == dataclasses.asdict(Efficiency())
    assert loaded.provenance == prof.provenance


def test_curves_interpolate_extrapolate_and_count_out_of_range():
    from sim.curves import Curve1D, Curve2D
    c = Curve1D([0, 10, 20], [0, 1, 3])
    # inside: linear; past the ends: the edge segment's slope, floored at 0
    for x, y in [(-5, 0.0), (0, 0), (5, 0.5), (10, 1), (15, 2), (20, 3), (25, 4)]:
        assert c(x) == pytest.approx(y)
    assert c.num_out_of_range == 2                  # -5 and 25; 0 and 20 are on the grid
    d = Curve2D([0, 10], [0, 10], [[0, 1], [2, 3]])
    for x, y, z in [(0, 0, 0), (10, 10, 3), (5, 5, 1.5), (10, 0, 2), (0, 10, 1), (20, 0, 4)]:
        assert d(x, y) == pytest.approx(z)
    assert d.num_out_of_range == 1
    # fitted values are made monotone: a cost never falls as the work grows
    assert Curve1D([0, 1, 2], [1.0, 0.5, 2.0]).ys == [1.0, 1.0, 2.0]

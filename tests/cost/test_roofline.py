"""Tests of the GPU/model presets and the analytic roofline profiles."""

from __future__ import annotations

import csv
import dataclasses
import math
import random
import statistics
import time
import warnings
from pathlib import Path

import numpy as np
import pytest

from sim.core.batch import Batch, BatchItem
from sim.cost.curves import Curve1D, Curve2D, CurveRepairWarning, isotonic, isotonic_grid
from sim.cost.presets import GENERATIONS, GPU_PRESETS, MODEL_PRECISIONS, MODEL_PRESETS, model_shape_from_hf
from sim.cost.profile import FORMAT_VERSION, ProfileError, load_profile, profile_from_dict
from sim.cost.roofline import Efficiency, Roofline, analytic_profile, overlap_time, preset_profile

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
        assert 20 * 2**30 < gpu.memory_bytes < 300 * 2**30       # Arc Pro B60: 24 GiB; GB300: 284,208 MiB
        assert 90e12 < gpu.peak_flops_bf16 < 2600e12           # dense, not the sparsity figure (B60: 98.3 TF)
        assert 0 < gpu.interconnect_latency_s < 1e-4
        assert gpu.generation in GENERATIONS
        # Dense FP8 doubles BF16 where the hardware has it; FP4 doubles FP8, and Blackwell Ultra
        # (B300, GB300) triples it (14 and 15 PF dense against 4.5 and 5); Ampere and Xe2 have neither.
        if gpu.peak_flops_fp8:
            assert gpu.peak_flops_fp8 == pytest.approx(2 * gpu.peak_flops_bf16, rel=0.02)
        if gpu.peak_flops_fp4:
            ratio = gpu.peak_flops_fp4 / gpu.peak_flops_fp8
            assert ratio == pytest.approx(2) or (key in ("b300-sxm", "gb300") and ratio == pytest.approx(3, rel=0.05))
        # a price is known, or unknown by name (the Arc Pro B60 has no public cloud offer)
        assert (gpu.price_per_gpu_hour is None and key == "arc-pro-b60") or 0.3 < gpu.price_per_gpu_hour < 10
    assert GPU_PRESETS["a100-80gb"].peak_flops_fp8 == 0 and GPU_PRESETS["h200"].peak_flops_fp4 == 0
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
    with pytest.raises(ValueError, match="num_heads 32 is not divisible by num_kv_heads 5"):
        model_shape_from_hf({**LLAMA_31_8B_HF, "num_key_value_heads": 5}, "custom")
    with pytest.raises(ValueError, match="field 'head_dim' must be a positive integer"):
        model_shape_from_hf({**LLAMA_31_8B_HF, "head_dim": -64}, "custom")
    # A separate head_dim is a fact of the model (Qwen3, gpt-oss), not an error: 32 heads x 64.
    assert model_shape_from_hf({**LLAMA_31_8B_HF, "head_dim": 64}, "custom").head_dim == 64
    # head_dim equal to hidden / heads is the derived shape itself.
    assert model_shape_from_hf({**LLAMA_31_8B_HF, "head_dim": 128}, "x").kv_bytes_per_token(2) == 131072


def test_hf_config_rope_theta_and_name() -> None:
    assert model_shape_from_hf(LLAMA_31_8B_HF, "x").rope_theta == 500000.0
    # transformers 5 writes the RoPE base inside rope_parameters
    new_style = {**{k: v for k, v in LLAMA_31_8B_HF.items() if k != "rope_theta"},
                 "rope_parameters": {"rope_theta": 500000.0, "rope_type": "llama3"}}
    assert model_shape_from_hf(new_style, "x").rope_theta == 500000.0
    assert model_shape_from_hf(OPT_13B_HF, "x").rope_theta == 10000.0          # none given: the default
    assert model_shape_from_hf(LLAMA_31_8B_HF).name == "custom"
    assert model_shape_from_hf({**LLAMA_31_8B_HF, "_name_or_path": "meta-llama/Llama-3.1-8B"}).name \
        == "meta-llama/Llama-3.1-8B"


@pytest.mark.parametrize(("change", "message"), [
    ({"hidden_size": 0}, "hidden_size must be a positive integer, got 0"),
    ({"num_layers": True}, "num_layers must be a positive integer, got True"),
    ({"num_heads": 3}, "hidden_size 4096 is not divisible by num_heads 3"),
    ({"mlp": "relu"}, "mlp must be one of swiglu, gelu, got 'relu'"),
    ({"rope_theta": -1.0}, "rope_theta must be a positive number, got -1.0"),
])
def test_model_shape_validates_on_construction(change: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        dataclasses.replace(MODEL_PRESETS["llama-3.1-8b"], **change)


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
        # + the engine's host work (per step, per sequence, per step at TP > 1) and every
        # layer's kernel floor; what is left is the all-reduces (TP 2) and the KV read
        fixed_s = (eff.overhead_s + eff.per_seq_s + (eff.tp_overhead_s if tp > 1 else 0.0)
                   + MODEL_PRESETS[model].num_layers * eff.layer_fixed_s)
        assert abs(prof.step_time_s(decode_batch(1, 500)) / (weights_s + fixed_s) - 1) < 0.10, (model, gpu)


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


def test_fp32_matmuls_run_at_the_plain_fp32_peak() -> None:
    # vLLM keeps float32 matmuls at "highest" precision (no TF32), so a compute-bound fp32 prefill
    # runs at the FP32 peak. Llama-3.1-8B, 4096 tokens, peak efficiency: layer matmul FLOPs
    # 2 x 4096 x 32 x (2 x 4096^2 + 2 x 4096 x 1024 + 3 x 4096 x 14336) plus the LM head's
    # 2 x 256 x 4096 x 128256 (min(T, 256) rows); on A100 19.5 TFLOPS (fp32) vs 312 (bf16): 16x;
    # on L40S 91.6 vs 362: 3.95x (TF32 would have been 2x on both).
    h, layers, inter, vocab = 4096, 32, 14336, 128256
    flops = 2 * 4096 * layers * (2 * h * h + 2 * h * 1024 + 3 * h * inter) + 2 * 256 * h * vocab
    for gpu, fp32_peak in (("a100-80gb", 19.5e12), ("l40s", 91.6e12)):
        fp32 = Roofline(MODEL_PRESETS["llama-3.1-8b"], GPU_PRESETS[gpu], 1, "fp32", Efficiency.peak())
        bf16 = Roofline(MODEL_PRESETS["llama-3.1-8b"], GPU_PRESETS[gpu], 1, "bf16", Efficiency.peak())
        assert fp32.linear_s(4096) == pytest.approx(flops / fp32_peak, rel=1e-9)
        assert bf16.linear_s(4096) == pytest.approx(flops / GPU_PRESETS[gpu].peak_flops_bf16, rel=1e-9)


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
            # A checkpoint that ships quantized weights (gpt-oss: mxfp4 experts; DeepSeek-R1: FP8; Kimi-K2.5:
            # INT4 experts) says so in the name.
            shipped = MODEL_PRECISIONS.get(model)
            label = (f"-w_{shipped[0]}" + ("-experts" if shipped[1] == "experts" else "")) if shipped else ""
            assert prof.name == f"{model}@{gpu}-tp1-bf16{label}"
            assert prof.step_time_s(decode_batch(4, 100)) > prof.overhead_s > 0
            g = GPU_PRESETS[gpu]
            # the GEMM class: the format's tensor cores where the GPU has them, else weight-only (Marlin)
            gemm = {"mxfp4": "fp4" if g.peak_flops_fp4 else "w4a16", "fp8": "fp8" if g.peak_flops_fp8 else "w8a16",
                    "int4": "w4a16"}
            notes = ({"weight_dtype": shipped[0], "quantized": shipped[1],
                      "gemm_precision": gemm[shipped[0]]} if shipped else {})
            assert prof.provenance == {"source": "analytic-roofline", "gpu": gpu, "model": model,
                                       "tensor_parallel": 1, "dtype": "bf16",
                                       "generator": "sim.cost.roofline", "batchsim_format": FORMAT_VERSION,
                                       "activations": "fixed + per token x the policy's "
                                                      "max_num_batched_tokens (vLLM's profiling run)", **notes}
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
    assert loaded.model == prof.model and loaded.model.rope_theta == 500000.0
    assert loaded.efficiency == dataclasses.asdict(Efficiency.for_gpu(GPU_PRESETS["h100-sxm"]))
    assert loaded.provenance == prof.provenance


def test_profile_without_rope_theta_loads_with_the_default() -> None:
    data = preset_profile("llama-3.1-8b", "h100-sxm").to_dict()
    del data["model"]["rope_theta"]                  # a file written before ModelShape had it
    assert profile_from_dict(data).model.rope_theta == 10000.0
    data["model"]["rope_theta"] = "fast"
    with pytest.raises(ProfileError, match="field 'model.rope_theta' must be a number"):
        profile_from_dict(data)


def test_curves_interpolate_extrapolate_and_count_out_of_range():
    c = Curve1D([0, 10, 20], [0, 1, 3])
    # inside: linear; past the ends: the edge segment's slope, floored at 0
    for x, y in [(-5, 0.0), (0, 0), (5, 0.5), (10, 1), (15, 2), (20, 3), (25, 4)]:
        assert c(x) == pytest.approx(y)
    assert c.num_out_of_range == 2                  # -5 and 25; 0 and 20 are on the grid
    d = Curve2D([0, 10], [0, 10], [[0, 1], [2, 3]])
    for x, y, z in [(0, 0, 0), (10, 10, 3), (5, 5, 1.5), (10, 0, 2), (0, 10, 1), (20, 0, 4)]:
        assert d(x, y) == pytest.approx(z)
    assert d.num_out_of_range == 1
    # fitted values are made monotone: a cost never falls as the work grows (and the repair says so)
    with pytest.warns(CurveRepairWarning, match=r"curve: values not monotone; the repair moved 1 of 3"):
        assert Curve1D([0, 1, 2], [1.0, 0.5, 2.0]).ys == [1.0, 1.0, 2.0]


def test_monotone_repair_is_local_and_smallest():
    # A spike is levelled with its neighbours, not copied into every later value (a running
    # maximum would give [1, 2, 100, 100, 100, 100]). The least total change is 96 (100 -> 4,
    # or 100 -> 5 and 4 -> 5); the value out of order with the most others (100: with 4, 5, 6)
    # is the one that moves, so only one value changes.
    with pytest.warns(CurveRepairWarning, match=r"moved 1 of 6 by more than 5% \(largest at \(2\): 100 -> 4"):
        spiky = Curve1D([0, 1, 2, 3, 4, 5], [1.0, 2.0, 100.0, 4.0, 5.0, 6.0])
    assert spiky.ys == [1.0, 2.0, 4.0, 4.0, 5.0, 6.0]
    assert [(r.index, r.before, r.after) for r in spiky.repairs] == [((2,), 100.0, 4.0)]
    # A small repair is made silently: 9.28 ms at 1 token > 8.96 ms at 2 tokens (Vidur's A100
    # Llama-2-7B mlp.csv) levels 9.28 down to 8.96 (-3.4%, under the 5% that is reported).
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        quiet = Curve1D([1, 2, 4, 8, 16], [9.28, 8.96, 9.02, 9.06, 9.54])
    assert quiet.ys == [8.96, 8.96, 9.02, 9.06, 9.54] and quiet.repairs == []
    # 2-D: a cell above its right (3.0) and lower (4.0) neighbours is lowered to 3.0, the
    # largest value both allow; nothing else moves. A dip is raised the same way.
    with pytest.warns(CurveRepairWarning, match=r"moved 1 of 9"):
        d = Curve2D([0, 1, 2], [0, 1, 2], [[0.5, 2.0, 2.5], [1.0, 50.0, 3.0], [1.5, 4.0, 5.0]])
    assert d.zs == [[0.5, 2.0, 2.5], [1.0, 3.0, 3.0], [1.5, 4.0, 5.0]]
    assert isotonic_grid([[0.5, 2.0, 2.5], [1.0, 0.01, 3.0], [1.5, 4.0, 5.0]]) == \
        [[0.5, 2.0, 2.5], [1.0, 2.0, 3.0], [1.5, 4.0, 5.0]]
    # A filled cell (small weight) yields to measured ones: the measured 2.0 after a filled 9.0
    # stays, the filled cell comes down to it.
    assert isotonic([1.0, 9.0, 2.0, 3.0], [1.0, 1e-6, 1.0, 1.0]) == [1.0, 2.0, 2.0, 3.0]
    # A monotone table comes back unchanged, as the very same values.
    assert isotonic_grid([[0.0, 1.0], [1.0, 1.0]]) == [[0.0, 1.0], [1.0, 1.0]]


# ---- near the ridge point ----------------------------------------------------------------------
VIDUR_A100_MLP = Path(__file__).resolve().parents[1] / "fixtures" / "vidur_a100" / "mlp_tp1.csv"   # MIT, see its README
LAYER_OPS = ("input_layernorm", "attn_pre_proj", "attn_rope", "attn_post_proj", "post_attention_layernorm",
             "mlp_up_proj", "mlp_act", "mlp_down_proj", "add")


def _vidur_a100_linear_ms() -> dict[int, float]:
    """Vidur's A100 Llama-2-7B medians: the token-parallel operators of one layer summed, x 32 layers
    (ms); the median over duplicate rows."""
    rows: dict[int, list[float]] = {}
    with open(VIDUR_A100_MLP, newline="") as f:
        for r in csv.DictReader(f):
            layer_ms = sum(float(r[f"time_stats.{op}.median"]) for op in LAYER_OPS)
            rows.setdefault(int(r["num_tokens"]), []).append(32 * layer_ms)
    return {t: statistics.median(v) for t, v in rows.items()}


def test_linear_is_within_10_percent_of_vidur_a100_medians() -> None:
    measured = _vidur_a100_linear_ms()
    # Measured (ms): 32 tokens 9.536; 128 tokens 12.240; 512 tokens 33.360; 2048 tokens 133.464
    # (two rows, 133.504 and 133.424). Our linear() also charges the LM head, which Vidur does not
    # profile (~0.18 ms of weight streaming at small batches, <1% at 2048 tokens).
    assert [measured[t] for t in (32, 128, 512, 2048)] == pytest.approx([9.536, 12.240, 33.360, 133.464], abs=1e-9)
    prof = preset_profile("llama-2-7b", "a100-80gb")
    # Ours: 9.54, 12.34, 34.20, 131.65 ms (+0.0%, +0.8%, +2.5%, -1.4%).
    for tokens in (32, 128, 512, 2048):
        assert prof.linear(tokens) * 1e3 == pytest.approx(measured[tokens], rel=0.10), tokens
    # The hard max(compute, memory) is 21% fast at 128 tokens (10.06 ms), where both limits are partly active.
    hard = analytic_profile(MODEL_PRESETS["llama-2-7b"], GPU_PRESETS["a100-80gb"],
                            efficiency=dataclasses.replace(Efficiency(), pipeline_stages=math.inf))
    assert hard.linear(128) * 1e3 < measured[128] / 1.15


def test_ridge_law_is_a_smooth_maximum_that_moves_with_the_gpu() -> None:
    # (c^(S+1) - m^(S+1)) / (c^S - m^S): S = 1 is no overlap (c + m); S = 3 gives 4/3 x c at c = m,
    # (1 + 0.5 + 0.25 + 0.125) / (1 + 0.5 + 0.25) = 1.0714 at c = m / 2, and max(c, m) far from the ridge.
    assert overlap_time(2.0, 1.0, 1) == 3.0
    assert overlap_time(1.0, 1.0, 3) == pytest.approx(4 / 3, rel=1e-12)
    assert overlap_time(0.5, 1.0, 3) == pytest.approx(1.875 / 1.75, rel=1e-12) == overlap_time(1.0, 0.5, 3)
    assert overlap_time(0.01, 1.0, 3) == pytest.approx(1.0, rel=1e-5)
    assert overlap_time(0.5, 1.0, math.inf) == 1.0
    assert overlap_time(0.0, 0.0, 3) == 0.0
    with pytest.raises(ValueError, match="pipeline_stages"):
        Efficiency(pipeline_stages=2.5)
    # One law for every GPU: the penalty depends only on c / m, so it peaks where the GPU's ridge is:
    # ~157 tokens on A100 (312 TFLOP/s : 2.0 TB/s), ~340 on H100 (989 : 3.35), >= 15% over
    # max(c, m) for 105-240 and 216-555 tokens: together the 96-768 tokens of the published medians.
    # (The fitted efficiencies, matmul 0.68 and mem_bw 0.83, put the achieved ridges at ~137 and ~290
    # tokens; the layers' kernel floor is set to 0 here so the law is seen alone.)
    tokens = np.arange(1, 4097)
    for gpu, ridge_lo, ridge_hi in (("a100-80gb", 120, 160), ("h100-sxm", 260, 330)):
        alone = dataclasses.replace(Efficiency(), layer_fixed_s=0.0)
        law = Roofline(MODEL_PRESETS["llama-2-7b"], GPU_PRESETS[gpu], efficiency=alone)
        hard = Roofline(MODEL_PRESETS["llama-2-7b"], GPU_PRESETS[gpu],
                        efficiency=dataclasses.replace(alone, pipeline_stages=math.inf))
        excess = law.linear_s(tokens) / hard.linear_s(tokens)
        assert ridge_lo < tokens[excess.argmax()] < ridge_hi and excess.max() == pytest.approx(4 / 3, rel=0.002)
        # Far from the ridge it is the roofline again (at 4096 tokens on H100 activation traffic is still
        # ~27% of the compute time: +1.3%).
        assert excess[tokens == 8][0] < 1.001 and excess[tokens == 4096][0] < 1.02
    assert preset_profile("llama-2-7b", "h100-sxm").efficiency["pipeline_stages"] == 3
    assert "c^(S+1)" in preset_profile("llama-2-7b", "h100-sxm").efficiency["ridge_law"]


def test_replaced_linear_curve_is_not_served_from_the_old_memo() -> None:
    """step_time_s memoizes linear(tokens); a profile made with dataclasses.replace and a
    new linear curve must price with the new curve, not the memo of the old one."""
    import dataclasses

    from sim.core.batch import Batch, BatchItem
    from sim.cost.curves import Curve1D
    base = preset_profile("llama-2-7b", "a100-80gb")
    batch = Batch((BatchItem(0, 1, 100),))
    before = base.step_time_s(batch)                 # fills the memo for 1 token
    doubled = dataclasses.replace(base, linear=Curve1D(base.linear.xs, [2 * y for y in base.linear.ys]))
    # The only change is linear(1), so the step grows by exactly linear(1).
    assert doubled.step_time_s(batch) == pytest.approx(before + base.linear(1), rel=1e-12)

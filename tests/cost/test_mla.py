"""Multi-head latent attention (DeepSeek-V3/R1, Kimi-K2): the shape read from the real
configs (tests/fixtures/hf_configs/), its KV cache replicated on every TP rank, its weights,
the roofline's absorbed decode and un-absorbed prefill, and the kernel tables' MLA modules.
Every number is worked by hand from the public config.json in the comments."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest

from sim.cost.efficiency import Efficiency
from sim.cost.precision import Precision, precision_from_hf
from sim.cost.presets import GPU_PRESETS, MODEL_PRESETS, model_shape_from_hf
from sim.cost.profile import load_profile
from sim.cost.roofline import Roofline
from sim.cost.shape import ModelShape

CONFIGS = Path(__file__).resolve().parents[1] / "fixtures" / "hf_configs"


def config(name: str) -> dict:
    return json.loads((CONFIGS / name / "config.json").read_text())


def test_deepseek_r1_mla_shape_params_and_kv_by_hand() -> None:
    m = model_shape_from_hf(config("DeepSeek-R1"), "deepseek-r1")
    assert m == MODEL_PRESETS["deepseek-r1"]
    assert m.is_mla and m.mla_latent_dim == 512 + 64
    # KV: 61 layers x (kv_lora_rank 512 + qk_rope_head_dim 64) x 2 B = 70,272 B a token, one copy
    # (not 2 x 61 x 128 KV heads x 56 x 2 = 1,748,992, what K and V heads would take); FP8: 35,136
    assert m.kv_bytes_per_token(2) == 61 * 576 * 2 == 70_272
    assert m.kv_bytes_per_token(1) == 35_136
    # a layer's attention: q_a 7168 x 1536 = 11,010,048; q_b 1536 x 128 x (128 + 64) = 37,748,736;
    # kv_a 7168 x 576 = 4,128,768; kv_b 512 x 128 x (128 + 128) = 16,777,216; o 128 x 128 x 7168
    # = 117,440,512: 187,105,280 in all, of which q_a and kv_a, 7168 x (1536 + 576) = 15,138,816,
    # are whole on every rank
    assert m.attn_params_per_layer == 11_010_048 + 37_748_736 + 4_128_768 + 16_777_216 + 117_440_512 == 187_105_280
    assert m.attn_replicated_params_per_layer == 15_138_816
    # 61 x 187,105,280 attention + 3 dense MLPs of 3 x 7168 x 18432 = 396,361,728 + 58 MoE layers of
    # (router 7168 x 256 = 1,835,008 + shared 3 x 7168 x 2048 = 44,040,192 + 256 experts x 44,040,192)
    # + embedding and LM head 2 x 129280 x 7168 = 1,853,358,080: 671,025,397,760 (DeepSeek's "671B")
    assert m.num_params == (61 * 187_105_280 + 3 * 396_361_728 + 58 * (1_835_008 + 44_040_192 + 256 * 44_040_192)
                            + 1_853_358_080) == 671_025_397_760
    # active: less 58 x (256 - 8) x 44,040,192 = 633,474,121,728 unused experts: 37,551,276,032 ("37B")
    assert m.num_active_params == 671_025_397_760 - 633_474_121_728 == 37_551_276_032


def test_kimi_k25_is_read_from_its_text_config_with_int4_experts() -> None:
    cfg = config("Kimi-K2.5")
    assert "hidden_size" not in cfg and "text_config" in cfg          # a multimodal wrapper, unchanged
    m = model_shape_from_hf(cfg, "kimi-k2.5")
    assert m == MODEL_PRESETS["kimi-k2.5"]
    # 64 heads: q_a 7168 x 1536 + q_b 1536 x 64 x 192 + kv_a 7168 x 576 + kv_b 512 x 64 x 256
    # + o 64 x 128 x 7168 = 11,010,048 + 18,874,368 + 4,128,768 + 8,388,608 + 58,720,256 = 101,122,048
    assert m.attn_params_per_layer == 101_122_048
    # the same latent as DeepSeek-V3: 61 x 576 x 2 = 70,272 B a token
    assert m.kv_bytes_per_token(2) == 70_272
    # 61 x 101,122,048 + 1 dense MLP (396,361,728) + 60 MoE layers x (7168 x 384 + 44,040,192 + 384 x
    # 44,040,192) + 2 x 163840 x 7168: 1,026,407,202,816 ("1T"), 1,014,686,023,680 of them experts
    assert m.num_params == 1_026_407_202_816 and m.num_expert_params == 60 * 384 * 44_040_192
    # compressed-tensors INT4 (group 32) whose ignore list keeps attention and shared experts bf16
    assert precision_from_hf(cfg, "kimi") == ("int4", "experts")
    assert Precision(weight_dtype="int4", quantized="experts").weight_bytes_per_param == 0.5 + 2 / 32
    assert Precision(weight_dtype="int4").gemm_precision(GPU_PRESETS["b200-sxm"]) == "w4a16"   # no INT4 tensor cores


def test_mla_kv_and_weights_on_eight_gpus() -> None:
    m = MODEL_PRESETS["deepseek-r1"]
    prec = Precision(weight_dtype="fp8")
    rf = Roofline(m, GPU_PRESETS["h200"], 8, precision=prec, expert_parallel=True)
    # each of the 8 ranks caches the whole latent: 8 x 70,272 = 562,176 B a token, all ranks
    assert rf.kv_bytes_per_token == 8 * 70_272 == 562_176
    # FP8 everywhere but the embedding, LM head and routers (bf16): 671,025,397,760 - 1,853,358,080
    # - 58 x 1,835,008 = 669,065,609,216 B + (1,853,358,080 + 106,430,464) x 2 = 3,919,577,088 B;
    # plus 7 more copies of q_a and kv_a: 7 x 61 x 15,138,816 x 1 B = 6,464,274,432 B
    assert rf.weight_bytes == 669_065_609_216 + 3_919_577_088 + 6_464_274_432 == 679_449_460_736


def ideal() -> Efficiency:
    """Peak rates, no pipelining blur (time = max(compute, memory)), no host work."""
    return dataclasses.replace(Efficiency(), matmul_flops=1.0, mem_bw=1.0, attn_flops=1.0, attn_mem_bw=1.0,
                               pipeline_stages=math.inf, per_seq_s=0.0, overhead_s=0.0, tp_overhead_s=0.0)


def test_mla_decode_reads_the_whole_latent_on_every_rank() -> None:
    m = MODEL_PRESETS["deepseek-r1"]
    h200 = GPU_PRESETS["h200"]            # 989 TFLOPS bf16, 4.8 TB/s
    # one decode over 100,000 cached tokens sees 100,001 keys: it reads 100,001 x 61 x 576 x 2 B =
    # 7,027,270,272 B, 1.46401 ms at 4.8 TB/s whatever t (GQA's reads would shrink t-fold); its math,
    # 100,001 x 2 x (128 / t heads) x (2 x 512 + 64) x 61 = 1.6990e12 / t FLOPs, is 1.71794 ms / t at
    # 989 TFLOPS: compute-bound on one GPU, memory-bound on eight
    expected = {1: 1.717935e-3, 8: 1.464015e-3}
    for t in (1, 8):
        rf = Roofline(m, h200, t, efficiency=ideal())
        mem_s = 100_001 * 61 * 576 * 2 / 4800e9
        flops = 100_001 * 2 * (128 / t) * (2 * 512 + 64) * 61
        assert rf.attn_decode_s(1, 100_000) == pytest.approx(max(mem_s, flops / 989e12), rel=1e-9)
        assert rf.attn_decode_s(1, 100_000) == pytest.approx(expected[t], rel=1e-6)


def test_mla_prefill_attends_in_the_unabsorbed_form() -> None:
    m = MODEL_PRESETS["deepseek-r1"]
    rf = Roofline(m, GPU_PRESETS["h200"], 8, efficiency=ideal())
    # a 4,096-token prompt: 4096 x 4097 / 2 = 8,390,656 (query, key) pairs, 2 x 16 heads x (128 + 64 +
    # 128) x 61 layers = 624,640 FLOPs each: 5.2412e12 FLOPs, 5.2994 ms at 989 TFLOPS; its KV writes
    # and reads, 2 x 4096 x 70,272 B, take 0.12 ms: compute-bound
    assert rf.attn_prefill_s(4096, 0) == pytest.approx(8_390_656 * 624_640 / 989e12, rel=1e-9)
    # the same chunk over 8,192 earlier tokens also re-expands their latents through kv_b: 8192 x 2 x
    # 16 x 512 x (128 + 128) x 61 = 2.0468e12 FLOPs, beside 4096 x (8192 + 2048.5) pairs x 624,640
    pairs = 4096 * (8192 + 4097 / 2)
    up = 8192 * 2 * 16 * 512 * 256 * 61
    assert rf.attn_prefill_s(4096, 8192) == pytest.approx((pairs * 624_640 + up) / 989e12, rel=1e-9)


def test_deepseek_v32_and_glm5_sparse_attention_by_hand() -> None:
    v32 = model_shape_from_hf(config("DeepSeek-V3.2"), "deepseek-v3.2")
    assert v32 == MODEL_PRESETS["deepseek-v3.2"] and v32.is_dsa
    # the indexer a layer: wq_b 1536 x 64 x 128 = 12,582,912, wk 7168 x 128 = 917,504, weights_proj 7168 x 64
    # = 458,752: 13,959,168, whole on every rank, beside DeepSeek-V3's 187,105,280 of MLA
    assert v32.attn_params_per_layer == 187_105_280 + 12_582_912 + 917_504 + 458_752 == 201_064_448
    assert v32.attn_replicated_params_per_layer == 15_138_816 + 13_959_168 == 29_097_984
    # KV a layer: the latent and RoPE key (576 x 2 = 1,152 B; FP8 as vLLM's fp8_ds_mla: 512 + 4 x 4 scales +
    # 64 x 2 = 656 B) and the indexer's key (128 FP8 + one fp32 scale = 132 B): x 61 layers
    assert v32.kv_bytes_per_token(2) == 61 * (1152 + 132) == 78_324
    assert v32.kv_bytes_per_token(1) == 61 * (656 + 132) == 48_068
    glm = model_shape_from_hf(config("GLM-5"), "glm-5")
    assert glm == MODEL_PRESETS["glm-5"]
    # q_a + q_b 6144 x 2048 + 2048 x 64 x (192 + 64) = 46,137,344; kv_a 6144 x 576 = 3,538,944; kv_b
    # 512 x 64 x (192 + 256) = 14,680,064; o 64 x 256 x 6144 = 100,663,296; indexer 2048 x 32 x 128 +
    # 6144 x 128 + 6144 x 32 = 9,371,648
    assert glm.attn_params_per_layer == 46_137_344 + 3_538_944 + 14_680_064 + 100_663_296 + 9_371_648 == 174_391_296
    assert glm.kv_bytes_per_token(2) == 78 * (1152 + 132) == 100_152
    # MiniMax-M2.5 is plain GQA: 2 x 62 layers x 8 KV heads x 128 x 2 B
    mm = model_shape_from_hf(config("MiniMax-M2.5"), "minimax-m2.5")
    assert mm == MODEL_PRESETS["minimax-m2.5"]
    assert mm.kv_bytes_per_token(2) == 2 * 62 * 8 * 128 * 2 == 253_952 and (mm.num_experts, mm.num_experts_per_tok) == (256, 8)


def test_sparse_attention_decode_and_prefill_on_the_roofline() -> None:
    m = MODEL_PRESETS["deepseek-v3.2"]
    rf = Roofline(m, GPU_PRESETS["h200"], 8, efficiency=ideal())      # 989 TFLOPS bf16, 1,979 FP8, 4.8 TB/s
    # one decode over 100,000 cached tokens (100,001 keys): the indexer scores all of them, 2 x 64 x 128 x
    # 61 = 999,424 FP8 FLOPs each (9.9944e10: 50.5 us at 1,979 TFLOPS), reading 132 x 61 = 8,052 B each;
    # attention takes the top 2,048: 2 x 16 x (2 x 512 + 64) x 61 = 2,123,776 FLOPs (4.4 us) and 1,152 x 61
    # = 70,272 B each. Bytes: 100,001 x 8,052 + 2,048 x 70,272 = 949,125,108 B, 197.734 us: memory-bound
    compute = 100_001 * 999_424 / 1979e12 + 2048 * 2_123_776 / 989e12
    memory = (100_001 * 8_052 + 2048 * 70_272) / 4800e9
    assert memory > compute
    assert rf.attn_decode_s(1, 100_000) == pytest.approx(memory, rel=1e-9) == pytest.approx(197.734e-6, rel=1e-5)
    # dense MLA reads the whole latent: 100,001 x 70,272 B, 1.464 ms (test above): 7.4 times as long
    # a 4,096-token prompt: the indexer over 4096 x 4097 / 2 = 8,390,656 pairs; attention over each query's
    # min(i + 1, 2048) keys: 2048 x 2049 / 2 + 2048 x 2048 = 6,292,480 pairs, in the absorbed form
    compute = 8_390_656 * 999_424 / 1979e12 + 6_292_480 * 2_123_776 / 989e12
    memory = (2 * 4096 * 8_052 + 2 * 4096 * 70_272) / 4800e9
    assert compute > memory
    assert rf.attn_prefill_s(4096, 0) == pytest.approx(compute, rel=1e-9)


@pytest.mark.parametrize("fields, words", [
    ({"kv_lora_rank": 512}, "multi-head latent attention needs kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim, "
                            "v_head_dim; qk_nope_head_dim, qk_rope_head_dim, v_head_dim missing"),
    ({"q_lora_rank": 1536}, "q_lora_rank set without kv_lora_rank"),
])
def test_a_partial_mla_shape_is_refused_by_field(fields: dict, words: str) -> None:
    with pytest.raises(ValueError, match=words):
        ModelShape("x", 1024, 2, 8, 8, 4096, 1000, 4096, **fields)


def test_the_torch_engine_refuses_mla() -> None:
    pytest.importorskip("torch")
    from calibrate.model import check_buildable
    dense = ModelShape("dense-mla", 2048, 4, 16, 16, 8192, 1000, 4096, kv_lora_rank=512, qk_nope_head_dim=128,
                       qk_rope_head_dim=64, v_head_dim=128)
    with pytest.raises(ValueError, match="kv_lora_rank is 512 \\(multi-head latent attention\\)"):
        check_buildable(dense)


# ---- the kernel tables' MLA modules (the kernels extra) ---------------------------------------
@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("kernel-cache")


def test_deepseek_r1_kernel_profile_prices_mla_from_its_modules(cache: Path) -> None:
    pytest.importorskip("aiconfigurator_core", reason="the kernels extra (aiconfigurator-core) is not installed")
    from sim.cost.kernels import HostTerms, KernelSpec, kernel_profile
    none = HostTerms("none", 0.0, 0.0, 0.0, 0.0, "kernels only")
    spec = KernelSpec(model="deepseek-r1", gpu="h200", engine="vllm", tensor_parallel=8, expert_parallel=True)
    p = kernel_profile(spec, none, cache)
    assert p.kv_bytes_per_token == 562_176 and p.model.is_mla
    tables = p.provenance["tables"]
    assert {"mla_context_module_perf.parquet", "mla_generation_module_perf.parquet"} <= set(tables)
    assert tables["mla_context_module_perf.parquet"]["channel"] == "primary"
    # the decode module's time grows with the context it reads
    assert p.attn_decode(64, 512) < p.attn_decode(64, 4096) < p.attn_decode(64, 16384)
    # read back from its cache file: the MLA fields survive the profile format
    path = next((cache / "kernels").glob(f"{p.provenance['cache_key']}.json"))
    assert load_profile(path).model == p.model == MODEL_PRESETS["deepseek-r1"]



def test_sglang_prices_mla_with_its_fallback_kernels_at_bf16_math() -> None:
    pytest.importorskip("aiconfigurator_core", reason="the kernels extra (aiconfigurator-core) is not installed")
    from sim.cost import aic
    version = aic.resolve_version("h200_sxm", "sglang", None)
    # SGLang's MLA module was not measured: the block's fallback graph (GEMMs, MLA kernels, MLA BMMs)
    # answers, from tables measured with bf16 attention math only; the FP8 checkpoint's default (fp8
    # attention) has no rows there, which is why kernels.build_tables asks for bf16
    t = aic.KernelTables("deepseek-ai/DeepSeek-R1", "h200_sxm", "sglang", version, 8, expert_parallel=True,
                         kvcache_quant_mode="bfloat16", fmha_quant_mode="bfloat16")
    assert t.mla and t.quant_modes["fmha"] == "bfloat16"
    assert 0 < t.prefill_attention_ms(1024, 0) < t.prefill_attention_ms(1024, 8192)
    assert 0 < t.decode_attention_ms(64, 1024) < t.decode_attention_ms(64, 16384)
    assert {"context_mla_perf.parquet", "generation_mla_perf.parquet"} <= set(t.tables())
    fp8 = aic.KernelTables("deepseek-ai/DeepSeek-R1", "h200_sxm", "sglang", version, 8, expert_parallel=True,
                           kvcache_quant_mode="bfloat16")
    with pytest.raises(Exception, match="context MLA data missing"):
        fp8.prefill_attention_ms(1024, 0)


def test_the_bundled_deepseek_r1_workload_runs_with_the_latent_pool(tmp_path: Path, capsys) -> None:
    pytest.importorskip("aiconfigurator_core", reason="the kernels extra (aiconfigurator-core) is not installed")
    from sim.cli import main
    from sim.cost.kernels import cache_dir
    root = Path(__file__).resolve().parents[2]
    out = tmp_path / "run"
    assert main(["run", str(root / "workloads" / "deepseek_r1_h200.yaml"), "--out", str(out), "--quiet",
                 "--set", "num_requests=40"]) == 0
    meta = json.loads((out / "meta.json").read_text())
    knobs = meta["policy_knobs"]
    assert (knobs["max_num_seqs"], knobs["max_num_batched_tokens"]) == (1024, 8192)
    p = load_profile(next((cache_dir() / "kernels").glob(f"{meta['profile_provenance']['cache_key']}.json")))
    # vLLM's pool: 8 GPUs x 143,771 MiB x 0.9, less the weights (679,449,460,736 B) and per GPU the larger
    # of a step's activations and the sampler warm-up (16 B x 129,280 logits x 1,024 sequences =
    # 2,118,123,520 B), shared out at 562,176 B a token (8 copies of the latent), 16 tokens a block
    act = max(p.activation_bytes(8192), 16 * 129_280 * 1024)
    budget = 8 * 143_771 * 2**20 * 0.9 - 8 * act - 679_449_460_736
    assert meta["num_blocks"] == int(budget // 562_176) // 16


def test_deepseek_v32_kernel_profile_prices_sparse_attention_from_its_modules(cache: Path) -> None:
    pytest.importorskip("aiconfigurator_core", reason="the kernels extra (aiconfigurator-core) is not installed")
    from sim.cost.kernels import HostTerms, KernelSpec, kernel_profile
    none = HostTerms("none", 0.0, 0.0, 0.0, 0.0, "kernels only")
    p = kernel_profile(KernelSpec(model="deepseek-v3.2", gpu="h200", engine="vllm", tensor_parallel=8,
                                  expert_parallel=True), none, cache)
    assert p.kv_bytes_per_token == 8 * 78_324 and p.model.is_dsa
    assert {"dsa_context_module_perf.parquet", "dsa_generation_module_perf.parquet"} <= set(p.provenance["tables"])
    assert p.attn_decode(64, 512) < p.attn_decode(64, 8192)


def test_mtp_layers_are_read_from_the_configs_and_draft_for_method_mtp(tmp_path: Path, capsys) -> None:
    # num_nextn_predict_layers (DeepSeek, GLM) / mtp_num_hidden_layers (Qwen3.5): loaded only as the
    # proposer, so the weight counts above leave them out
    assert model_shape_from_hf(config("DeepSeek-R1")).num_mtp_layers == 1
    assert model_shape_from_hf(config("GLM-5")).num_mtp_layers == 1
    assert model_shape_from_hf(config("Kimi-K2.5")).num_mtp_layers == 0          # num_nextn_predict_layers 0
    assert model_shape_from_hf(config("Qwen3.5-397B-A17B")).num_mtp_layers == 1
    assert model_shape_from_hf(config("DeepSeek-R1")).num_params == 671_025_397_760
    from sim.cli import main
    two = {**config("DeepSeek-R1"), "num_nextn_predict_layers": 2}
    (tmp_path / "r1.json").write_text(json.dumps(two))
    doc = {"name": "mtp", "seed": 0, "num_requests": 20, "arrivals": {"kind": "poisson", "rate": 5.0},
           "lengths": {"kind": "fixed", "prompt_tokens": 200, "output_tokens": 20},
           "policy": {"kind": "vllm_v1", "speculative": {"method": "mtp", "num_speculative_tokens": 2,
                                                          "acceptance_length": 2.0}},
           "server": {"max_model_len": 4096},
           "profile": {"model": "r1.json", "gpu": "h200", "tensor_parallel": 8, "enable_expert_parallel": True}}
    for model, code_want, words in (("r1.json", 0, None), ("kimi-k2.5", 2, "config names no MTP layers")):
        path = tmp_path / "w.yaml"
        path.write_text(json.dumps({**doc, "profile": {**doc["profile"], "model": model}}))
        code = main(["run", str(path), "--out", str(tmp_path / "out"), "--quiet", "--overwrite"])
        err = capsys.readouterr().err
        assert code == code_want, err
        if words:
            assert words in err and "Traceback" not in err
        else:   # the config's 2 MTP layers are the proposer's
            summary = json.loads((tmp_path / "out" / "summary.json").read_text())
            assert summary["speculative"]["draft_layers"] == 2

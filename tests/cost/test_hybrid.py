"""Hybrid models: Gated DeltaNet linear attention beside full attention (Qwen3.5, Qwen3-Next).
The shape read from the real config (tests/fixtures/hf_configs/Qwen3.5-397B-A17B), its weights,
KV and per-sequence state, vLLM's hybrid KV layout (sim.cost.hybrid), the pool whose requests
hold their state blocks (sim.core.kv.StateBlockPool), the roofline's and the kernel tables'
linear layers, and the runs batchsim refuses. Every number is worked by hand in the comments.
(tests/policies/test_vllm_v1_differential.py checks the pool against vLLM's own Scheduler.)"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from sim.core.kv import state_block_pool
from sim.core.request import Request
from sim.cost.hybrid import vllm_hybrid_layout
from sim.cost.presets import GPU_PRESETS, MODEL_PRESETS, model_shape_from_hf
from sim.cost.profile import load_profile
from sim.cost.roofline import Roofline
from sim.cost.shape import ModelShape

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = ROOT / "tests" / "fixtures" / "hf_configs"


def qwen35() -> ModelShape:
    return model_shape_from_hf(json.loads((CONFIGS / "Qwen3.5-397B-A17B" / "config.json").read_text()),
                               "qwen3.5-397b-a17b")


def test_qwen35_397b_shape_weights_kv_and_state_by_hand() -> None:
    m = qwen35()
    assert m == MODEL_PRESETS["qwen3.5-397b-a17b"]              # the multimodal wrapper read unchanged
    # layer_types: 45 linear_attention and 15 full_attention of 60
    assert (m.num_linear_layers, m.num_attention_layers, m.is_hybrid) == (45, 15, True)
    # tie_word_embeddings false is written on the outer config, not in text_config
    assert not m.tie_word_embeddings
    # a Gated DeltaNet layer: key_dim 16 x 128 = 2048, value_dim 64 x 128 = 8192; in_proj_qkv + z + b + a:
    # 4096 x (2 x 2048 + 2 x 8192 + 2 x 64) = 84,410,368, out_proj 8192 x 4096 = 33,554,432
    assert m.linear_params_per_layer == 84_410_368 + 33_554_432 == 117_964_800
    # full attention with an output gate: q and gate 2 x 4096 x 32 x 256 = 67,108,864, k and v
    # 2 x 4096 x 2 x 256 = 4,194,304, o 8192 x 4096 = 33,554,432
    assert m.attn_params_per_layer == 67_108_864 + 4_194_304 + 33_554_432 == 104_857_600
    # 45 linear + 15 attention layers, 60 MoE layers of router 4096 x 512 = 2,097,152, a shared expert
    # 3 x 4096 x 1024 = 12,582,912 and 512 experts of 12,582,912, embedding and LM head 2 x 248,320 x 4096
    assert m.num_params == (45 * 117_964_800 + 15 * 104_857_600 + 60 * (2_097_152 + 12_582_912)
                            + 60 * 512 * 12_582_912 + 2 * 248_320 * 4096) == 396_343_377_920   # "397B"
    # active: less 60 x 502 unused experts x 12,582,912 = 378,997,309,440
    assert m.num_active_params == 396_343_377_920 - 378_997_309_440 == 17_346_068_480        # "A17B"
    # KV only in the 15 attention layers: 15 x 2 x 2 KV heads x 256 x 2 B = 30,720 B a token
    assert m.kv_bytes_per_token(2) == 15 * 2 * 2 * 256 * 2 == 30_720
    # the state of one sequence in one linear layer: conv window (2 x 2048 + 8192 = 12,288 channels) x
    # (4 - 1) x 2 B = 73,728; recurrent state 64 heads x 128 x 128 x 4 B (mamba_ssm_dtype float32) =
    # 4,194,304; on one of 8 ranks: 1,536 x 3 x 2 = 9,216 and 8 x 128 x 128 x 4 = 524,288
    assert m.linear_state_bytes_per_seq(2) == (73_728, 4_194_304)
    assert m.linear_state_bytes_per_seq(2, 8) == (9_216, 524_288)


def test_qwen35_vllm_hybrid_layout_by_hand() -> None:
    m = qwen35()
    rf = Roofline(m, GPU_PRESETS["h200"], 8, "bf16", expert_parallel=True)
    # 2 KV heads on 8 ranks: one head a rank (replicated), 15 x 2 x 8 x 256 x 2 = 122,880 B all ranks
    assert rf.kv_bytes_per_token == 122_880
    layout = vllm_hybrid_layout(m, rf.kv_bytes_per_token, 8, 2, 16)
    # a rank's attention page of one token and layer: 122,880 / 8 / 15 = 1,024 B; the state page
    # 9,216 + 524,288 = 533,504 B; the block: 16 x ceil(533,504 / (16 x 1,024)) = 16 x 33 = 528 tokens
    assert (layout.attention_page_bytes, layout.state_page_bytes, layout.block_size) == (1_024, 533_504, 528)
    assert layout.page_bytes == 528 * 1_024 == 540_672              # the state padded by 1.3%
    # 15 attention and 45 linear layers: groups of 15, one attention group and 3 linear ones
    assert (layout.group_size, layout.attention_groups, layout.state_groups) == (15, 1, 3)
    # a block size of 32 is the alignment: 32 x ceil(533,504 / 32,768) = 32 x 17 = 544
    assert vllm_hybrid_layout(m, rf.kv_bytes_per_token, 8, 2, 32).block_size == 544
    # one GPU: attention page 2 x 2 x 256 x 2 = 2,048 B, state 73,728 + 4,194,304 = 4,268,032 B:
    # 16 x ceil(4,268,032 / 32,768) = 16 x 131 = 2,096 tokens a block
    one = vllm_hybrid_layout(m, m.kv_bytes_per_token(2), 1, 2, 16)
    assert (one.attention_page_bytes, one.block_size) == (2_048, 2_096)
    # the pool: memory for C tokens of the 15 attention layers' KV holds C x 15 / (15 x 1) / 528 blocks
    assert layout.num_blocks(1_000_000, 15) == 1_000_000 // 528 == 1_893


def small(num_linear: int, num_layers: int) -> ModelShape:
    return ModelShape("h", 1024, num_layers, 8, 8, 2048, 1000, 4096, num_linear_layers=num_linear,
                      linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=64,
                      linear_value_head_dim=64, linear_conv_kernel_dim=4)


def test_hybrid_groups_pad_and_refuse_as_vllm_groups_them() -> None:
    # 12 attention + 13 linear: 13 < 1.5 x 12, so groups of 13, the attention layers padded by one:
    # memory for C tokens of 12 layers' KV holds C x 12 / 13 / block tokens' blocks
    m = small(13, 25)
    kv = m.kv_bytes_per_token(2)                    # 12 x 2 x 8 x 128 x 2 = 49,152
    assert kv == 49_152
    layout = vllm_hybrid_layout(m, kv, 1, 2, 16)
    assert (layout.group_size, layout.attention_groups, layout.state_groups) == (13, 1, 1)
    # attention page 2 x 8 x 128 x 2 = 4,096 B; state: conv (2 x 256 + 512 = 1,024) x 3 x 2 = 6,144,
    # recurrent 8 x 64 x 64 x 2 B (the model's dtype: no mamba_ssm_dtype) = 65,536; 71,680 B:
    # 16 x ceil(71,680 / 65,536) = 32 tokens
    assert (layout.state_page_bytes, layout.block_size) == (71_680, 32)
    assert layout.num_blocks(13_000, 12) == 13_000 * 12 // 13 // 32 == 375
    # 10 attention + 30 linear: groups of 10, 3 linear groups
    assert vllm_hybrid_layout(small(30, 40), small(30, 40).kv_bytes_per_token(2), 1, 2, 16).state_groups == 3
    # 30 attention + 10 linear: groups of 10 make 3 attention groups, which batchsim does not model
    with pytest.raises(ValueError, match="30 attention layers beside 10 linear ones make 3 attention groups"):
        vllm_hybrid_layout(small(10, 40), small(10, 40).kv_bytes_per_token(2), 1, 2, 16)


def test_state_block_pool_by_hand() -> None:
    pool = state_block_pool(3)(10, 4)             # 10 blocks of 4 tokens, 3 state blocks a request
    a, b = Request(req_id=0, arrival_s=0.0, num_prompt_tokens=5, max_output_tokens=1), Request(
        req_id=1, arrival_s=0.0, num_prompt_tokens=9, max_output_tokens=1)
    assert pool.state_blocks == 3
    # a: ceil(5 / 4) = 2 token blocks + 3 state blocks = 5 of 10
    assert pool.can_allocate(a, 5)
    pool.allocate(a, 5)
    assert (len(a.block_ids), pool.num_used_blocks, pool.num_free_blocks) == (2, 5, 5)
    # a grows to 8 tokens: still 2 blocks; to 9: a third, its state already held
    assert pool.can_allocate(a, 9) and not pool.can_allocate(a, 4 * 8 + 1)
    pool.allocate(a, 9)
    assert pool.num_used_blocks == 6
    # b: ceil(9 / 4) = 3 + 3 = 6 > 4 free; 1 token: 1 + 3 = 4 fits exactly
    assert not pool.can_allocate(b, 9) and pool.can_allocate(b, 1)
    pool.allocate(b, 1)
    assert pool.num_free_blocks == 0
    pool.free(a)                                  # its 3 token blocks and its 3 state blocks
    assert pool.num_free_blocks == 6 and a.block_ids == []
    pool.free(b)
    assert pool.num_free_blocks == 10
    # b takes 1 + 3 and c 2 + 3 (5 tokens): 1 left, and a's 3 + 3 do not fit
    c = Request(req_id=2, arrival_s=0.0, num_prompt_tokens=5, max_output_tokens=1)
    pool.allocate(b, 1)
    pool.allocate(c, 5)
    with pytest.raises(RuntimeError, match="needs 6 blocks \\(its state's included\\), 1 free"):
        pool.allocate(a, 9)


def test_linear_layers_on_the_roofline() -> None:
    m = qwen35()
    gpu = GPU_PRESETS["h200"]
    rf = Roofline(m, gpu, 8, "bf16", expert_parallel=True)
    # a decode reads and writes each sequence's state: 45 layers x 533,504 B x 2 = 48,015,360 B a
    # sequence on each GPU, at most the GPU's bandwidth: each more sequence adds at least that
    state_s = 2 * 45 * 533_504 / gpu.mem_bandwidth_bytes_s
    d1, d2, d9 = (float(rf.attn_decode_s(n, 0)) for n in (1, 2, 9))
    assert d2 - d1 >= state_s and d9 - d1 >= 8 * state_s
    # the prefill's state does not grow with the context (only the 15 attention layers do)
    attn_only = Roofline(ModelShape("a", 4096, 15, 32, 2, 1024, 248_320, 262_144, explicit_head_dim=256,
                                    num_experts=512, num_experts_per_tok=10, moe_intermediate_size=1024,
                                    shared_expert_intermediate_size=1024, attn_output_gate=1), gpu, 8, "bf16",
                         expert_parallel=True)
    for chunk in (512, 4096):
        grow = float(rf.attn_prefill_s(chunk, 65_536)) - float(rf.attn_prefill_s(chunk, 0))
        grow_attn = float(attn_only.attn_prefill_s(chunk, 65_536)) - float(attn_only.attn_prefill_s(chunk, 0))
        assert grow == pytest.approx(grow_attn, rel=0.25)
    # weights: the 8 ranks hold the 396,343,377,920 parameters once in bf16, and the 2 KV heads' k and v
    # projections 4 times (one head a rank): 15 layers x 2 x 4096 x 6 more heads x 256 = 188,743,680 more
    assert rf.weight_bytes == (396_343_377_920 + 15 * 2 * 4096 * 6 * 256) * 2 == 793_064_243_200


def test_a_hybrid_run_takes_vllms_block_size_and_refuses_what_is_not_modelled(tmp_path: Path, capsys) -> None:
    from sim.cli import main
    base = {"name": "q35", "seed": 0, "num_requests": 30,
            "arrivals": {"kind": "poisson", "rate": 5.0},
            "lengths": {"kind": "fixed", "prompt_tokens": 1000, "output_tokens": 20},
            "policy": {"kind": "vllm_v1", "enable_prefix_caching": False},
            "server": {"max_model_len": 16384, "num_blocks": 40},
            "profile": {"model": str(CONFIGS / "Qwen3.5-397B-A17B" / "config.json"), "gpu": "h200",
                        "tensor_parallel": 8, "enable_expert_parallel": True}}

    def run(doc: dict) -> tuple[int, str]:
        path = tmp_path / "w.yaml"
        path.write_text(json.dumps(doc))
        code = main(["run", str(path), "--out", str(tmp_path / "out"), "--quiet", "--overwrite"])
        return code, capsys.readouterr().err

    code, _ = run(base)
    assert code == 0
    meta = json.loads((tmp_path / "out" / "meta.json").read_text())
    assert meta["kv_block_size"] == 528 and meta["num_blocks"] == 40
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["completed"] == 30
    # 39 usable blocks (the null block); a request holds 3 state blocks + ceil(1,020 / 528) = 2 token
    # blocks, so at most 7 run at once (7 x 5 = 35 <= 39 < 8 x 5), however many arrived
    steps = (tmp_path / "out" / "steps.csv").read_text().splitlines()
    header = steps[0].split(",")
    running = [int(row.split(",")[header.index("num_running")]) for row in steps[1:]]
    assert max(running) == 7
    # 33 blocks: 32 usable less 3 state blocks leave 29 x 528 = 15,312 tokens of one request < 16,384
    code, err = run({**base, "server": {"max_model_len": 16384, "num_blocks": 33}})
    assert code != 0 and "can schedule at most 15,312 tokens" in err
    for change, words in (
            ({"policy": {"kind": "sglang"}}, "field 'policy.kind': Qwen3.5-397B-A17B has linear-attention layers"),
            ({"policy": {"kind": "vllm_v1", "enable_prefix_caching": False,
                         "speculative": {"method": "mtp", "num_speculative_tokens": 1, "acceptance_length": 1.5}}},
             "field 'policy.speculative'")):
        code, err = run({**base, **change})
        assert code != 0 and words in err and "Traceback" not in err, err
    # prefix caching on (vLLM 0.32's default): the align-mode pool (sim.core.mamba_align), with the
    # synchronous scheduler and with async scheduling (vLLM's default on a GPU)
    for policy in ({"kind": "vllm_v1", "async_scheduling": False}, {"kind": "vllm_v1"}):
        code, err = run({**base, "policy": policy})
        assert code == 0, err
        summary = json.loads((tmp_path / "out" / "summary.json").read_text())
        assert summary["completed"] == 30


def test_qwen35_kernel_profile_prices_gated_deltanet_from_its_tables(tmp_path: Path) -> None:
    pytest.importorskip("aiconfigurator_core", reason="the kernels extra (aiconfigurator-core) is not installed")
    from sim.cost import aic
    version = aic.resolve_version("h200_sxm", "vllm", None)
    t = aic.KernelTables("Qwen/Qwen3.5-397B-A17B", "h200_sxm", "vllm", version, 8, expert_parallel=True)
    assert "gdn_perf.parquet" in t.tables()
    # the decode's linear layers cost by the batch alone: at 64 sequences the wheel's GDN conv update
    # and recurrence (measured ~0.1 + ~0.7 ms over 45 layers) make most of a short-context decode
    short, long = t.decode_attention_ms(64, 1), t.decode_attention_ms(64, 4096)
    assert short > 0.5 and long > short
    # a prefill chunk's linear layers do not read the context: the whole growth is the attention's
    assert t.prefill_attention_ms(1024, 0) < t.prefill_attention_ms(1024, 8192)
    from sim.cost.kernels import HostTerms, KernelSpec, kernel_profile
    p = kernel_profile(KernelSpec(model="qwen3.5-397b-a17b", gpu="h200", engine="vllm", tensor_parallel=8,
                                  expert_parallel=True), HostTerms("none", 0.0, 0.0, 0.0, 0.0, "kernels only"),
                       tmp_path)
    assert p.model == MODEL_PRESETS["qwen3.5-397b-a17b"] and p.kv_bytes_per_token == 122_880
    path = next((tmp_path / "kernels").glob(f"{p.provenance['cache_key']}.json"))
    assert load_profile(path).model == p.model                  # the linear fields survive the format


def test_a_hybrid_or_data_parallel_pool_in_disaggregated_serving_is_refused(tmp_path: Path, capsys) -> None:
    from sim.cli import main
    for profile, words in (({"model": "qwen3.5-397b-a17b", "gpu": "h200", "tensor_parallel": 8,
                             "enable_expert_parallel": True}, "with linear-attention layers"),
                           ({"model": "deepseek-r1", "gpu": "h200", "tensor_parallel": 1, "data_parallel_size": 8,
                             "enable_expert_parallel": True}, "with data-parallel ranks")):
        doc = {"name": "pd", "seed": 0, "num_requests": 10, "arrivals": {"kind": "poisson", "rate": 2.0},
               "lengths": {"kind": "fixed", "prompt_tokens": 500, "output_tokens": 10},
               "policy": {"kind": "vllm_v1", "enable_prefix_caching": False}, "server": {"max_model_len": 8192},
               "profile": profile,
               "disaggregation": {"prefill": {"replicas": 1}, "decode": {"replicas": 1}, "link": {"kind": "rdma-400g"}}}
        path = tmp_path / "pd.yaml"
        path.write_text(json.dumps(doc))
        code = main(["run", str(path), "--out", str(tmp_path / "out"), "--quiet", "--overwrite"])
        err = capsys.readouterr().err
        assert code != 0 and words in err and "is not modelled in disaggregated serving yet" in err, err
        assert "Traceback" not in err

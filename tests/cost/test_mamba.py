"""Hybrid models with Mamba2 state-space layers (Nemotron-H, Nemotron-3): the shape read from the
real configs (tests/fixtures/hf_configs/Nemotron-H-56B-Base-8K, NVIDIA-Nemotron-3-Nano-30B-A3B-BF16),
their weights, KV and per-sequence state, vLLM's hybrid KV layout (sim.cost.hybrid), the roofline's
Mamba2 terms, the kernel tables' refusal, the runs batchsim takes and those it refuses. Every
number is worked by hand in the comments (tests/cost/test_hybrid.py does the same for Gated DeltaNet)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from sim.cost.hf_config import model_shape_from_hf
from sim.cost.hybrid import vllm_hybrid_layout
from sim.cost.presets import GPU_PRESETS, MODEL_PRESETS
from sim.cost.roofline import Roofline
from sim.cost.shape import ModelShape

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = ROOT / "tests" / "fixtures" / "hf_configs"
H56 = CONFIGS / "Nemotron-H-56B-Base-8K" / "config.json"
NANO = CONFIGS / "NVIDIA-Nemotron-3-Nano-30B-A3B-BF16" / "config.json"


def config(path: Path) -> dict:
    return json.loads(path.read_text())


def test_nemotron_h_56b_shape_weights_kv_and_state_by_hand() -> None:
    m = model_shape_from_hf(config(H56), "nemotron-h-56b")
    assert m == MODEL_PRESETS["nemotron-h-56b"]
    # hybrid_override_pattern, one block a layer: 54 M, 10 *, 54 - of 118
    assert (m.num_mamba_layers, m.num_attention_layers, m.num_ffn_layers, m.num_layers) == (54, 10, 54, 118)
    assert (m.num_mixer_layers, m.num_mlp_layers, m.num_moe_layers, m.mlp) == (64, 54, 0, "gelu")   # relu2: up, down
    # a Mamba2 layer: I = 256 heads x 64 = 16,384; in_proj 8192 x (2 x 16,384 + 2 x 8 groups x 256 + 256 heads)
    # = 8192 x 37,120 = 304,087,040, out_proj 16,384 x 8192 = 134,217,728
    assert m.mamba_params_per_layer == 304_087_040 + 134_217_728 == 438_304_768
    # attention: q and o 2 x 8192 x 64 x 128 = 134,217,728, k and v 2 x 8192 x 8 x 128 = 16,777,216
    assert m.attn_params_per_layer == 134_217_728 + 16_777_216 == 150_994_944
    # 54 Mamba2 + 10 attention + 54 MLPs of 2 x 8192 x 32,768 = 536,870,912, untied embedding and head
    # 2 x 131,072 x 8192 = 2,147,483,648
    assert m.num_params == (54 * 438_304_768 + 10 * 150_994_944 + 54 * 536_870_912
                            + 2_147_483_648) == 56_316_919_808                     # "56B"
    # KV only in the 10 attention layers: 10 x 2 x 8 KV heads x 128 x 2 B = 40,960 B a token
    assert m.kv_bytes_per_token(2) == 10 * 2 * 8 * 128 * 2 == 40_960
    # a sequence's state in one Mamba2 layer: conv (16,384 + 2 x 8 x 256 = 20,480 channels) x (4 - 1) x 2 B
    # = 122,880; SSM 256 heads x 64 x 256 x 4 B (fp32: vLLM's default for Nemotron-H, the config names no
    # mamba_ssm_cache_dtype) = 16,777,216; on one of 8 ranks 2,560 x 3 x 2 = 15,360 and 32 x 64 x 256 x 4
    assert m.mamba_state_bytes == 4
    assert m.state_bytes_per_seq(2) == (122_880, 16_777_216)
    assert m.state_bytes_per_seq(2, 8) == (15_360, 2_097_152)


def test_nemotron_3_nano_shape_weights_kv_and_state_by_hand() -> None:
    m = model_shape_from_hf(config(NANO), "nemotron-3-nano-30b-a3b")
    assert m == MODEL_PRESETS["nemotron-3-nano-30b-a3b"]
    # MEMEM*EMEMEM*...: 23 M, 23 E, 6 * of 52; every MLP block is MoE
    assert (m.num_mamba_layers, m.num_moe_layers, m.num_attention_layers, m.num_dense_mlp_layers) == (23, 23, 6, 0)
    # head_dim 128 given (hidden 2688 / 32 heads would be 84)
    assert m.head_dim == 128
    # Mamba2: I = 64 x 64 = 4,096; in_proj 2688 x (8,192 + 2 x 8 x 128 + 64) = 2688 x 10,304 = 27,697,152,
    # out_proj 4,096 x 2688 = 11,010,048
    assert m.mamba_params_per_layer == 27_697_152 + 11_010_048 == 38_707_200
    # attention: 2 x 2688 x 32 x 128 = 22,020,096 + 2 x 2688 x 2 x 128 = 1,376,256
    assert m.attn_params_per_layer == 23_396_352
    # an MoE layer: router 2688 x 128 = 344,064, the shared expert (moe_shared_expert_intermediate_size 3712 x
    # n_shared_experts 1) 2 x 2688 x 3712 = 19,955,712, 128 experts of 2 x 2688 x 1856 = 9,977,856
    assert m.shared_expert_intermediate_size == 3712 and m.params_per_expert == 9_977_856
    # embedding and head 2 x 131,072 x 2688 = 704,643,072
    assert m.num_params == (23 * 38_707_200 + 6 * 23_396_352 + 23 * (344_064 + 19_955_712)
                            + 23 * 128 * 9_977_856 + 704_643_072) == 31_576_989_696   # "30B"
    # active: less 23 layers x 122 unused experts x 9,977,856 = 27,997,863,936
    assert m.num_active_params == 31_576_989_696 - 27_997_863_936 == 3_579_125_760        # "A3B"
    # KV: 6 x 2 x 2 x 128 x 2 B = 6,144 a token; state: conv (4,096 + 2 x 8 x 128 = 6,144) x 3 x 2 B = 36,864,
    # SSM (mamba_ssm_cache_dtype float32) 64 x 64 x 128 x 4 B = 2,097,152
    assert m.kv_bytes_per_token(2) == 6_144
    assert m.state_bytes_per_seq(2) == (36_864, 2_097_152)


def test_nemotron_vllm_hybrid_layout_by_hand() -> None:
    m = MODEL_PRESETS["nemotron-h-56b"]
    rf = Roofline(m, GPU_PRESETS["h200"], 8, "bf16")
    # 8 KV heads on 8 ranks: one a rank, 10 x 2 x 128 x 2 = 5,120 B a rank, 40,960 all ranks
    assert rf.kv_bytes_per_token == 40_960
    layout = vllm_hybrid_layout(m, rf.kv_bytes_per_token, 8, 2, 16)
    # a rank's attention page of one token and layer: 40,960 / 8 / 10 = 512 B; the state page 15,360 +
    # 2,097,152 = 2,112,512 B; the block 16 x ceil(2,112,512 / (16 x 512)) = 16 x ceil(257.9) = 4,128 tokens
    assert (layout.attention_page_bytes, layout.state_page_bytes, layout.block_size) == (512, 2_112_512, 4_128)
    assert layout.page_bytes == 4_128 * 512 == 2_113_536             # the state padded by 1,024 B
    # 10 attention and 54 Mamba2 layers (54 >= 1.5 x 10): groups of 10, one attention group, ceil(54 / 10) = 6
    # state groups; the 54 MLP layers hold no cache
    assert (layout.group_size, layout.attention_groups, layout.state_groups) == (10, 1, 6)
    # one GPU: attention page 2 x 8 x 128 x 2 = 4,096 B, state 122,880 + 16,777,216 = 16,900,096 B:
    # 16 x ceil(16,900,096 / 65,536) = 16 x 258 = 4,128 again
    one = vllm_hybrid_layout(m, m.kv_bytes_per_token(2), 1, 2, 16)
    assert (one.attention_page_bytes, one.state_page_bytes, one.block_size) == (4_096, 16_900_096, 4_128)
    # Nemotron-3 Nano on one GPU: attention page 2 x 2 x 128 x 2 = 1,024 B, state 36,864 + 2,097,152 =
    # 2,134,016 B: 16 x ceil(2,134,016 / 16,384) = 16 x 131 = 2,096 tokens; 6 attention beside 23 Mamba2
    # layers: groups of 6, ceil(23 / 6) = 4 state groups
    nano = MODEL_PRESETS["nemotron-3-nano-30b-a3b"]
    small = vllm_hybrid_layout(nano, nano.kv_bytes_per_token(2), 1, 2, 16)
    assert (small.block_size, small.group_size, small.state_groups) == (2_096, 6, 4)


def test_mamba2_layers_on_the_roofline(tmp_path: Path) -> None:
    m = MODEL_PRESETS["nemotron-h-56b"]
    gpu = GPU_PRESETS["h200"]
    rf = Roofline(m, gpu, 8, "bf16")
    # weights: 56,316,919,808 parameters in bf16 over the 8 ranks (8 KV heads: none replicated)
    assert rf.weight_bytes == 56_316_919_808 * 2 == 112_633_839_616
    # per GPU: 32 heads, 1 group, head_dim 64, state 256, chunk 128, 2,560 conv channels of 4 taps.
    # Prefill a token and layer: 32 x (4 x 256 x 64 + 2 x 128 x 64) = 2,621,440, the group's C B^T
    # 2 x 128 x 256 = 65,536, the conv 2 x 2,560 x 4 = 20,480: 2,707,456, x 54 layers = 146,202,624
    assert rf._linear_prefill_flops == 54 * (2_621_440 + 65_536 + 20_480) == 146_202_624
    # decode a sequence and layer: 32 x 2 x 3 x 256 x 64 = 3,145,728 + the conv's 20,480, x 54 = 170,975,232
    assert rf._linear_decode_flops == 54 * (3_145_728 + 20_480) == 170_975_232
    # the state read and written at every decode: 54 x 2,112,512 B x 2 = 228,151,296 B a sequence, at most
    # the GPU's bandwidth, so each more sequence adds at least that
    assert rf._linear_state_bytes == 54 * 2_112_512
    state_s = 2 * 54 * 2_112_512 / gpu.mem_bandwidth_bytes_s
    d1, d2, d9 = (float(rf.attn_decode_s(n, 0)) for n in (1, 2, 9))
    assert d2 - d1 >= state_s and d9 - d1 >= 8 * state_s
    # a prefill chunk's Mamba2 layers do not read the context: growing it 64K tokens costs what the 10
    # attention layers alone cost (a same-shape model with no Mamba2 layers)
    attn_only = Roofline(ModelShape("a", 8192, 10, 64, 8, 32768, 131072, 8192, mlp="gelu"), gpu, 8, "bf16")
    for chunk in (512, 4096):
        grow = float(rf.attn_prefill_s(chunk, 65_536)) - float(rf.attn_prefill_s(chunk, 0))
        grow_attn = float(attn_only.attn_prefill_s(chunk, 65_536)) - float(attn_only.attn_prefill_s(chunk, 0))
        assert grow == pytest.approx(grow_attn, rel=0.25)
    # TP collectives and floors: one all-reduce after each of the 118 blocks (+ the embedding's), not 2 a layer;
    # the kernel floor of 118 half layers = 59 layers
    assert rf.tp_costs.allreduce_calls == 118 + 1
    assert rf.tp_costs.layers_fixed_s == pytest.approx(59 * rf.tp_costs.layer_fixed_s)
    # the Mamba2 and single-block fields survive a profile file
    from sim.cost.profile import load_profile
    from sim.cost.roofline import preset_profile
    prof = preset_profile("nemotron-3-nano-30b-a3b", "h200", 2)
    prof.save(tmp_path / "p.json")
    assert load_profile(tmp_path / "p.json").model == MODEL_PRESETS["nemotron-3-nano-30b-a3b"]
    # a tensor parallelism that does not divide the 8 B/C groups is refused by name
    with pytest.raises(ValueError, match="tensor_parallel=16 does not divide nemotron-h-56b's mamba_n_groups"):
        Roofline(m, gpu, 16, "bf16")


def test_nemotron_configs_refused_with_the_field_named() -> None:
    base = config(H56)
    for change, words in (
            ({"hybrid_override_pattern": base["hybrid_override_pattern"][:-1] + "X"},
             "field 'hybrid_override_pattern' has a layer 'X'; expected M (Mamba2), * (attention), - (MLP) or E"),
            ({"hybrid_override_pattern": "M*"}, "must be a string of one letter a layer (118"),
            ({"ssm_state_size": None}, "config field 'ssm_state_size' is missing (its Mamba2 layers need it)"),
            ({"mamba_ssm_cache_dtype": "fp8"}, "field 'mamba_ssm_cache_dtype' must be one of float32"),
            ({"layers_block_type": ["mamba"] * 118}, "'hybrid_override_pattern' and 'layers_block_type' both given"),
            ({"hybrid_override_pattern": "M-" * 59}, "no layer of its pattern attends"),
            ({"moe_latent_size": 1024}, "latent MoE projections (Nemotron-3 Super, Ultra)")):
        with pytest.raises(ValueError) as err:
            model_shape_from_hf({**base, **change}, "h")
        assert words in str(err.value), str(err.value)
    # a layers_block_type of Nemotron-3.5's words reads as the pattern does; an E block needs experts
    words = [{"M": "mamba", "*": "attention", "-": "mlp"}[c] for c in base["hybrid_override_pattern"]]
    spelt = {k: v for k, v in base.items() if k != "hybrid_override_pattern"}
    assert model_shape_from_hf({**spelt, "layers_block_type": words}, "nemotron-h-56b") == MODEL_PRESETS["nemotron-h-56b"]
    with pytest.raises(ValueError, match="include MoE \\(E\\) blocks, but the config names no experts"):
        model_shape_from_hf({**base, "hybrid_override_pattern": "E" + base["hybrid_override_pattern"][1:]}, "h")
    # another model's layers_block_type (not nemotron_h) is still refused by name
    with pytest.raises(ValueError, match="hybrid state-space / linear-attention layers"):
        model_shape_from_hf({**spelt, "model_type": "other", "layers_block_type": words}, "h")


def test_a_nemotron_run_takes_vllms_block_size_and_refuses_what_is_not_modelled(tmp_path: Path, capsys) -> None:
    from sim.cli import main
    base = {"name": "nh", "seed": 0, "num_requests": 30,
            "arrivals": {"kind": "poisson", "rate": 50.0},
            "lengths": {"kind": "fixed", "prompt_tokens": 1000, "output_tokens": 20},
            "policy": {"kind": "vllm_v1", "enable_prefix_caching": False},
            "server": {"max_model_len": 8192, "num_blocks": 40},
            "profile": {"model": str(H56), "gpu": "h200", "tensor_parallel": 8}}

    def run(doc: dict) -> tuple[int, str]:
        path = tmp_path / "w.yaml"
        path.write_text(json.dumps(doc))
        code = main(["run", str(path), "--out", str(tmp_path / "out"), "--quiet", "--overwrite"])
        return code, capsys.readouterr().err

    code, err = run(base)
    assert code == 0, err
    meta = json.loads((tmp_path / "out" / "meta.json").read_text())
    assert meta["kv_block_size"] == 4_128 and meta["num_blocks"] == 40
    assert json.loads((tmp_path / "out" / "summary.json").read_text())["completed"] == 30
    # 39 usable blocks (the null block); a request holds 6 state blocks + ceil(1,020 / 4,128) = 1 token block,
    # so at most 5 run at once (5 x 7 = 35 <= 39 < 6 x 7 = 42), however many arrived
    steps = (tmp_path / "out" / "steps.csv").read_text().splitlines()
    header = steps[0].split(",")
    assert max(int(row.split(",")[header.index("num_running")]) for row in steps[1:]) == 5
    # 8 blocks: 7 usable less 6 state blocks leave 1 x 4,128 tokens of one request < 8,192
    code, err = run({**base, "server": {"max_model_len": 8192, "num_blocks": 8}})
    assert code != 0 and "can schedule at most 4,128 tokens" in err, err
    for change, words in (
            ({"policy": {"kind": "sglang"}}, "has Mamba2 state-space layers, whose state memory"),
            ({"policy": {"kind": "vllm_v1"}}, "field 'policy.enable_prefix_caching'"),
            ({"policy": {"kind": "vllm_v1"}}, "set policy.enable_prefix_caching: false"),
            ({"profile": {"model": str(H56), "gpu": "h200", "tensor_parallel": 8, "kernels": "aiconfigurator"}},
             "Mamba2 ops, which the aiconfigurator-core 0.12.0 tables do not measure for vLLM")):
        if "kernels" in change.get("profile", {}):
            pytest.importorskip("aiconfigurator_core", reason="the kernels extra (aiconfigurator-core) is not installed")
        code, err = run({**base, **change})
        assert code != 0 and words in err and "Traceback" not in err, err


def test_nemotron_3_nano_preset_runs_on_the_roofline(tmp_path: Path, capsys) -> None:
    from sim.cli import main
    code = main(["run", str(ROOT / "workloads" / "mixed_lengths.yaml"), "--out", str(tmp_path / "out"), "--quiet",
                 "--set", "num_requests=40", "--set", "policy.kind=vllm_v1", "--set",
                 "policy.enable_prefix_caching=false", "--set", "profile.model=nemotron-3-nano-30b-a3b",
                 "--set", "profile.gpu=h200"])
    assert code == 0, capsys.readouterr().err
    meta = json.loads((tmp_path / "out" / "meta.json").read_text())
    assert meta["kv_block_size"] == 2_096                    # the layout test's one-GPU block
    assert json.loads((tmp_path / "out" / "summary.json").read_text())["completed"] == 40

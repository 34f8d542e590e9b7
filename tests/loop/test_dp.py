"""Data parallelism (vLLM's --data-parallel-size): the ranks' lockstep step (sim.loop.dp,
Profile.dp_step_time_s), vLLM's data-parallel load balancer (router vllm_dp), a rank's memory
and expert routing on the roofline, and whole runs with what is refused. Times on the exactly
linear profile of tests/conftest.py: linear(n) = n x 0.1 ms, overhead 1 ms, decode attention
1e-7 s a token of context, prefill attention 1e-8 s x chunk x context."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import simpy

from policies import make_policy
from policies.vllm_v1 import VllmV1Config
from sim.core.batch import Batch, BatchItem
from sim.core.request import Request
from sim.cost.curves import Curve1D
from sim.cost.presets import GPU_PRESETS, MODEL_PRESETS
from sim.cost.roofline import Roofline
from sim.loop.dp import DpGroup
from sim.loop.feed import feed, sglang_dp_pick, vllm_dp_pick
from sim.loop.server import Server, SimExecutor
from tests.conftest import linear_profile, policy_state, step_rows


def test_the_group_step_is_the_slowest_rank_padded_to_the_most_tokens() -> None:
    p = linear_profile()
    decode = Batch((BatchItem(0, 1, 250), BatchItem(1, 1, 250), BatchItem(2, 1, 250), BatchItem(3, 1, 250)))
    prefill = Batch((BatchItem(4, 100, 0),))
    # alone: 1 ms + 4 x 0.1 ms + 1e-7 x 1000 = 1.5 ms; 1 ms + 100 x 0.1 ms (+ 0 attention at context 0) = 11 ms
    assert p.step_time_s(decode) == pytest.approx(1.5e-3)
    assert p.step_time_s(prefill) == pytest.approx(11e-3)
    # within the CUDA graphs (100 <= 512 tokens) every rank is padded to linear(100) = 10 ms: the decode
    # rank 1 + 10 + 0.1 = 11.1 ms, the prefill rank 11 ms, an idle rank's dummy 1 + 10 = 11 ms: 11.1 ms
    assert p.dp_step_time_s([decode, prefill, None], graph_tokens=512) == pytest.approx(11.1e-3)
    # above them (graph_tokens 64 < 100) each rank runs its own: 1.5, 11 and 1 + 0.1 ms: 11 ms
    assert p.dp_step_time_s([decode, prefill, None], graph_tokens=64) == pytest.approx(11e-3)
    # decodes alone: the most tokens is 4 (0.4 ms); a dummy rank 1 + 0.4 = 1.4 ms < 1.5 ms
    assert p.dp_step_time_s([decode, None], graph_tokens=512) == pytest.approx(1.5e-3)
    # the experts on a curve of their own, 0.2 ms a token a rank: a rank alone pays its own tokens'
    # (the prefill: 11 + 20 = 31 ms); padded, the group pays moe(100) = 20 ms once on top of 11.1 ms;
    # unpadded, the experts meet 4 + 100 + 1 (the dummy) = 105 tokens, ceil(105 / 3) = 35 a rank: 7 ms
    with_moe = dataclasses.replace(p, moe=Curve1D([0, 1 << 20], [0.0, 2e-4 * (1 << 20)]))
    assert with_moe.step_time_s(prefill) == pytest.approx(31e-3)
    assert with_moe.dp_step_time_s([decode, prefill, None], graph_tokens=512) == pytest.approx(31.1e-3)
    assert with_moe.dp_step_time_s([decode, prefill, None], graph_tokens=64) == pytest.approx(18e-3)
    # the busiest rank's experts get 1.5x the mean: moe(1.5 x 35 = 52.5 tokens) = 10.5 ms, 11 + 10.5
    assert with_moe.dp_step_time_s([decode, prefill, None], graph_tokens=64,
                                   expert_imbalance=1.5) == pytest.approx(21.5e-3)


def ranks(env: simpy.Environment, n: int, num_blocks: int = 1000) -> list[Server]:
    p = linear_profile()
    out = []
    for k in range(n):
        policy = make_policy(VllmV1Config(enable_prefix_caching=False, async_scheduling=False), 1 << 16)
        out.append(Server(env, policy, policy_state(policy, num_blocks, 16, 1 << 16), SimExecutor(p),
                          replica=k, start=False))
    return out


def test_vllm_dp_load_balancer_scores_as_vllm() -> None:
    env = simpy.Environment()
    servers = ranks(env, 3, num_blocks=10)
    # empty ranks tie: the scan starts at the request's counter, so ties go round robin
    assert [vllm_dp_pick(servers, c).replica for c in range(4)] == [0, 1, 2, 0]
    r = [Request(i, 0.0, 16, 4) for i in range(6)]
    s0, s1, s2 = (s.state for s in servers)
    s0.add_arrival(r[0], 4, 0.0)                 # rank 0: 1 waiting -> score 1
    s1.add_arrival(r[1], 4, 0.0)
    s1.add_arrival(r[2], 4, 0.0)                 # rank 1: 2 waiting -> 2
    assert vllm_dp_pick(servers, 0).replica == 2      # rank 2: 0
    # rank 2 runs 2 requests on 8 of its 10 blocks: 2 + 0 waiting; rank 0's one waiting request with
    # its pool 80% full would add 6 x 1 x (0.8 - 0.5) = 1.8: score 2.8 > 2, so rank 2 still wins
    for q in (r[3], r[4]):
        s2.add_arrival(q, 4, 0.0)
        s2.kv.allocate(q, 64)
        s2.waiting.remove(q)
        s2.running.append(q)
    s0.kv.allocate(r[5], 8 * 16)
    assert s2.kv.num_used_blocks == 8 and s0.kv.num_used_blocks == 8
    # scores: rank 0 1 + 1.8 = 2.8, rank 1 2, rank 2 2: from counter 1, rank 1 is the first of the least
    assert vllm_dp_pick(servers, 1).replica == 1
    assert vllm_dp_pick(servers, 2).replica == 2


def test_two_ranks_step_together_by_hand() -> None:
    env = simpy.Environment()
    servers = ranks(env, 2)
    DpGroup(env, servers, linear_profile())
    # r0 (100 + 3 tokens) goes to rank 0 (tie, counter 0); r1 (10 + 3): rank 0 has 1 waiting, so rank 1
    reqs = [Request(0, 0.0, 100, 3), Request(1, 0.0, 10, 3)]
    env.process(feed(env, servers, reqs, [3, 3], "vllm_dp"))
    env.run()
    # step 1: both prefill, every rank at linear(100): max(1 + 10, 1 + 10) = 11 ms
    # step 2: both decode 1 token: 1 + 0.1 + the larger attention, rank 0's 1e-7 x 100 = 0.01 ms: 1.11 ms
    # step 3: 1 + 0.1 + 1e-7 x 101 = 1.1101 ms; both end there with 3 tokens (the prefill sampled one)
    for s in servers:
        assert [row[0] for row in step_rows(s)] == pytest.approx([0.0, 11.0, 12.11])
    assert env.now == pytest.approx(11e-3 + 1.11e-3 + 1.1101e-3)
    assert [len(s.state.records) for s in servers] == [1, 1]


def test_an_idle_rank_joins_with_a_dummy_batch() -> None:
    env = simpy.Environment()
    servers = ranks(env, 2)
    group = DpGroup(env, servers, linear_profile())
    env.process(feed(env, servers, [Request(0, 0.0, 50, 2)], [2], "vllm_dp"))
    env.run()
    # 2 steps, rank 1 idle in both: it logs nothing, and both steps are rank 0's own time
    # (1 + 5 = 6 ms, then 1 + 0.1 + 0.005 = 1.105 ms: a dummy rank's 1 + 0.1 is not slower)
    assert (group.num_steps, group.num_dummy_steps) == (2, 2)
    assert step_rows(servers[1]) == []
    assert env.now == pytest.approx(6e-3 + 1.105e-3)


def test_a_data_parallel_rank_on_the_roofline() -> None:
    m = MODEL_PRESETS["deepseek-r1"]
    gpu = GPU_PRESETS["h200"]
    tp8 = Roofline(m, gpu, 8, "bf16", expert_parallel=True)
    dp8 = Roofline(m, gpu, 1, "bf16", expert_parallel=True, data_parallel=8)
    # one rank (one GPU) holds everything but the experts, and 1/8 of the experts: 58 MoE layers x 256
    # experts x 3 x 7168 x 2048 = 653,908,770,816 expert parameters, 7/8 of them on the other ranks;
    # TP 8's total also holds q_a and kv_a 7 more times (61 x 15,138,816 x 7 x FP8 bytes a parameter)
    experts = 58 * 256 * 3 * 7168 * 2048
    assert experts == 653_908_770_816
    fp8 = dp8.precision.weight_bytes_per_param
    replicated = 61 * 15_138_816 * 7 * fp8
    assert dp8.weight_bytes == pytest.approx(tp8.weight_bytes - replicated - experts * fp8 * 7 / 8, rel=1e-9)
    # routing: each of 8 ranks' n tokens picks 8 of 256 experts; a GPU holds 32 of them, and one token a
    # rank touches 32 x (1 - (1 - 8/256) ** 8) = 7.175 of them a layer (TP 8 with 1 token: 1)
    assert float(dp8._split.expected_local_experts(1)) == pytest.approx(32 * (1 - (31 / 32) ** 8), rel=1e-12)
    assert float(tp8._split.expected_local_experts(1)) == pytest.approx(32 * (1 - (31 / 32) ** 1), rel=1e-12)
    # the MoE layers' collectives: vLLM's allgather_reducescatter, 2 a layer over the 8 ranks, each
    # moving 7/8 of 8 ranks x n tokens x 7168 x 2 B through a GPU's link
    c = dp8.tp_costs
    assert (c.dp_calls, c.allreduce_calls, c.alltoall_calls) == (2 * 58, 0, 0)
    # the routed experts on their own curve: at 1 token a rank it reads its 7.175 touched experts of each
    # of 58 layers (3 x 7168 x 2048 FP8 weights each) at most at the GPU's bandwidth; the rest (linear_s)
    # no longer holds them
    assert dp8.splits_moe and not tp8.splits_moe
    expert_bytes = 58 * 32 * (1 - (31 / 32) ** 8) * 3 * 7168 * 2048 * fp8
    assert float(dp8.moe_s(1)) >= expert_bytes / gpu.mem_bandwidth_bytes_s
    assert float(dp8.linear_s(1)) < float(Roofline(m, gpu, 1, "bf16", expert_parallel=True).linear_s(1))
    with pytest.raises(ValueError, match="tensor_parallel=1 x data_parallel_size=3 does not divide deepseek-r1's "
                                         "num_experts \\(256\\)"):
        Roofline(m, gpu, 1, "bf16", expert_parallel=True, data_parallel=3)


def test_a_deepseek_r1_dp8_run_and_what_is_refused(tmp_path: Path, capsys) -> None:
    from sim.cli import main
    base = {"name": "dp", "seed": 0, "num_requests": 64,
            "arrivals": {"kind": "poisson", "rate": 20.0},
            "lengths": {"kind": "fixed", "prompt_tokens": 500, "output_tokens": 30},
            "policy": {"kind": "vllm_v1"}, "server": {"max_model_len": 8192},
            "profile": {"model": "deepseek-r1", "gpu": "h200", "tensor_parallel": 1, "data_parallel_size": 8,
                        "enable_expert_parallel": True}}

    def run(doc: dict, *extra: str) -> tuple[int, str]:
        path = tmp_path / "w.yaml"
        path.write_text(json.dumps(doc))
        code = main(["run", str(path), "--out", str(tmp_path / "out"), "--quiet", "--overwrite", *extra])
        return code, capsys.readouterr().err

    code, err = run(base)
    assert code == 0, err
    meta = json.loads((tmp_path / "out" / "meta.json").read_text())
    assert (meta["num_replicas"], meta["router"]) == (8, "vllm_dp")
    assert meta["policy_knobs"]["async_scheduling"] is False            # the synchronous loop (sim.loop.dp)
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["completed"] == 64 and len(summary["replicas"]) == 8
    # 64 requests over 8 ranks by vLLM's balancer: every rank gets some
    assert all(r["completed"] > 0 for r in summary["replicas"])
    # every rank steps with the group: ranks' steps that start together last as long, and each step
    # ends where the group's next one starts (or the group idles)
    import pandas as pd
    steps = pd.read_csv(tmp_path / "out" / "steps.csv")
    by_start = steps.groupby(steps.t_s.round(12))
    assert by_start.duration_s.nunique().max() == 1
    assert by_start.replica.nunique().max() >= 4                      # several ranks in one step
    group = by_start.duration_s.first()
    ends = (group.index.to_numpy() + group.to_numpy())[:-1]
    assert (group.index.to_numpy()[1:] >= ends - 1e-12).all()
    # two deployments of 8 ranks: 16 replicas, each deployment its own lockstep group
    code, err = run(base, "--replicas", "2")
    assert code == 0, err
    meta = json.loads((tmp_path / "out" / "meta.json").read_text())
    assert meta["num_replicas"] == 16
    steps = pd.read_csv(tmp_path / "out" / "steps.csv")
    for ranks_of in (range(0, 8), range(8, 16)):
        one = steps[steps.replica.isin(list(ranks_of))]
        assert one.groupby(one.t_s.round(12)).duration_s.nunique().max() == 1
    for change, extra, words in (
            ({"policy": {"kind": "vllm_v1", "async_scheduling": True}}, (), "field 'policy.async_scheduling' is true"),
            ({"policy": {"kind": "tensorrt_llm"}}, (), "field 'profile.data_parallel_size': data parallelism is modelled"),
            ({"policy": {"kind": "sglang", "enable_overlap": True}}, (), "field 'policy.enable_overlap' is true"),
            ({"policy": {"kind": "sglang"}}, ("--router", "vllm_dp"), "(router sglang_dp; several deployments"),
            ({}, ("--router", "prefix_aware"), "--router prefix_aware is not how they are routed"),
            ({"policy": {"kind": "vllm_v1", "speculative": {"method": "mtp", "num_speculative_tokens": 1,
                                                           "acceptance_length": 1.6}}}, (),
             "field 'policy.speculative'"),
            ({"profile": {**base["profile"], "data_parallel_size": 0}}, (), "profile.data_parallel_size"),
            ({"profile": {**base["profile"], "expert_imbalance": 0.5}}, (), "field 'profile.expert_imbalance' must"),
            ({"profile": {**base["profile"], "enable_expert_parallel": False, "expert_imbalance": 1.3}}, (),
             "field 'profile.expert_imbalance' applies to data-parallel ranks with expert parallelism")):
        code, err = run({**base, **change}, *extra)
        assert code != 0 and words in err and "Traceback" not in err, err


def test_two_deployments_route_to_the_least_loaded_then_by_vllms_balancer() -> None:
    env = simpy.Environment()
    servers = ranks(env, 4)
    for s in servers:
        s.dp_size = 2                       # two deployments of two ranks: (0, 1) and (2, 3)
    r = [Request(i, 0.0, 16, 4) for i in range(3)]
    # all empty: counter 0 -> deployment 0, and in it rank 0 (its own counter 0 // 2 = 0)
    assert vllm_dp_pick(servers, 0).replica == 0
    servers[0].state.add_arrival(r[0], 4, 0.0)
    # deployment 0 has 1 request in flight, deployment 1 none: deployment 1; counter 3 // 2 = 1 starts
    # its scan at rank 3
    assert vllm_dp_pick(servers, 3).replica == 3
    servers[3].state.add_arrival(r[1], 4, 0.0)
    servers[2].state.add_arrival(r[2], 4, 0.0)
    # 1 against 2: deployment 0, where rank 1 (0 in flight) beats rank 0 (1 waiting)
    assert vllm_dp_pick(servers, 4).replica == 1


def test_deepseek_r1_dp8_kernel_profile(tmp_path: Path) -> None:
    pytest.importorskip("aiconfigurator_core", reason="the kernels extra (aiconfigurator-core) is not installed")
    from sim.cost.kernels import HostTerms, KernelSpec, kernel_profile
    from sim.cost.profile import load_profile
    none = HostTerms("none", 0.0, 0.0, 0.0, 0.0, "kernels only")
    p = kernel_profile(KernelSpec(model="deepseek-r1", gpu="h200", engine="vllm", tensor_parallel=1,
                                  expert_parallel=True, data_parallel=8), none, tmp_path)
    assert p.data_parallel_size == 8 and "-dp8-" in p.name and p.moe is not None
    assert load_profile(next((tmp_path / "kernels").glob("*.json"))).moe is not None
    # one GPU holds the whole latent of a token: 61 x 576 x 2 B = 70,272 B (not 8 copies)
    assert p.kv_bytes_per_token == 70_272
    assert p.linear(1) < p.linear(64) < p.linear(2048)
    path = next((tmp_path / "kernels").glob(f"{p.provenance['cache_key']}.json"))
    assert load_profile(path).data_parallel_size == 8
    # DeepEP's low-latency all-to-all (vLLM's --all2all-backend deepep_low_latency): the wheel's large-EP
    # graph, its dispatch and combine read from the measured moe_a2a tables; only the experts' curve moves
    ll = kernel_profile(KernelSpec(model="deepseek-r1", gpu="h200", engine="vllm", tensor_parallel=1,
                                   expert_parallel=True, data_parallel=8, moe_a2a="deepep_low_latency"), none, tmp_path)
    assert "-deepep_low_latency-" in ll.name and ll.provenance["moe_a2a_backend"] == "deepep_low_latency"
    assert ll.provenance["cache_key"] != p.provenance["cache_key"]
    assert "moe_a2a_perf.parquet" in ll.provenance["tables"]
    assert ll.moe(64) != pytest.approx(p.moe(64), rel=1e-3)
    assert ll.kv_bytes_per_token == p.kv_bytes_per_token and ll.weight_bytes == p.weight_bytes


def test_deepep_refusals(tmp_path: Path, capsys) -> None:
    from sim.cli import main
    base = {"name": "dp", "seed": 0, "num_requests": 8, "arrivals": {"kind": "poisson", "rate": 20.0},
            "lengths": {"kind": "fixed", "prompt_tokens": 50, "output_tokens": 5}, "policy": {"kind": "vllm_v1"},
            "profile": {"model": "deepseek-r1", "gpu": "h200", "tensor_parallel": 1, "data_parallel_size": 8,
                        "enable_expert_parallel": True, "moe_a2a_backend": "deepep_low_latency"}}
    for change, words in (
            ({}, "DeepEP's kernels are priced from the measured tables only (set profile.kernels"),
            ({"moe_a2a_backend": "deepep"}, "field 'profile.moe_a2a_backend' must be one of allgather_reducescatter"),
            ({"data_parallel_size": 1, "tensor_parallel": 8, "kernels": "aiconfigurator"},
             "DeepEP dispatches to expert-parallel ranks of data-parallel attention")):
        path = tmp_path / "w.yaml"
        path.write_text(json.dumps({**base, "profile": {**base["profile"], **change}}))
        code = main(["run", str(path), "--out", str(tmp_path / "out"), "--quiet", "--overwrite"])
        err = capsys.readouterr().err
        assert code != 0 and words in err and "Traceback" not in err, err


def sglang_ranks(env: simpy.Environment, n: int, num_blocks: int = 1000) -> list[Server]:
    from policies.sglang import SglangConfig
    p = linear_profile()
    out = []
    for k in range(n):
        policy = make_policy(SglangConfig(enable_overlap=False, disable_radix_cache=True, chunked_prefill_size=512),
                             1 << 16)
        out.append(Server(env, policy, policy_state(policy, num_blocks, 1, 1 << 16), SimExecutor(p),
                          replica=k, start=False))
    return out


def test_sglang_dp_attention_pads_decode_steps_only() -> None:
    """SGLang's DP attention (policies.sglang rule 9, sim.loop.dp rule 3): a step where any rank
    extends is not padded (SUM_LEN); a decode-only step is, up to the decode graphs' batch. The
    experts on a curve of their own, 0.2 ms a token a rank."""
    env = simpy.Environment()
    servers = sglang_ranks(env, 2)
    p = dataclasses.replace(linear_profile(), moe=Curve1D([0, 1 << 20], [0.0, 2e-4 * (1 << 20)]))
    DpGroup(env, servers, p, graph_tokens=512, pads_prefill=False)
    # round robin: r0 (prompt 10) to rank 0, r1 (prompt 100) to rank 1, r2 (prompt 10) to rank 0
    reqs = [Request(0, 0.0, 10, 3), Request(1, 0.0, 100, 3), Request(2, 0.0, 10, 3)]
    env.process(feed(env, servers, reqs, [3, 3, 3], "sglang_dp"))
    env.run()
    # step 1, both extend: not padded. The experts meet 20 + 100 tokens, ceil(120 / 2) = 60 a rank:
    # 12 ms; rank 0's own 1 + 20 x 0.1 = 3 ms, rank 1's 1 + 10 = 11 ms: 11 + 12 = 23 ms (vLLM's
    # padding would make it 1 + linear(100) + moe(100) = 31 ms)
    # step 2, decode only: padded to 2 tokens. Experts moe(2) = 0.4 ms; rank 0 1 + 0.2 + 1e-7 x 20 =
    # 1.202 ms, rank 1 1 + 0.1 + 1e-7 x 100 + (linear(2) - linear(1) = 0.1) = 1.21 ms: 1.61 ms
    # (unpadded, rank 1 would be 1.11 and the step 1.202 + 0.4 = 1.602 ms)
    # step 3: rank 0 1.2 + 1e-7 x 22 = 1.2022, rank 1 1.2 + 1e-7 x 101 = 1.21010: 1.6101 ms
    for s in servers:
        assert [r[0] for r in step_rows(s)] == pytest.approx([0.0, 23.0, 24.61])
    assert env.now == pytest.approx(23e-3 + 1.61e-3 + 1.6101e-3)


def test_sglang_dp_round_robin() -> None:
    env = simpy.Environment()
    servers = sglang_ranks(env, 4)
    # one deployment of 4 ranks: DataParallelController.round_robin_scheduler, whatever the load
    for s in servers:
        s.dp_size = 4
    servers[0].state.add_arrival(Request(0, 0.0, 16, 4), 4, 0.0)
    assert [sglang_dp_pick(servers, c).replica for c in range(6)] == [0, 1, 2, 3, 0, 1]
    # two deployments of 2: round robin over them, then each controller's own turn (counter // 2)
    for s in servers:
        s.dp_size = 2
    # counter 0 -> deployment 0, its request 0: rank 0; 1 -> deployment 1, its 0th: rank 2;
    # 2 -> deployment 0, its 1st: rank 1; 3 -> rank 3; 4 -> rank 0
    assert [sglang_dp_pick(servers, c).replica for c in range(5)] == [0, 2, 1, 3, 0]


def test_sglang_dp_attention_defaults() -> None:
    """_handle_data_parallelism and the memory rules with DP attention (policies.sglang rule 9)."""
    from policies.sglang import SglangConfig, SglangPolicy
    from policies.sglang_defaults import decode_graph_bs, engine_defaults
    from sim.core.policy import PolicyContext
    gib = 1 << 30
    h200 = PolicyContext(16384, "NVIDIA H200", 141 * gib, world_size=1, data_parallel=8, mla=True)
    # SGLang's TP size is 1 x 8 = 8 (>= 4): H200 (< 160 GiB) tier, chunk 8192, decode graphs 512.
    # Reserve (MiB): 512 + 1.5 x 8192 + 8 / 8 x 1024 + 2 x 512 + DP attention 3 x 8 x 512 + (512 > 300)
    # 1.5 x 8 x 512 + MLA 1.5 x 1024 = 512 + 12,288 + 1024 + 1024 + 12,288 + 6144 + 1536 = 34,816;
    # (144,384 - 34,816) / 144,384 = 0.75887
    assert engine_defaults(h200, None, 16384, None, 8) == (8192, 0.759)
    assert decode_graph_bs(h200, None, 8) == 512
    assert decode_graph_bs(h200, 256, 8) == 256           # at most the server's max_running_requests
    policy = SglangPolicy(SglangConfig(), h200)
    # a rank prefills 8192 // 8 = 1024 tokens a step; new_token_ratio starts at 0.7 x (1.0 x 0.3) = 0.21
    assert policy.chunk_size == 1024 and policy.token_budget == 1024
    assert policy.init_ratio == pytest.approx(0.21) and policy.dp_graph_tokens == 512
    assert policy.knobs()["chunked_prefill_size"] == 8192                # the server's argument
    given = SglangPolicy(SglangConfig(chunked_prefill_size=4096, max_running_requests=100), h200)
    # 4096 // 8 = 512 a rank; 100 // 8 = 12 requests a rank
    assert (given.chunk_size, given.max_num_seqs) == (512, 12)
    assert given.knobs()["max_running_requests"] == 100 and given.dp_graph_tokens == 100
    # without DP attention nothing changes: the H200 tier at TP 1 (decode graphs 256), no MLA reserve
    plain = SglangPolicy(SglangConfig(), PolicyContext(16384, "NVIDIA H200", 141 * gib))
    assert (plain.chunk_size, plain.init_ratio, plain.dp_graph_tokens) == (8192, pytest.approx(0.7), 0)


def test_a_deepseek_r1_sglang_dp8_run(tmp_path: Path, capsys) -> None:
    from sim.cli import main
    doc = {"name": "dp", "seed": 0, "num_requests": 48,
           "arrivals": {"kind": "poisson", "rate": 20.0},
           "lengths": {"kind": "fixed", "prompt_tokens": 500, "output_tokens": 30},
           "policy": {"kind": "sglang"}, "server": {"max_model_len": 8192},
           "profile": {"model": "deepseek-r1", "gpu": "h200", "tensor_parallel": 1, "data_parallel_size": 8,
                       "enable_expert_parallel": True}}
    path = tmp_path / "w.yaml"
    path.write_text(json.dumps(doc))
    code = main(["run", str(path), "--out", str(tmp_path / "out"), "--quiet"])
    assert code == 0, capsys.readouterr().err
    meta = json.loads((tmp_path / "out" / "meta.json").read_text())
    assert (meta["num_replicas"], meta["router"]) == (8, "sglang_dp")
    assert meta["policy_knobs"]["enable_overlap"] is False              # the synchronous loop (sim.loop.dp)
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    # 48 requests round robin over 8 ranks: 6 each
    assert [r["completed"] for r in summary["replicas"]] == [6] * 8
    import pandas as pd
    steps = pd.read_csv(tmp_path / "out" / "steps.csv")
    assert steps.groupby(steps.t_s.round(12)).duration_s.nunique().max() == 1

"""Analytic checks: the simulator against arithmetic and queueing theory."""

from __future__ import annotations

import math

import numpy as np
import pytest
from cases import CASES, KINDS
from conftest import linear_profile, simulate

from policies import POLICIES
from sim.core.batch import Batch, BatchItem
from sim.run.config import workload_from_dict
from sim.run.runner import run_workload
from sim.cost.roofline import preset_profile

@pytest.mark.parametrize("kind", KINDS)
def test_single_request_takes_prefill_plus_decodes(kind):
    """E2E = prefill(P) + sum of (N - 1) decode steps, on every policy; on a pipelined one
    (vllm_v1's async scheduling on a GPU) less the host work that hides behind the forward pass."""
    profile = preset_profile("llama-3.1-8b", "h100-sxm")
    P, N = 1000, 50
    cfg_cls = POLICIES[kind][0]
    server, (req,) = simulate([(2.0, P, N)], cfg_cls(**CASES[kind].alone), profile=profile)
    steps = [Batch((BatchItem(0, P, 0),))] + [Batch((BatchItem(0, 1, P + k),)) for k in range(N - 1)]
    expected_s = sum(profile.step_time_s(b) for b in steps)
    first_s = profile.step_time_s(steps[0])
    if server.policy.pipelined:
        # Each step after the first is chosen and prepared while the one before it runs
        # (sim.loop.server.pipelined_start_s). The preset's host work (vllm-v0: 1.5 ms + 54 us a
        # sequence) is shorter than every step's device part (the forward pass of an 8B model:
        # several ms), so it all hides except the first step's: E2E = the sum less the host work
        # of steps 2..N; the first token is in when step 2 starts, at the end of step 1.
        host = [profile.host_s(b) for b in steps]
        assert host[0] == pytest.approx(1.5e-3 + 54e-6)
        assert all(profile.step_time_s(b) - h > host[k + 1] for k, (b, h) in enumerate(zip(steps[:-1], host)))
        expected_s -= sum(host[1:])
    assert req.finished_s - req.arrival_s == pytest.approx(expected_s, rel=1e-9)
    assert req.first_token_s - req.arrival_s == pytest.approx(first_s, rel=1e-9)
    assert len(server.log) == N


def test_md1_queue_ttft_for_a_prefill_only_server():
    """Poisson arrivals, deterministic service D (fixed prompt, 1 output token,
    one request at a time): M/D/1 mean wait Wq = rho * D / (2 * (1 - rho)),
    so mean TTFT = Wq + D."""
    profile = linear_profile(per_token_s=1e-4, overhead_s=2e-3)
    P = 180
    D = profile.step_time_s(Batch((BatchItem(0, P, 0),)))      # 2 ms + 180 * 0.1 ms = 20 ms
    assert D == pytest.approx(0.002 + 180 * 1e-4, rel=1e-9)       # no context: no attention term
    rho = 0.7
    rate = rho / D
    rng = np.random.default_rng(1)
    n = 30_000
    arrivals = np.cumsum(rng.exponential(1 / rate, n))
    specs = [(float(t), P, 1) for t in arrivals]
    server, reqs = simulate(specs, POLICIES["vllm"][0](max_num_seqs=1), profile=profile)
    ttft = np.array([r.first_token_s - r.arrival_s for r in reqs])
    expected = rho * D / (2 * (1 - rho)) + D
    assert ttft.mean() == pytest.approx(expected, rel=0.05)


def test_vllm_paper_memory_arithmetic_opt13b():
    """OPT-13B: 2 (K, V) x 40 layers x 5120 hidden x 2 bytes = 800 KiB per token.
    With `reserve: max` of 2048 tokens, at most floor(capacity / 2048) requests
    run at once (the vLLM paper's Orca (Max))."""
    profile = preset_profile("opt-13b", "a100-40gb")
    assert profile.kv_bytes_per_token == 2 * 40 * 5120 * 2 == 800 * 1024
    cfg = workload_from_dict({
        "name": "opt", "num_requests": 200,
        "arrivals": {"kind": "all_at_once"},
        "lengths": {"kind": "fixed", "prompt_tokens": 200, "output_tokens": 100},
        "policy": {"kind": "orca", "reserve": "max"},
        "server": {"max_model_len": 2048},
        "profile": {"model": "opt-13b", "gpu": "a100-40gb"},
    })
    result = run_workload(cfg)
    capacity_tokens = result.meta["num_blocks"] * 16
    assert capacity_tokens <= profile.kv_capacity_tokens(0.9)
    limit = math.floor(capacity_tokens / 2048)
    assert result.steps["num_running"].max() == limit
    # while oracle reservations (200 + 100 = 300 tokens each) admit many more
    oracle = run_workload(workload_from_dict({**cfg.raw, "policy": {"kind": "orca", "reserve": "oracle"}}))
    assert oracle.steps["num_running"].max() > 5 * limit


def test_activation_reserve_follows_the_token_budget_opt13b():
    """The vLLM paper (Fig. 1): OPT-13B on one A100-40GB holds 26 GB of weights
    and about 12 GB of KV cache, ~15.7K token slots at 800 KiB per token.

    Roofline arithmetic: 0.9 x 40 GiB = 38,654,705,664 B; weights 12.84e9
    params x 2 B = 25,680,609,280 B; activations 0.548 GiB fixed (logits of 256
    rows, CUDA context) + (2 x 20480 + 4 x 5120) x 2 B = 122,880 B per batched
    token. vLLM v0's budget for max_model_len 2048 is 2048 tokens: 251.7 MB,
    leaving 14,812 slots of 819,200 B (12.1 GB). A fixed 8192-token reserve
    would leave 13,890 (-6%).
    """
    profile = preset_profile("opt-13b", "a100-40gb")
    assert profile.activation_bytes_per_token_per_gpu == (2 * 20480 + 4 * 5120) * 2
    assert profile.kv_capacity_tokens(0.9, 2048) == 14812
    assert profile.kv_capacity_tokens(0.9, 8192) == 13890
    assert abs(14812 / 15.7e3 - 1) < 0.06
    cfg = workload_from_dict({
        "name": "opt", "num_requests": 4, "arrivals": {"kind": "all_at_once"},
        "lengths": {"kind": "fixed", "prompt_tokens": 200, "output_tokens": 10},
        "policy": {"kind": "vllm"}, "server": {"max_model_len": 2048},
        "profile": {"model": "opt-13b", "gpu": "a100-40gb"},
    })
    assert run_workload(cfg).meta["num_blocks"] == 14812 // 16
    sarathi = workload_from_dict({**cfg.raw, "policy": {"kind": "sarathi", "max_num_batched_tokens": 512}})
    assert run_workload(sarathi).meta["num_blocks"] == profile.kv_capacity_tokens(0.9, 512) // 16


def test_engine_memory_rules_size_the_pool_from_the_same_facts():
    """The three KvMemory shares on OPT-13B / A100-40GB at a 2048-token budget:
    memory 42,949,672,960 B, weights 25,680,609,280 B, activations 840,007,680 B
    (0.548 GiB fixed + 2048 x 122,880 B), 819,200 B of KV per token.

    total (vLLM):  0.9 x 42,949,672,960 - 840,007,680 - 25,680,609,280 = 12,134,088,704 B -> 14,812 tokens
    static (SGLang's mem_fraction_static): 0.9 x 42,949,672,960 - 25,680,609,280
                   = 12,974,096,384 B -> 15,837 tokens (activations live outside the share)
    free (TensorRT-LLM, LMDeploy): 0.9 x (42,949,672,960 - 840,007,680 - 25,680,609,280)
                   = 0.9 x 16,429,056,000 = 14,786,150,400 B -> 18,049 tokens
    """
    profile = preset_profile("opt-13b", "a100-40gb")
    assert profile.kv_capacity_tokens(0.9, 2048, "total") == 14812
    assert profile.kv_capacity_tokens(0.9, 2048, "static") == 15837
    assert profile.kv_capacity_tokens(0.9, 2048, "free") == 18049
    assert "activations outside" in profile.memory_report(0.9, 2048, "static")
    with pytest.raises(ValueError, match="share_of"):
        profile.kv_capacity_tokens(0.9, 2048, "half")

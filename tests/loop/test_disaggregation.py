"""Disaggregated prefill and decode (sim.loop.handoff, sim.run.disagg), by hand.

Every server runs vllm_v1 synchronously, prefix caching off, on linear_profile with free
attention: a step of t tokens costs 1 + 0.1 t ms. The KV is 1,000 bytes a token and the link
8 Gb/s per GPU each way (1e9 bytes/s) with 50 us of latency, TP 1 on both sides, so moving
n tokens alone takes 0.05 + n / 1e6 s... = 0.05 ms + n x 1 us.
"""

from __future__ import annotations

import numpy as np
import pytest
import simpy

from conftest import WORKLOADS, linear_profile, policy_state
from policies import make_policy
from policies.vllm import VllmConfig
from policies.vllm_v1 import VllmV1Config
from sim.base.strict import ConfigError
from sim.core.request import Request
from sim.loop.handoff import Handoff, LinkSpec, feed_prefills
from sim.loop.server import Server, SimExecutor
from sim.run.config import load_workload, workload_from_dict

PROFILE = linear_profile(per_token_s=1e-4, overhead_s=1e-3, decode_per_ctx_s=0.0, prefill_per_ctx_s=0.0)
LINK = LinkSpec(bandwidth_gbps=8.0, latency_us=50.0)


def _servers(env, n: int, first: int, num_blocks: int, v0: bool = False):
    out = []
    for k in range(n):
        cfg = (VllmConfig(max_num_seqs=8, max_num_batched_tokens=1024) if v0 else
               VllmV1Config(max_num_seqs=8, max_num_batched_tokens=128, enable_prefix_caching=False,
                            async_scheduling=False))
        policy = make_policy(cfg, 1024)
        state = policy_state(policy, num_blocks, 4, 1024)
        out.append(Server(env, policy, state, SimExecutor(PROFILE), replica=first + k))
    return out


def _run(specs, *, prefill: int = 1, decode: int = 1, p_blocks: int = 1000, d_blocks: int = 1000,
         timeout_s: float = 480.0, prefill_v0: bool = False):
    """(arrival_s, prompt, output) per request; (handoff, prefill servers, decode servers, requests).
    ``prefill_v0``: the prefill instances run vLLM v0's scheduler (policy vllm) instead."""
    env = simpy.Environment()
    p = _servers(env, prefill, 0, p_blocks, v0=prefill_v0)
    d = _servers(env, decode, prefill, d_blocks)
    h = Handoff(env, p, d, ("round_robin", "round_robin"), LINK, 1000, (1, 1), len(specs),
                abort_timeout_s=timeout_s)
    reqs = [Request(i, a, pr, o) for i, (a, pr, o) in enumerate(specs)]
    env.process(feed_prefills(env, h, reqs, [o for *_, o in specs]))
    env.run()
    return h, p, d, reqs


def test_ttft_is_prefill_transfer_and_the_decodes_first_step() -> None:
    # One request, prompt 100, output 3.
    # Prefill instance: its prompt in one step, 1 + 0.1 x 100 = 11 ms; it samples the dropped token and
    #   finishes at 11 ms, keeping its 100 / 4 = 25 blocks.
    # The decode instance gets it at 11 ms, allocates 25 blocks, and the read starts: 100 x 1,000 bytes
    #   at 1e9 B/s = 0.1 ms after 0.05 ms of latency: in at 11.15 ms; the prefill side frees its blocks.
    # Decode: the last prompt token computed again, a 1-token step of 1.1 ms: first token at 12.25 ms,
    #   then 13.35 and 14.45 ms.
    h, (p,), (d,), (r,) = _run([(0.0, 100, 3)])
    ids, times = d.state.tokens.arrays()
    assert ids.tolist() == [0, 0, 0]
    assert np.allclose(times * 1e3, [12.25, 13.35, 14.45])
    assert r.first_token_s * 1e3 == pytest.approx(12.25)
    assert h.prefill_done_s[0] * 1e3 == pytest.approx(11.0)
    assert h.transfer_start_s[0] * 1e3 == pytest.approx(11.0)
    assert h.transfer_end_s[0] * 1e3 == pytest.approx(11.15)
    assert h.transfer_tokens[0] == 100
    # The decode side computed 1 token (the last prompt token), then 2 decodes: 3 steps of 1 token.
    rows = [ints.reshape(-1, 8) for _, _, _, ints in d.log.chunks()][0]
    assert rows[:, 1].sum() + rows[:, 2].sum() == 3
    # The prefill side held 25 blocks from 11 ms until the read ended, then none.
    held = h.held_timeline()
    assert held.tolist() == [[pytest.approx(0.011), 0.0, 25.0], [pytest.approx(0.01115), 0.0, 0.0]]
    assert p.state.kv.num_used_blocks == 0 and not p.state.held


def test_transfers_into_one_decode_instance_share_its_port() -> None:
    # Two requests at t = 0, prompt 100, output 2, one on each of two prefill instances: both finish
    # at 11 ms. The decode instance takes both at 11 ms; the two reads share its one port: each at
    # 0.5e9 B/s, 100,000 bytes in 0.2 ms after the 0.05 ms latency: both in at 11.25 ms.
    # Decode step: both last prompt tokens, 1 + 0.2 = 1.2 ms: first tokens at 12.45 ms, then 13.65.
    h, _, (d,), reqs = _run([(0.0, 100, 2), (0.0, 100, 2)], prefill=2)
    assert np.allclose(h.transfer_end_s * 1e3, [11.25, 11.25])
    assert [r.first_token_s * 1e3 for r in reqs] == [pytest.approx(12.45)] * 2
    assert [r.finished_s * 1e3 for r in reqs] == [pytest.approx(13.65)] * 2
    # The link's record: 2 transfers in flight from 11.05 ms to 11.25 ms.
    flight = h.link_timeline()
    assert flight[:, 1].max() == 2
    assert h.link.bytes_moved[("d", 2)] == 200_000


def test_a_full_decode_pool_holds_the_kv_on_the_prefill_side() -> None:
    # Decode pool: 40 blocks of 4 tokens (39 usable: vLLM's null block). Requests A and B at t = 0,
    # prompt 100 (25 blocks), A with 20 outputs, B with 2, on two prefill instances: both prefilled at
    # 11 ms. The decode side takes A (25 blocks); B's 25 do not fit the 14 left: it waits, and its
    # prefill instance keeps its 25 blocks.
    # A: in at 11.15 ms, then 20 one-token steps of 1.1 ms: its last token at 11.15 + 22 = 33.15 ms,
    #   when it finishes and frees its 26 blocks.
    # B: admitted at 33.15 ms, read 0.15 ms (in at 33.30), first token 1.1 ms later at 34.40 ms.
    h, p, (d,), (a, b) = _run([(0.0, 100, 20), (0.0, 100, 2)], prefill=2, d_blocks=40)
    assert a.finished_s * 1e3 == pytest.approx(33.15)
    assert h.transfer_start_s[1] * 1e3 == pytest.approx(33.15)
    assert b.first_token_s * 1e3 == pytest.approx(34.40)
    held = h.held_timeline()
    b_rows = held[held[:, 1] == 1]
    assert b_rows.tolist() == [[pytest.approx(0.011), 1.0, 25.0], [pytest.approx(0.0333), 1.0, 0.0]]


def test_a_v0_prefill_instance_full_of_held_kv_waits_for_the_release() -> None:
    # Prefill instance on vLLM v0's scheduler (whole prompts), 30 blocks of 4 tokens. Requests A and B
    # at t = 0, prompt 100 (25 blocks each), outputs 20 and 2: A is admitted (25 of 30 blocks); B's 25
    # do not fit the 5 left. A prefilled at 1 + 0.1 x 100 = 11 ms; its 25 blocks stay held for the
    # decode side, so B waits with nothing running (it used to spin on Idle(now) until the policy
    # check stopped the run). The read of A ends at 11 + 0.05 + 0.1 = 11.15 ms, its blocks are freed,
    # the prefill instance wakes and admits B: prefilled at 11.15 + 11 = 22.15 ms, read by 22.30 ms.
    h, (p,), (d,), (a, b) = _run([(0.0, 100, 20), (0.0, 100, 2)], p_blocks=30, prefill_v0=True)
    assert h.prefill_done_s * 1e3 == pytest.approx([11.0, 22.15])
    assert h.transfer_end_s * 1e3 == pytest.approx([11.15, 22.30])
    assert a.finished_s is not None and b.finished_s is not None
    assert p.state.kv.num_used_blocks == 0 and not p.state.held


def test_kv_nobody_read_in_time_is_freed_and_computed_again() -> None:
    # As above with a 5 ms abort timeout: B's prefill instance frees its blocks at 11 + 5 = 16 ms; B,
    # still queued on the decode side without blocks, is then computed there: admitted when A
    # finishes at 33.15 ms, its 100-token prompt in one step of 11 ms: first token at 44.15 ms.
    h, p, (d,), (a, b) = _run([(0.0, 100, 20), (0.0, 100, 2)], prefill=2, d_blocks=40, timeout_s=0.005)
    assert h.num_timeouts == 1
    assert np.isnan(h.transfer_start_s[1])
    assert b.first_token_s * 1e3 == pytest.approx(44.15)
    held = h.held_timeline()
    assert held[held[:, 1] == 1][-1].tolist() == [pytest.approx(0.016), 1.0, 0.0]


def _workload(**disagg) -> dict:
    return {"name": "pd", "num_requests": 10, "arrivals": {"kind": "poisson", "rate": 2.0},
            "lengths": {"kind": "fixed", "prompt_tokens": 256, "output_tokens": 16}, "policy": {"kind": "vllm_v1"},
            "disaggregation": {"prefill": {}, "decode": {}, **disagg}}


@pytest.mark.parametrize("change, field", [
    ({"prefill": None}, "disaggregation.prefill"),
    ({"decode": {"replica": 2}}, "disaggregation.decode.replica"),
    ({"decode": {"replicas": 0}}, "disaggregation.decode.replicas"),
    ({"prefill": {"router": "nearest"}}, "disaggregation.prefill.router"),
    ({"decode": {"policy": {"kind": "sglang"}}}, "disaggregation.decode.policy.kind"),
    ({"link": {"kind": "rdma-400"}}, "disaggregation.link.kind"),
    ({"link": {"bandwidth_gbps": -1}}, "disaggregation.link.bandwidth_gbps"),
    ({"link": {}}, "disaggregation.link"),
    ({"proxy_ms": "fast"}, "disaggregation.proxy_ms"),
    ({"decode": {"profile": {"model": "llama-3.1-70b"}}}, "disaggregation"),
    ({"decode": {"policy": {"max_num_seqs": 0}}}, "(disaggregation.decode)"),
])
def test_bad_disaggregation_names_its_field(change, field) -> None:
    data = _workload(**change)
    if change.get("prefill", 1) is None:
        del data["disaggregation"]["prefill"]
    with pytest.raises(ConfigError, match=f"{field}".replace(".", r"\.").replace("(", r"\(").replace(")", r"\)")):
        workload_from_dict(data, "w.yaml")


def test_a_pool_takes_the_workloads_sections_with_its_own_over_them() -> None:
    data = _workload(decode={"replicas": 3, "profile": {"tensor_parallel": 2},
                             "policy": {"max_num_seqs": 64}})
    data["policy"]["max_num_batched_tokens"] = 4096
    cfg = workload_from_dict(data, "w.yaml")
    d = cfg.disaggregation
    assert (d.prefill.replicas, d.decode.replicas) == (1, 3)
    assert (d.prefill.cfg.profile.tensor_parallel, d.decode.cfg.profile.tensor_parallel) == (1, 2)
    assert d.decode.cfg.policy.max_num_seqs == 64 and d.decode.cfg.policy.max_num_batched_tokens == 4096
    assert d.prefill.cfg.policy.max_num_seqs is None
    assert (d.link.bandwidth_gbps, d.link.latency_us) == (400.0, 5.0)      # rdma-400g, the default link


def test_the_bundled_example_runs_and_its_phases_add_up_to_ttft(tmp_path) -> None:
    from sim.run.disagg import run_disaggregated
    cfg = load_workload(WORKLOADS / "pd_llama70b.yaml", {"num_requests": 60})
    result = run_disaggregated(cfg)
    req = result.requests
    done = req[req["status"] == "finished"]
    assert len(done) == 60
    parts = done[["prefill_queue_s", "prefill_s", "transfer_wait_s", "transfer_s", "decode_queue_s",
                  "decode_first_step_s"]].sum(axis=1)
    # Nothing else lies between a request's arrival and its first token (no proxy hop in the example).
    assert np.allclose(parts, done["ttft_s"], rtol=0, atol=1e-9)
    pd_ = result.summary["disaggregation"]
    assert pd_["num_transfers"] == 60 and pd_["num_transfer_timeouts"] == 0


def test_the_figures_time_line_keeps_each_bins_peak() -> None:
    from reports.presentation.pd_figure import binned_max
    # a step function: 0 from t = 0, 5 from 1.5 s, 2 from 1.7 s, 0 from 3.2 s; bins of 1 s over [0, 4):
    # [0, 1) only 0; [1, 2) enters at 0 and reaches 5; [2, 3) holds 2; [3, 4) enters at 2, then 0
    got = binned_max(np.array([0.0, 1.5, 1.7, 3.2]), np.array([0.0, 5.0, 2.0, 0.0]), np.array([0.0, 1, 2, 3, 4]))
    assert got.tolist() == [0.0, 5.0, 2.0, 2.0]

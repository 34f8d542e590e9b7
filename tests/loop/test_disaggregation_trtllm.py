"""TensorRT-LLM's disaggregated serving (sim.run.pd_trtllm, policies.tensorrt_llm_disagg), by hand.

Every server runs tensorrt_llm, block reuse off, on linear_profile with free attention: a step of
t tokens costs 1 + 0.1 t ms. KV blocks of 4 tokens, max_num_tokens 1024 (no chunking). The KV is
1,000 bytes a token and the link 8 Gb/s per GPU each way (1e9 bytes/s) with 50 us of latency, TP 1
on both sides, so moving n tokens alone takes 0.05 ms + n x 1 us. Both servers reserve prompt +
max_tokens blocks (GUARANTEED_NO_EVICT): the context server's copy keeps the client's max_tokens.
"""

from __future__ import annotations

import numpy as np
import pytest
import simpy

from conftest import WORKLOADS, linear_profile, policy_state
from policies import make_policy
from policies.tensorrt_llm import TensorRtLlmConfig
from sim.base.strict import ConfigError
from sim.core.request import Request
from sim.loop.handoff import LinkSpec, feed_prefills
from sim.loop.handoff_trtllm import TrtllmHandoff
from sim.loop.server import Server, SimExecutor
from sim.run.config import load_workload, workload_from_dict

PROFILE = linear_profile(per_token_s=1e-4, overhead_s=1e-3, decode_per_ctx_s=0.0, prefill_per_ctx_s=0.0)
LINK = LinkSpec(bandwidth_gbps=8.0, latency_us=50.0)


def _servers(env, n: int, first: int, num_blocks: int, overlap: bool):
    out = []
    for k in range(n):
        cfg = TensorRtLlmConfig(max_num_tokens=1024, max_batch_size=8, enable_block_reuse=False,
                                tokens_per_block=4, disable_overlap_scheduler=not overlap)
        policy = make_policy(cfg, 1024)
        state = policy_state(policy, num_blocks, 4, 1024)
        out.append(Server(env, policy, state, SimExecutor(PROFILE), replica=first + k))
    return out


def _run(specs, *, prefill: int = 1, p_blocks: int = 1000, d_blocks: int = 1000, overlap: bool = False,
         link: LinkSpec = LINK):
    """(arrival_s, prompt, output) per request, through ``prefill`` context instances and one
    generation instance; (handoff, context servers, generation server, requests)."""
    env = simpy.Environment()
    p = _servers(env, prefill, 0, p_blocks, overlap)
    (d,) = _servers(env, 1, prefill, d_blocks, overlap)
    d.policy.decode_stretch = False                  # as sim.run.disagg builds a decode pool
    h = TrtllmHandoff(env, p, [d], ("round_robin", "round_robin"), link, 1000, (1, 1), len(specs),
                      abort_timeout_s=None)
    reqs = [Request(i, a, pr, o) for i, (a, pr, o) in enumerate(specs)]
    env.process(feed_prefills(env, h, reqs, [o for *_, o in specs]))
    env.run()
    return h, p, d, reqs


@pytest.mark.parametrize("overlap", [False, True])
def test_the_first_token_is_the_context_sides_and_leaves_before_any_decode_step(overlap) -> None:
    # One request, prompt 100, output 3.
    # Context server: the prompt in one step, 1 + 0.1 x 100 = 11 ms; it samples the first token and
    #   answers at 11 ms, keeping its 100 / 4 = 25 blocks for the transfer.
    # Generation server, at 11 ms: prompt + max_tokens = 103 tokens = 26 blocks to completion fit;
    #   the prompt's 25 blocks are allocated and the KV is received: 0.05 ms + 100 x 1 us, in at
    #   11.15 ms, when the context side frees its blocks.
    # At 11.15 ms the generation server's pass sees the transfer ended: the request runs with its
    #   prompt computed and the context side's token appended, sent to the client now: TTFT 11.15 ms
    #   (vLLM's decode side computes the last prompt token again first: 12.25 ms).
    # Then two 1-token steps of 1.1 ms: tokens at 12.25 and 13.35 ms. The overlap scheduler gives the
    #   same times here (no host time: each step starts when the one before ends).
    h, (p,), d, (r,) = _run([(0.0, 100, 3)], overlap=overlap)
    ids, times = d.state.tokens.arrays()
    assert ids.tolist() == [0, 0, 0]
    assert times * 1e3 == pytest.approx([11.15, 12.25, 13.35])
    assert r.first_token_s * 1e3 == pytest.approx(11.15)
    assert r.first_scheduled_s * 1e3 == pytest.approx(11.15)
    assert h.transfer_start_s[0] * 1e3 == pytest.approx(11.0)
    assert h.transfer_end_s[0] * 1e3 == pytest.approx(11.15)
    assert h.transfer_tokens[0] == 100
    # The generation side ran 2 steps of one token each: no recompute of the prompt's last token.
    rows = [ints.reshape(-1, 8) for _, _, _, ints in d.log.chunks()][0]
    assert len(rows) == 2 and rows[:, 1].sum() + rows[:, 2].sum() == 2
    held = h.held_timeline()
    assert held.tolist() == [[pytest.approx(0.011), 0.0, 25.0], [pytest.approx(0.01115), 0.0, 0.0]]
    assert p.state.kv.num_used_blocks == 0 and d.state.kv.num_used_blocks == 0


def test_a_one_token_reply_ends_at_the_generation_sides_first_pass() -> None:
    # Prompt 100, output 1: as above, its only token is sent at 11.15 ms and the request finishes
    # then, with no step on the generation side.
    h, _, d, (r,) = _run([(0.0, 100, 1)])
    assert r.first_token_s * 1e3 == pytest.approx(11.15)
    assert r.finished_s * 1e3 == pytest.approx(11.15)
    assert list(d.log.chunks()) == [] and d.state.kv.num_used_blocks == 0


def test_two_transfers_into_one_generation_instance_share_its_port() -> None:
    # Two requests at t = 0, prompt 100, output 2, one on each of two context instances: both answer
    # at 11 ms. The generation instance admits both; the two reads share its one port from 11.05 ms:
    # each at 0.5e9 B/s, 100,000 bytes in 0.2 ms: both in at 11.25 ms, when both first tokens are sent.
    # Then one step of both second tokens, 1 + 0.2 = 1.2 ms: 12.45 ms, when both finish.
    h, _, d, reqs = _run([(0.0, 100, 2), (0.0, 100, 2)], prefill=2)
    assert h.transfer_end_s * 1e3 == pytest.approx([11.25, 11.25])
    assert [r.first_token_s * 1e3 for r in reqs] == [pytest.approx(11.25)] * 2
    assert [r.finished_s * 1e3 for r in reqs] == [pytest.approx(12.45)] * 2
    assert h.link_timeline()[:, 1].max() == 2
    assert h.link.bytes_moved[("d", 2)] == 200_000


def test_a_full_generation_pool_holds_the_kv_on_the_context_side() -> None:
    # Generation pool: 40 blocks of 4 tokens. A and B at t = 0, prompt 100 (25 blocks), A with 20
    # outputs (120 tokens: 30 blocks to completion), B with 2 (102 tokens: 26), on two context
    # instances: both answer at 11 ms. A is admitted (30 of 40) and takes its 25 prompt blocks: 15
    # free. B's 26 do not fit: it waits, and its context instance keeps its 25 blocks. (While A's KV
    # is on its way its 5 blocks still to come are not kept back: 15 left, still < 26; after, 15 - 5.)
    # A: in at 11.15 ms, its first token then, 19 more in steps of 1.1 ms: the last at
    #   11.15 + 20.9 = 32.05 ms, when it finishes and frees its ceil(119 / 4) = 30 blocks.
    # B: admitted at 32.05 ms, read 0.15 ms: its first token at 32.20 ms, its second at 33.30 ms.
    h, p, d, (a, b) = _run([(0.0, 100, 20), (0.0, 100, 2)], prefill=2, d_blocks=40)
    assert a.finished_s * 1e3 == pytest.approx(32.05)
    assert h.transfer_start_s[1] * 1e3 == pytest.approx(32.05)
    assert b.first_token_s * 1e3 == pytest.approx(32.20)
    assert b.finished_s * 1e3 == pytest.approx(33.30)
    held = h.held_timeline()
    assert held[held[:, 1] == 1].tolist() == [[pytest.approx(0.011), 1.0, 25.0], [pytest.approx(0.0322), 1.0, 0.0]]


def test_an_idle_generation_server_waits_for_its_transfer_before_taking_in_another() -> None:
    # A at t = 0, prompt 100, output 20 (30 blocks to completion), answered at 11 ms; C at 8.05 ms,
    # prompt 20, output 2 (22 tokens: 6 blocks), prefilled in 1 + 2 = 3 ms: answered at 11.05 ms.
    # 11.00 ms: A admitted (25 blocks taken) and its KV requested; it is the only active request and
    #   its KV is on its way, so the executor loop waits for that transfer (check_gen_transfer_status(1)).
    # 11.05 ms: C arrives and waits: A's read ends at 11.15 ms (alone at 1e9 B/s).
    # 11.15 ms: A runs, its first token sent, and C is admitted: 15 free less A's 5 to come = 10 >= 6.
    #   C's read: 0.05 ms + 20 us, in at 11.22 ms, during A's first step (11.15 -> 12.25 ms): C's first
    #   token at 12.25 ms. (Taken in at 11.05 ms, C's read would have shared the port with A's.)
    h, _, d, (a, c) = _run([(0.0, 100, 20), (8.05e-3, 20, 2)], prefill=2, d_blocks=40)
    assert h.transfer_start_s * 1e3 == pytest.approx([11.0, 11.15])
    assert h.transfer_end_s * 1e3 == pytest.approx([11.15, 11.22])
    assert a.first_token_s * 1e3 == pytest.approx(11.15)
    assert c.first_token_s * 1e3 == pytest.approx(12.25)


def test_kv_on_its_way_keeps_nothing_back_and_its_end_is_seen_at_the_next_pass() -> None:
    # A link of 0.4 Gb/s (5e7 B/s): n tokens in 0.05 ms + n x 20 us alone. Generation pool of 48
    # blocks; three context instances.
    # D at t = 0, prompt 8, output 30 (38 tokens: 10 blocks): prefilled in 1.8 ms, read by 2.01 ms;
    #   it then decodes alone, its steps of 1.1 ms ending at 2.01 + 1.1 k ms (the passes).
    # A at t = 0, prompt 100, output 20 (30 blocks): answered at 11 ms, during D's 9th step; the
    #   capacity scheduler takes it at the next pass, 11.91 ms (D: 17 tokens in 5 blocks, 5 to come;
    #   43 - 5 = 38 >= 30). Its 25 prompt blocks taken (18 free), its bytes flow from 11.96 ms.
    # C at 7 ms, prompt 40, output 2 (42 tokens: 11 blocks): answered at 7 + 5 = 12 ms. Pass at 13.01:
    #   A's KV is on its way, so its 5 blocks to come are not kept back: 18 free less D's 5 = 13 >= 11
    #   (less A's 5 too, 8 would not do). C takes 10 blocks; its bytes from 13.06 ms.
    # 13.06 ms: A has 100,000 - 1.1 ms x 5e7 = 45,000 bytes left; the two share the port at 2.5e7 B/s:
    #   C's 40,000 in after 1.6 ms, at 14.66 ms; A's last 5,000 alone in 0.1 ms: 14.76 ms.
    # Both ends fall in D's 12th step (14.11 -> 15.21 ms): A and C run from 15.21 ms, their first
    #   tokens sent then. D, A and C: 1.3 ms: C's second token at 16.51 ms, C finishes. D (14 tokens)
    #   and A (2): 16 steps of 1.2 ms to 35.71 ms, when D has its 30; A's last 2 alone: 37.91 ms.
    slow = LinkSpec(bandwidth_gbps=0.4, latency_us=50.0)
    h, _, d, (dd, a, c) = _run([(0.0, 8, 30), (0.0, 100, 20), (7e-3, 40, 2)], prefill=3, d_blocks=48, link=slow)
    assert h.transfer_start_s * 1e3 == pytest.approx([1.8, 11.91, 13.01])
    assert h.transfer_end_s * 1e3 == pytest.approx([2.01, 14.76, 14.66])
    assert [a.first_token_s * 1e3, c.first_token_s * 1e3] == pytest.approx([15.21, 15.21])
    assert c.finished_s * 1e3 == pytest.approx(16.51)
    assert dd.finished_s * 1e3 == pytest.approx(35.71)
    assert a.finished_s * 1e3 == pytest.approx(37.91)


@pytest.mark.parametrize("overlap", [False, True])
def test_the_context_server_reserves_the_clients_max_tokens_and_the_generation_server_admits_per_pass(
        overlap) -> None:
    # One context instance of 60 blocks. A and B at t = 0, prompt 100; A with 100 outputs (200 tokens:
    # 50 blocks to completion), B with 2 (102 tokens: 26). The context copies keep max_tokens, so A
    # takes 50 of the 60 and B's 26 do not fit the 10 left (with max_tokens 1, 26 + 26 would: one
    # step of 1 + 0.1 x 200 = 21 ms for both).
    # A: prefilled 0 -> 11 ms; it then holds 25 blocks for its transfer: 35 free, B's 26 fit: B is
    #   prefilled 11 -> 22 ms. Under the overlap scheduler B is chosen at t = 0, while A's prompt
    #   runs: A's context phase is launched, it has left the scheduler and nothing is kept back for
    #   it (60 - 25 = 35 free); its step still starts when A's ends, at 11 ms.
    # Generation side: A in at 11.15 ms, first token then, then steps of 1.1 ms ending at 11.15 + 1.1 k.
    #   B arrives at 22 ms during A's 10th step: the capacity scheduler admits it at the next pass,
    #   22.15 ms; its read ends at 22.30 ms during A's 11th step, seen at 23.25 ms: B's first token.
    #   Synchronous loop: A and B together, 1.2 ms: B's second token at 24.45 ms. Overlap scheduler:
    #   the step chosen at 23.25 ms runs after the one in flight (A's 12th, to 24.35 ms): 25.55 ms.
    #   Either way A's 99 steps are 98 of 1.1 ms and one of 1.2: A ends at 11.15 + 107.8 + 1.2 =
    #   120.15 ms.
    h, (p,), d, (a, b) = _run([(0.0, 100, 100), (0.0, 100, 2)], p_blocks=60, overlap=overlap)
    assert h.prefill_done_s * 1e3 == pytest.approx([11.0, 22.0])
    assert p.state.records.pop("first_scheduled_s") * 1e3 == pytest.approx([0.0, 0.0 if overlap else 11.0])
    assert h.transfer_start_s[1] * 1e3 == pytest.approx(22.15)
    assert h.transfer_end_s[1] * 1e3 == pytest.approx(22.30)
    assert b.first_token_s * 1e3 == pytest.approx(23.25)
    assert b.finished_s * 1e3 == pytest.approx(25.55 if overlap else 24.45)
    assert a.finished_s * 1e3 == pytest.approx(120.15)


def _workload(**disagg) -> dict:
    return {"name": "pd", "num_requests": 10, "arrivals": {"kind": "poisson", "rate": 2.0},
            "lengths": {"kind": "fixed", "prompt_tokens": 256, "output_tokens": 16},
            "policy": {"kind": "tensorrt_llm"}, "disaggregation": {"prefill": {}, "decode": {}, **disagg}}


@pytest.mark.parametrize("change, field", [
    ({"prefill": {"policy": {"kind": "vllm_v1"}}}, "disaggregation.prefill.policy.kind"),
    ({"decode": {"policy": {"kind": "vllm_v1"}}}, "disaggregation.decode.policy.kind"),
    ({"decode": {"policy": {"capacity_scheduler_policy": "MAX_UTILIZATION"}}},
     "disaggregation.decode.policy.capacity_scheduler_policy"),
    ({"abort_timeout_s": 30}, "disaggregation.abort_timeout_s"),
])
def test_what_the_tensorrt_llm_handoff_does_not_model_is_refused(change, field) -> None:
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        workload_from_dict(_workload(**change), "w.yaml")


def test_tensorrt_llm_pools_run_without_an_abort_timeout() -> None:
    d = workload_from_dict(_workload(), "w.yaml").disaggregation
    assert d.abort_timeout_s is None
    assert d.to_dict()["abort_timeout_s"] is None


def test_the_bundled_example_runs_and_its_phases_add_up_to_ttft() -> None:
    from sim.run.disagg import run_disaggregated
    cfg = load_workload(WORKLOADS / "pd_trtllm_llama8b.yaml", {"num_requests": 40})
    result = run_disaggregated(cfg)
    req = result.requests
    done = req[req["status"] == "finished"]
    assert len(done) == 40
    parts = done[["prefill_queue_s", "prefill_s", "transfer_wait_s", "transfer_s", "decode_queue_s",
                  "decode_first_step_s"]].sum(axis=1)
    assert np.allclose(parts, done["ttft_s"], rtol=0, atol=1e-9)
    assert (done["decode_first_step_s"] == 0).all()             # the first token is the context side's
    pd_ = result.summary["disaggregation"]
    assert pd_["num_transfers"] == 40 and pd_["num_transfer_timeouts"] == 0

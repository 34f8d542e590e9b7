"""SGLang's disaggregated handoff (sim.loop.handoff_sglang), by hand.

Every server runs sglang without its overlap loop unless a test says so, pages of 1 token,
chunked prefill of 64 tokens, on linear_profile with free attention: a step of t tokens costs
1 + 0.1 t ms. The decode side's radix cache is off, as SGLang runs a decode instance. The KV
is 1,000 bytes a token and the link 8 Gb/s per GPU each way (1e9 bytes/s) with 50 us of
latency, TP 1 on both sides: n tokens alone take 0.05 ms + n x 1 us.

A prompt of 100 tokens prefills in two chunks: 64 tokens in 1 + 6.4 = 7.4 ms, then 36 in
1 + 3.6 = 4.6 ms, done at 12.0 ms after it starts. After the first chunk its 64 tokens are sent
(0.05 + 0.064 = 0.114 ms alone); at the end the other 36 go with the first token
(0.05 + 0.036 = 0.086 ms alone).
"""

from __future__ import annotations

import numpy as np
import pytest
import simpy

from conftest import WORKLOADS, linear_profile, policy_state
from policies.sglang import SglangConfig, SglangPolicy
from sim.base.strict import ConfigError
from sim.core.policy import PolicyContext
from sim.core.request import Request
from sim.loop.handoff import LinkSpec, feed_prefills
from sim.loop.handoff_sglang import SglangHandoff
from sim.loop.server import Server, SimExecutor
from sim.run.config import load_workload, workload_from_dict

PROFILE = linear_profile(per_token_s=1e-4, overhead_s=1e-3, decode_per_ctx_s=0.0, prefill_per_ctx_s=0.0)
LINK = LinkSpec(bandwidth_gbps=8.0, latency_us=50.0)


def _servers(env, n: int, first: int, num_tokens: int, decode: bool, overlap: bool):
    out = []
    for k in range(n):
        policy = SglangPolicy(SglangConfig(page_size=1, chunked_prefill_size=64, max_running_requests=8,
                                           enable_overlap=overlap, disable_radix_cache=decode), PolicyContext(1024))
        out.append(Server(env, policy, policy_state(policy, num_tokens, 1, 1024), SimExecutor(PROFILE),
                          replica=first + k))
    return out


def _setup(specs, *, prefill: int = 1, p_tokens: int = 2000, d_tokens: int = 2000, reserved: int = 10,
           overlap: bool = False):
    env = simpy.Environment()
    p = _servers(env, prefill, 0, p_tokens, False, overlap)
    d = _servers(env, 1, prefill, d_tokens, True, overlap)
    h = SglangHandoff(env, p, d, ("round_robin", "round_robin"), LINK, 1000, (1, 1), len(specs),
                      reserved_tokens=reserved)
    reqs = [Request(i, a, pr, o) for i, (a, pr, o) in enumerate(specs)]
    env.process(feed_prefills(env, h, reqs, [o for *_, o in specs]))
    return env, h, p, d, reqs


def _run(specs, *, contents=None, **kw):
    env, h, p, d, reqs = _setup(specs, **kw)
    for r, c in zip(reqs, contents or ()):
        r.content = c
    env.run()
    return h, p, d, reqs


@pytest.mark.parametrize("overlap", [False, True])
def test_one_request_reservation_prefill_chunks_and_the_prefills_first_token(overlap) -> None:
    # One request at t = 0, prompt 100, output 3; R (num_reserved_decode_tokens) = 10.
    # Decode pass at 0: nothing running, so allocatable = 2,000 free - max(10 x 0 active, 0) = 2,000;
    #   it needs max(100 + 10, 100 + 3 - 0) = 110: reserved at 0, 100 tokens taken.
    # Prefill: bootstrapped at 0; chunk 1 ends 7.4 ms, its 64 tokens sent then (in at 7.514 ms);
    #   chunk 2 ends 12.0 ms with the first token; the last 36 tokens go then, in at 12.086 ms.
    # Decode: the transfer is in at 12.086, the idle decode instance's pass takes it in and streams
    #   the prefill's token at once: first token 12.086 ms. Its next steps decode 1 token each,
    #   1.1 ms: 13.186 and 14.286 ms. (The profile has no host part: the overlap loop times the same.)
    h, (p,), (d,), (r,) = _run([(0.0, 100, 3)], overlap=overlap)
    assert h.reserved_s[0] == 0.0
    assert h.prefill_done_s[0] * 1e3 == pytest.approx(12.0)
    assert h.transfer_start_s[0] * 1e3 == pytest.approx(7.4)        # during the prefill
    assert h.num_chunks[0] == 2 and h.transfer_tokens[0] == 100
    assert h.transfer_end_s[0] * 1e3 == pytest.approx(12.086)
    ids, times = d.state.tokens.arrays()
    assert ids.tolist() == [0, 0, 0]
    assert np.allclose(times * 1e3, [12.086, 13.186, 14.286])
    assert r.first_token_s * 1e3 == pytest.approx(12.086)
    # The decode side computed no prompt token: two 1-token decode steps in all.
    rows = [ints.reshape(-1, 8) for _, _, _, ints in d.log.chunks()][0]
    assert len(rows) == 2 and rows[:, 1].sum() + rows[:, 2].sum() == 2
    # The prefill side held its 100 tokens from its end (12.0) until the last send was in (12.086).
    assert h.held_timeline().tolist() == [[pytest.approx(0.012), 0.0, 100.0], [pytest.approx(0.012086), 0.0, 0.0]]
    assert p.state.kv.num_used_blocks == 0 and not p.state.held


def test_a_full_decode_pool_holds_the_request_in_bootstrap_with_no_kv_on_the_prefill_side() -> None:
    # Decode pool of 150 tokens, R = 10. A (prompt 100, output 20) and B (prompt 100, output 2) at 0.
    # Pass at 0: A needs max(110, 120) = 120 <= 150: reserved, 50 free. B: allocatable =
    #   50 - max(10 x 1, 0) = 40 < max(110, 102) = 110: it waits in the prealloc queue, and its
    #   prefill instance keeps it in its bootstrap queue.
    # A: transfer in at 12.086 ms, first token then, 19 more decode steps of 1.1 ms: its last token
    #   at 12.086 + 20.9 = 32.986 ms, when it frees its KV. While A runs B never fits (at most
    #   150 - 100 = 50 tokens free).
    # B: reserved at the pass at 32.986 ms (all 150 free), prefilled 32.986 -> 44.986 ms, its first
    #   chunk sent at 40.386 ms, the rest at 44.986 ms, in at 45.072 ms: first token 45.072 ms.
    env, h, (p,), (d,), (a, b) = _setup([(0.0, 100, 20), (0.0, 100, 2)], d_tokens=150)
    env.run(until=0.030)
    # At 30 ms A decodes; B waits for its reservation and the prefill instance holds no KV for it.
    assert np.isnan(h.reserved_s[1])
    assert [r.req_id for r in p.state.remote.holding] == [1] and not p.state.waiting and not p.state.running
    assert p.state.kv.num_used_blocks == 0
    env.run()
    assert a.finished_s * 1e3 == pytest.approx(32.986)
    assert h.reserved_s[1] * 1e3 == pytest.approx(32.986)
    assert h.transfer_start_s[1] * 1e3 == pytest.approx(40.386)
    assert h.prefill_done_s[1] * 1e3 == pytest.approx(44.986)
    assert b.first_token_s * 1e3 == pytest.approx(45.072)
    # The prefill instance's steps: A's two chunks, then nothing until B's reservation.
    starts = [s for t, *_ in p.log.chunks() for s in t]
    assert np.allclose(np.array(starts) * 1e3, [0.0, 7.4, 32.986, 40.386])


def test_a_one_token_reply_ends_on_the_decode_side_without_a_step() -> None:
    # Prompt 100, output 1: the prefill's token is the whole reply. Its transfer is in at 12.086 ms
    # (as above); the decode pass that takes it in streams that token and finishes it: first token
    # and finish at 12.086 ms, no decode step, and its 100 reserved tokens freed.
    h, _, (d,), (r,) = _run([(0.0, 100, 1)])
    assert r.first_token_s * 1e3 == pytest.approx(12.086) and r.finished_s == r.first_token_s
    assert not list(d.log.chunks())                      # the decode instance ran no step
    assert d.state.kv.num_used_blocks == 0 and d.state.done


def test_a_prefix_cached_on_the_prefill_side_is_sent_as_its_step_starts() -> None:
    # A and B, the same 100-token prompt, output 1; A at 0, B at 100 ms. A as above: its KV freed into
    # the prefill's radix tree at 12.086 ms. B: reserved at 100 ms; the prefill matches 99 tokens (at
    # most num_tokens - 1) and computes 1, a step of 1.1 ms. The 99 cached tokens are sent as the step
    # starts, in at 100 + 0.05 + 0.099 = 100.149 ms; the last token at 101.1 ms, in at 101.151 ms:
    # B's first token 101.151 ms (with the prefix sent only at the end: 101.1 + 0.15 = 101.25 ms).
    h, _, _, (a, b) = _run([(0.0, 100, 1), (0.1, 100, 1)], contents=[(900, 7, 100)] * 2)
    assert h.reserved_s[1] * 1e3 == pytest.approx(100.0)
    assert h.transfer_start_s[1] * 1e3 == pytest.approx(100.0)
    assert h.prefill_done_s[1] * 1e3 == pytest.approx(101.1)
    assert h.num_chunks[1] == 2 and h.transfer_tokens[1] == 100
    assert b.first_token_s * 1e3 == pytest.approx(101.151)


def test_two_requests_share_the_decode_instances_port() -> None:
    # Two requests at 0, prompt 100, output 2, one on each of two prefill instances; the decode
    # instance reserves both at 0 (B: allocatable 1,900 - 10 = 1,890 >= 110). Both prefills send
    # their first chunks at 7.4 ms into the one decode port: each at 0.5e9 B/s, 64,000 bytes in
    # 0.128 ms after the 0.05 ms latency: in at 7.578 ms. The last 36 tokens each at 12.0 ms:
    # 36,000 bytes at half the port, 0.072 ms after the latency: both in at 12.122 ms.
    # First tokens at 12.122 ms; one decode step for both, 1 + 0.2 = 1.2 ms: done at 13.322 ms.
    h, _, (d,), reqs = _run([(0.0, 100, 2), (0.0, 100, 2)], prefill=2)
    assert h.reserved_s.tolist() == [0.0, 0.0]
    assert np.allclose(h.transfer_end_s * 1e3, [12.122, 12.122])
    assert [r.first_token_s * 1e3 for r in reqs] == [pytest.approx(12.122)] * 2
    assert [r.finished_s * 1e3 for r in reqs] == [pytest.approx(13.322)] * 2
    flight = h.link_timeline()
    assert flight[:, 1].max() == 2
    assert h.link.bytes_moved[("d", 2)] == 200_000


def test_the_headroom_rule_refuses_what_the_free_pool_would_take() -> None:
    # Decode pool of 300 tokens, R = 10. A (prompt 100, output 20) and B (prompt 100, output 150) at 0.
    # Pass at 0: A reserved (needs max(110, 120) = 120), 200 free. B: allocatable = 200 - 10 x 1 = 190;
    #   it needs max(110, 100 + 150 - 0) = 250 > 190: refused, though its 100-token prompt fits the
    #   200 free tokens (what vLLM's rule, or a rule of the prompt alone, would take).
    # Pass at 12.086 ms: still refused (A joins the running batch in this pass, after the prealloc
    #   queue ran). Pass at 13.186 ms, after A's first decode step: A runs with 2 outputs, holding
    #   101 tokens: retractable = 102, single = 100 + 20 - 102 = 18, allocatable = 199 - max(10, 18)
    #   = 181; B needs max(110, 250 - 102) = 148: reserved at 13.186 ms.
    # B's prefill 13.186 -> 25.186 ms, the last send in at 25.272 ms; the decode passes come every
    #   1.1 ms from 12.086 ms: 24.186 < 25.272 <= 25.286: B's first token at 25.286 ms.
    h, _, (d,), (a, b) = _run([(0.0, 100, 20), (0.0, 100, 150)], d_tokens=300)
    assert h.reserved_s[0] == 0.0
    assert h.reserved_s[1] * 1e3 == pytest.approx(13.186)
    assert h.prefill_done_s[1] * 1e3 == pytest.approx(25.186)
    assert h.transfer_end_s[1] * 1e3 == pytest.approx(25.272)
    assert b.first_token_s * 1e3 == pytest.approx(25.286)


def test_a_larger_headroom_holds_a_request_until_the_pool_is_empty() -> None:
    # As above with R = 512 and a pool of 800: A needs max(100 + 512, 120) = 612 <= 800: reserved at 0,
    # 700 free. B: allocatable = 700 - 512 x 1 = 188 < 612 while A is in transfer; with A running,
    # allocatable = free - max(512 x 1, single) <= 700 - 512 = 188 < 612 still. When A finishes at
    # 32.986 ms (as in the full-pool test), all 800 are free and nothing is active: B reserved then.
    h, _, _, (a, b) = _run([(0.0, 100, 20), (0.0, 100, 2)], d_tokens=800, reserved=512)
    assert a.finished_s * 1e3 == pytest.approx(32.986)
    assert h.reserved_s[1] * 1e3 == pytest.approx(32.986)


def _workload(**disagg) -> dict:
    return {"name": "pd", "num_requests": 10, "arrivals": {"kind": "poisson", "rate": 2.0},
            "lengths": {"kind": "fixed", "prompt_tokens": 256, "output_tokens": 16}, "policy": {"kind": "sglang"},
            "disaggregation": {"prefill": {}, "decode": {}, **disagg}}


@pytest.mark.parametrize("change, field, words", [
    ({"prefill": {"policy": {"kind": "vllm_v1"}}}, "disaggregation.decode.policy.kind", "prefill.policy.kind"),
    ({"decode": {"policy": {"kind": "tgi"}}}, "disaggregation.decode.policy.kind", "vllm_v1 or sglang"),
    ({"abort_timeout_s": 30}, "disaggregation.abort_timeout_s", "NixlConnector"),
    ({"proxy_ms": 1.0}, "disaggregation.proxy_ms", "both at once"),
    ({"num_reserved_decode_tokens": -1}, "disaggregation.num_reserved_decode_tokens", ">= 0"),
    ({"decode": {"policy": {"disable_radix_cache": False}}}, "disaggregation.decode.policy.disable_radix_cache",
     "disaggregation-decode-enable-radix-cache"),
])
def test_refused_sglang_combinations_name_their_field(change, field, words) -> None:
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")) as err:
        workload_from_dict(_workload(**change), "w.yaml")
    assert "w.yaml" in str(err.value) and words in str(err.value)


def test_sglangs_field_is_refused_with_vllms_handoff() -> None:
    data = _workload(num_reserved_decode_tokens=256)
    data["policy"]["kind"] = "vllm_v1"
    with pytest.raises(ConfigError, match=r"disaggregation\.num_reserved_decode_tokens.*vllm_v1"):
        workload_from_dict(data, "w.yaml")


def test_the_decode_pool_runs_without_its_radix_cache_and_the_headroom_is_read() -> None:
    cfg = workload_from_dict(_workload(num_reserved_decode_tokens=256), "w.yaml")
    d = cfg.disaggregation
    assert d.handoff == "sglang" and d.num_reserved_decode_tokens == 256
    assert d.decode.cfg.policy.disable_radix_cache and not d.prefill.cfg.policy.disable_radix_cache


def test_the_bundled_example_runs_and_its_phases_add_up_to_ttft() -> None:
    from sim.run.disagg import run_disaggregated
    cfg = load_workload(WORKLOADS / "pd_sglang_llama70b.yaml", {"duration_s": 30})
    result = run_disaggregated(cfg)
    req = result.requests
    done = req[req["status"] == "finished"]
    assert len(done) == len(req) > 50
    parts = done[["bootstrap_wait_s", "prefill_queue_s", "prefill_s", "transfer_wait_s", "transfer_s",
                  "decode_queue_s", "decode_first_step_s"]]
    assert (parts >= -1e-12).all().all()
    assert np.allclose(parts.sum(axis=1), done["ttft_s"], rtol=0, atol=1e-9)
    # The first token is the prefill's, streamed when the decode side takes the request in.
    assert (done["decode_first_step_s"] == 0).all()
    pd_ = result.summary["disaggregation"]
    assert pd_["num_transfers"] == len(done) and pd_["handoff"] == "sglang"
    assert (done["transfer_tokens"] == done["prompt_tokens"]).all()        # no decode-side prefix cache

"""Speculative decoding in vllm_v1, by hand: the verify items, the acceptance's tokens and
rollback, the lookahead slots, the proposer's cost, the metrics, and the config's errors.

The step cost is linear_profile's: 1 ms a step plus 0.1 ms a token (attention free), so a
step of t tokens costs 1 + 0.1 t ms; an n-gram proposer costs 0.5 ms per request it drafts for.
"""

from __future__ import annotations

import numpy as np
import pytest
import simpy

from conftest import WORKLOADS, linear_profile, policy_state
from policies import make_policy
from policies.config import policy_config
from policies.vllm_v1 import VllmV1Config
from sim.base.strict import ConfigError
from sim.core.batch import Batch, BatchItem
from sim.core.policy import PolicyContext
from sim.core.request import Request
from sim.core.speculative import Speculation, geometric_rate, parse_speculative
from sim.loop.feed import feed
from sim.loop.server import Server, SimExecutor
from sim.results.metrics import inter_token_latencies

PROFILE = linear_profile(per_token_s=1e-4, overhead_s=1e-3, decode_per_ctx_s=0.0, prefill_per_ctx_s=0.0)
NGRAM = {"method": "ngram", "num_speculative_tokens": 2, "acceptance_length": 2.0, "ngram_host_s_per_seq": 5e-4}


def _run(specs, spec: dict, accept=lambda rid, out, d: 1, num_blocks: int = 100, block_size: int = 4,
         budget: int = 64):
    """(arrival_s, prompt, output) per request through one vllm_v1 server with ``spec`` and a
    fixed acceptance; (server, requests)."""
    env = simpy.Environment()
    policy = make_policy(VllmV1Config(max_num_seqs=8, max_num_batched_tokens=budget, enable_prefix_caching=False,
                                      async_scheduling=False, speculative=spec), 1024)
    state = policy_state(policy, num_blocks, block_size, 1024)
    state.speculation = Speculation(policy.speculative, accept=accept)
    server = Server(env, policy, state, SimExecutor(PROFILE))
    reqs = [Request(i, a, p, o) for i, (a, p, o) in enumerate(specs)]
    env.process(feed(env, [server], reqs, [o for *_, o in specs]))
    env.run()
    return server, reqs


def test_verify_timeline_by_hand() -> None:
    # One request, prompt 8, output 5; k = 2 drafts, each verify step accepts 1.
    # Step 1 (t=0): the prompt, 8 tokens: 1 + 0.8 ms, + 0.5 ms proposer (it sampled) = 2.3 ms;
    #   token 1 at 2.3 ms; 2 drafts.
    # Step 2: 9 known + 2 drafts - 8 computed = 3 tokens: 1 + 0.3 + 0.5 = 1.8 ms, ends 4.1 ms;
    #   1 draft accepted: tokens 2 and 3 at 4.1 ms; computed 9 + 1 = 10 (the rejected one rolled back).
    # Step 3: 11 known + 2 - 10 = 3 tokens, 1.8 ms, ends 5.9 ms: tokens 4 and 5 (its last), done.
    server, (r,) = _run([(0.0, 8, 5)], NGRAM)
    ids, times = server.state.tokens.arrays()
    assert ids.tolist() == [0] * 5
    assert np.allclose(times * 1e3, [2.3, 4.1, 4.1, 5.9, 5.9])
    assert r.first_token_s * 1e3 == pytest.approx(2.3)
    assert r.finished_s * 1e3 == pytest.approx(5.9)
    # ITL is one gap per streamed chunk (a step's tokens arrive together): 1.8 and 1.8 ms.
    assert np.allclose(inter_token_latencies(ids, times) * 1e3, [1.8, 1.8])
    # vLLM's counters: 2 verify steps, 4 draft tokens, 2 accepted (both at position 1).
    spec = server.state.speculation
    assert (spec.num_drafts, spec.num_draft_tokens, spec.num_accepted_tokens) == (2, 4, 2)
    assert spec.accepted_per_pos == [2, 0]
    assert spec.summary()["mean_acceptance_length"] == 2.0          # 1 + 2 / 2
    assert spec.summary()["acceptance_rate"] == 0.5                 # 2 / 4
    # The step log counts verify items as decodes: 8 prefill, then 3 + 3 decode tokens.
    rows = [ints.reshape(-1, 8) for _, _, _, ints in server.log.chunks()][0]
    assert rows[:, 1].tolist() == [8, 0, 0] and rows[:, 2].tolist() == [0, 3, 3]


def test_output_ends_among_accepted_drafts() -> None:
    # Prompt 4, output 2, every draft accepted: step 1 the prompt (token 1); step 2 verifies 2
    # drafts and accepts both, but only one more token is wanted: vLLM's stop check trims
    # the rest, so 2 tokens in all and the request finishes after step 2.
    server, (r,) = _run([(0.0, 4, 2)], NGRAM, accept=lambda rid, out, d: d)
    assert len(server.state.tokens.arrays()[0]) == 2
    assert server.state.speculation.num_accepted_tokens == 2 and r.finished_s is not None


def test_eagle_reserves_lookahead_slots() -> None:
    # EAGLE, k = 2: every allocation reserves 2 slots past the scheduled tokens (vLLM's
    # num_lookahead_tokens). Block size 4: the prompt of 8 takes ceil((8 + 2) / 4) = 3 blocks
    # (n-gram: 2). Acceptance 0: step 2 verifies 2 drafts, 3 tokens at 8 computed: slots 11 + 2
    # = 13: 4 blocks (n-gram: 11, 3 blocks).
    eagle = {"method": "eagle", "num_speculative_tokens": 2, "acceptance_length": 1.0}
    for spec, blocks in ((eagle, [3, 4]), (NGRAM, [2, 3])):
        server, _ = _run([(0.0, 8, 3)], spec, accept=lambda rid, out, d: 0)
        rows = [ints.reshape(-1, 8) for _, _, _, ints in server.log.chunks()][0]
        assert rows[:2, 7].tolist() == blocks, spec["method"]


def test_verify_item_costs_its_tokens_and_one_decode_attention() -> None:
    # Batch of a verify item (1 + 3 drafts at context 100) and a plain decode at context 50: 5
    # tokens through the linear layers; the verify item's attention is its decode's (one pass
    # over its 100 tokens of KV), not a 4-query prefill chunk's nor 4 decodes'.
    profile = linear_profile(per_token_s=1e-4, overhead_s=1e-3, decode_per_ctx_s=1e-6, prefill_per_ctx_s=1e-8)
    batch = Batch((BatchItem(0, 4, 100), BatchItem(1, 1, 50)), drafts={0: 3})
    assert (batch.num_decode_tokens, batch.num_prefill_tokens, batch.num_spec_tokens) == (5, 0, 3)
    assert batch.prefill_chunks == () and (batch.decode_seqs, batch.decode_context) == (2, 150)
    # 1 ms + 5 x 0.1 ms + attn_decode over 100 + 50 tokens of context = 150 x 1e-6 s
    assert profile.step_time_s(batch) == pytest.approx(1e-3 + 5e-4 + 1.5e-4)


def test_eagle_proposer_cost_by_hand() -> None:
    # The toy model: 2 layers, hidden 256, vocab 1000; EAGLE with 1 draft layer is half the
    # layers. Matmul weights one token uses: num_active_params less the input embedding.
    # linear_profile's linear(t) = 0.1 ms x t, attention free. 3 sequences sampled, 7 tokens:
    # pass 1 = 0.5 x (1 - h) x linear(7), passes 2..k = 0.5 x (1 - h) x linear(3), and k LM
    # heads of h x linear(3), h = 256 x 1000 / matmul weights.
    m = PROFILE.model
    h = 256 * 1000 / (m.num_active_params - 256 * 1000)
    spec = parse_speculative({"method": "eagle", "num_speculative_tokens": 3, "acceptance_length": 2.0}, "t")
    want = 0.5 * (1 - h) * 7e-4 + 2 * 0.5 * (1 - h) * 3e-4 + 3 * h * 3e-4
    assert PROFILE.proposer_s(spec, 3, 7, 300) == pytest.approx(want)
    ngram = parse_speculative(NGRAM, "t")
    assert PROFILE.proposer_s(ngram, 3, 7, 300) == pytest.approx(3 * 5e-4)


def test_acceptance_models_by_hand() -> None:
    # k = 2, length 1.75: 1 + c + c^2 = 1.75 -> c = 0.5; k = 1, length 1.5: c = 0.5.
    assert geometric_rate(2, 1.75) == pytest.approx(0.5, abs=1e-9)
    assert geometric_rate(1, 1.5) == pytest.approx(0.5, abs=1e-9)
    # Per-position rates 0.8, 0.6, 0.3: conditionals 0.8, 0.6 / 0.8 = 0.75, 0.3 / 0.6 = 0.5;
    # mean length 1 + 0.8 + 0.6 + 0.3 = 2.7.
    spec = parse_speculative({"method": "mtp", "num_speculative_tokens": 3, "acceptance_rates": [0.8, 0.6, 0.3]},
                             "t")
    assert spec.conditional == pytest.approx((0.8, 0.75, 0.5)) and spec.acceptance_length == pytest.approx(2.7)
    # Drawn with a seed, 200,000 verify steps of 3 drafts average 1.7 accepted (std of the mean
    # ~0.0025: 0.02 is 8 of them) and accept position 1 in 80% of them.
    s = Speculation(spec, np.random.default_rng(7))
    total = sum(s.accepted(0, 0, 3) for _ in range(200_000))
    assert total / 200_000 == pytest.approx(1.7, abs=0.02)
    assert s.accepted_per_pos[0] / 200_000 == pytest.approx(0.8, abs=0.01)


@pytest.mark.parametrize("spec, field", [
    ({"method": "medusa2", "num_speculative_tokens": 2, "acceptance_length": 2}, "policy.speculative.method"),
    ({"method": "draft_model", "num_speculative_tokens": 2, "acceptance_length": 2}, "policy.speculative.method"),
    ({"method": "eagle", "num_speculative_tokens": 2}, "policy.speculative"),
    ({"method": "eagle", "num_speculative_tokens": 2, "acceptance_length": 3.5}, "policy.speculative.acceptance_length"),
    ({"method": "eagle", "num_speculative_tokens": 3, "acceptance_rates": [0.9, 0.5]},
     "policy.speculative.acceptance_rates"),
    ({"method": "eagle", "num_speculative_tokens": 2, "acceptance_rates": [0.5, 0.7]},
     "policy.speculative.acceptance_rates"),
    ({"method": "eagle", "num_speculative_tokens": -1, "acceptance_length": 1}, "policy.speculative.num_speculative_tokens"),
    ({"method": "eagle", "num_speculative_tokens": 2, "acceptance_length": 2, "k": 1}, "policy.speculative.k"),
    ({"method": "ngram", "num_speculative_tokens": 2, "acceptance_length": 2, "draft_layers": 2},
     "policy.speculative.draft_layers"),
])
def test_bad_speculative_config_names_its_field(spec, field) -> None:
    with pytest.raises(ConfigError, match=f"w.yaml: .*field '{field}'"):
        policy_config({"kind": "vllm_v1", "speculative": spec}, "w.yaml")


def test_async_scheduling_with_speculation() -> None:
    # On a GPU vLLM 0.32 runs EAGLE under async scheduling (unset: on); n-gram turns it off
    # and refuses it when asked for.
    gpu = PolicyContext(1024, "h100-sxm", 80 << 30)
    eagle = {"method": "eagle", "num_speculative_tokens": 2, "acceptance_length": 2}
    assert make_policy(VllmV1Config(speculative=eagle), gpu).async_scheduling
    assert not make_policy(VllmV1Config(speculative=eagle), PolicyContext(1024, "cpu")).async_scheduling
    assert not make_policy(VllmV1Config(speculative=NGRAM), gpu).async_scheduling
    with pytest.raises(ValueError, match="refuses it"):
        make_policy(VllmV1Config(speculative=NGRAM, async_scheduling=True), gpu)
    assert make_policy(VllmV1Config(speculative={**eagle, "num_speculative_tokens": 0}), gpu).speculative is None


def test_run_reports_vllm_spec_decode_counters(tmp_path) -> None:
    """A whole run: the summary's counters are vLLM's, and the acceptance drawn matches the
    model's mean within sampling error (acceptance length 2.5 of k = 3)."""
    from sim.run.config import load_workload
    from sim.run.runner import run_workload
    cfg = load_workload(WORKLOADS / "sharegpt_poisson.yaml", {
        "num_requests": 60, "profile": {"model": "llama-3.1-8b", "gpu": "h100-sxm"},
        "policy": {"kind": "vllm_v1", "async_scheduling": False,
                   "speculative": {"method": "eagle", "num_speculative_tokens": 3, "acceptance_length": 2.5}}})
    s = run_workload(cfg).summary
    assert s["spec_decode_mean_acceptance_length"] == pytest.approx(2.5, abs=0.05)
    assert s["spec_decode_num_draft_tokens"] == 3 * s["spec_decode_num_drafts"]      # no draft cut short here
    assert sum(s["spec_decode_num_accepted_tokens_per_pos"]) == s["spec_decode_num_accepted_tokens"]
    # Every output token but each request's first comes from a verify step (accepted + bonus),
    # less what a request's last verify step accepted past its end (at most k = 3 a request).
    past_end = s["spec_decode_num_accepted_tokens"] + s["spec_decode_num_drafts"] - (s["total_output_tokens"] - 60)
    assert s["completed"] == 60 and 0 <= past_end <= 3 * 60


def test_the_bundled_sweep_varies_k_from_0_to_5() -> None:
    """workloads/sweep_speculative.yaml: 6 values of k x 3 rates, each variant a valid policy
    whose k drafts take the first k of the per-position rates (k = 0: no speculation)."""
    from reports.experiments.spec import expand, parse_sweep
    tasks = expand(parse_sweep(WORKLOADS / "sweep_speculative.yaml", out=None))
    assert len(tasks) == 18
    ks = sorted({t.raw["policy"]["speculative"]["num_speculative_tokens"] for t in tasks})
    assert ks == [0, 1, 2, 3, 4, 5]
    for t in tasks:
        cfg = policy_config(t.raw["policy"], "sweep")
        policy = make_policy(cfg, PolicyContext(8192, "h100-sxm", 80 << 30))
        k = t.raw["policy"]["speculative"]["num_speculative_tokens"]
        if k == 0:
            assert policy.speculative is None
        else:
            # rates 0.80, 0.62, 0.48, 0.37, 0.28: mean length 1 + the first k of them
            assert policy.speculative.acceptance_length == pytest.approx(1 + sum([0.80, 0.62, 0.48, 0.37, 0.28][:k]))


def test_speculation_on_another_policy_is_refused_not_ignored() -> None:
    # A knob of another policy is set aside with a warning; speculation would change every
    # decode, so it is an error naming the policies that model it.
    spec = {"method": "eagle", "num_speculative_tokens": 2, "acceptance_length": 2}
    with pytest.raises(ConfigError, match="w.yaml: field 'policy.speculative': .*vllm_v1.*sglang, not tgi"):
        policy_config({"kind": "tgi", "speculative": spec}, "w.yaml")


def test_async_verify_timeline_by_hand() -> None:
    # Async scheduling (the pipelined loop), EAGLE k = 2, every step 10 ms (the proposer is
    # free on this profile: no per-token cost), each verify step accepting 1. r0: prompt 4,
    # output 5.
    # t=0:  S1 = the prompt (4 @ 0); S2 chosen at once with S1 in flight: 4 computed + 1
    #       placeholder, 2 placeholder drafts: 4 + 2 + 1 - 4 = 3 tokens @ 4 (2 drafts).
    # t=10: S1's token 1. S3 chosen with S2 in flight (3 tokens: 7 computed, 1 + 2
    #       placeholders): 5 + 2 + 3 - 7 = 3 @ 7.
    # t=20: S2 accepts 1: tokens 2, 3; computed 4 + 3 - 1 = 6. S4: 7 + 2 + 3 - 9 = 3 @ 9.
    # t=30: S3 accepts 1: tokens 4, 5 (its last): r0 finishes; S4 runs on, thrown away, to 40.
    env = simpy.Environment()
    step = linear_profile(per_token_s=0.0, overhead_s=0.010, decode_per_ctx_s=0.0, prefill_per_ctx_s=0.0)
    policy = make_policy(VllmV1Config(max_num_seqs=8, max_num_batched_tokens=64, enable_prefix_caching=False,
                                      async_scheduling=True, speculative={"method": "eagle", "num_speculative_tokens": 2,
                                                                          "acceptance_length": 2.0}), 1024)
    state = policy_state(policy, 100, 4, 1024)
    state.speculation = Speculation(policy.speculative, accept=lambda rid, out, d: 1)
    server = Server(env, policy, state, SimExecutor(step))
    r = Request(0, 0.0, 4, 5)
    env.process(feed(env, [server], [r], [5]))
    env.run()
    ids, times = state.tokens.arrays()
    assert np.allclose(times * 1e3, [10, 20, 20, 30, 30])
    assert r.finished_s * 1e3 == pytest.approx(30)
    starts = [round(t * 1e3, 6) for chunk, *_ in server.log.chunks() for t in chunk]
    assert starts == [0, 10, 20, 30]
    assert env.now * 1e3 == pytest.approx(40)          # S4's slot ran to its end


def test_ngram_match_rate_drafts_that_share_of_steps() -> None:
    """n-gram with ngram_match_rate 0.5: a request that sampled gets k drafts in half its steps
    (its lookup found a match) and none in the others (a plain decode, no verify counted).
    One request of 1,001 output tokens, k = 2, every draft rejected: 1,000 decode steps after
    the first, about 500 of them verifying (binomial std ~16: 80 is 5 of them)."""
    server, (r,) = _run([(0.0, 8, 1001)], {**NGRAM, "ngram_match_rate": 0.5}, accept=lambda rid, out, d: 0,
                        num_blocks=400)
    spec = server.state.speculation
    assert r.num_output_tokens == 1001 and abs(spec.num_drafts - 500) < 80
    assert spec.num_draft_tokens == 2 * spec.num_drafts
    with pytest.raises(ConfigError, match="ngram_match_rate' applies to method ngram only"):
        parse_speculative({"method": "eagle", "num_speculative_tokens": 2, "acceptance_length": 2,
                           "ngram_match_rate": 0.5}, "w.yaml")


def test_an_eagle_or_mtp_proposer_takes_its_weights_and_kv_layers_from_the_pool() -> None:
    from types import SimpleNamespace

    from sim.core.speculative import SpeculativeSpec
    from sim.cost.shape import ModelShape
    from sim.run.runner import drafter_share
    # 4 layers of hidden 1024, 8 heads of 128 (8 KV heads), MLP 4096, vocabulary 1000, untied: attention
    # 4 x 1024 x 1024 = 4,194,304 and MLP 3 x 1024 x 4096 = 12,582,912 a layer, embedding and LM head
    # 2 x 1000 x 1024 = 2,048,000: 69,156,864 weights, 138,313,728 B in bf16, of which the layers' are
    # 2 x (69,156,864 - 2,048,000) = 134,217,728 B, 33,554,432 a layer; KV 2 x 4 x 8 x 128 x 2 = 16,384 B.
    m = ModelShape("t", 1024, 4, 8, 8, 4096, 1000, 4096)
    profile = SimpleNamespace(model=m, kv_bytes_per_token=16_384, weight_bytes=138_313_728)
    mtp = SpeculativeSpec("mtp", 3, (0.8, 0.8, 0.8), 2.95, draft_layers=1)
    # 10,000 tokens = 163,840,000 B; less one layer's weights, 130,285,568 B, cached in 5 layers, not 4:
    # 130,285,568 x 4 / (5 x 16,384) = 6,361.6 -> 6,361 tokens
    assert drafter_share(10_000, profile, mtp) == 6_361
    ngram = SpeculativeSpec("ngram", 3, (0.8, 0.8, 0.8), 2.95)
    assert drafter_share(10_000, profile, ngram) == 10_000 == drafter_share(10_000, profile, None)

"""Speculative decoding in the sglang policy (rule 8 of policies/sglang.py), by hand: the KV a
decode step tops up (2 (k + 1) slots past the committed tokens), the verify items' query
tokens, the tokens a fixed acceptance gives, a retraction that only speculation causes, the
defaults SGLang changes, the refusals, and a whole run's counters.

The scenarios run SGLang's synchronous loop (enable_overlap false, SGLang's
--disable-overlap-schedule: its synchronous spec v2), committing each step before the next,
except the overlap ones, which put a batch in flight by hand (``state.pending``) and commit it
with ``SchedulerState.commit_overlap`` after the next is chosen, as event_loop_overlap does.
"""

from __future__ import annotations

import pytest

from policies import make_policy
from policies.config import policy_config
from policies.sglang import SglangConfig, SglangPolicy
from sim.base.strict import ConfigError
from sim.core.batch import Batch, BatchItem, Idle
from sim.core.policy import PolicyContext
from sim.core.radix import RadixCachePool
from sim.core.request import Request
from sim.core.speculative import Speculation
from sim.core.state import SchedulerState

EAGLE3 = {"method": "eagle", "num_speculative_tokens": 3, "acceptance_length": 2.0}
GPU = PolicyContext(4096, "h100-sxm", 80 << 30)


def make(num_tokens: int = 1000, page: int = 1, spec: dict = EAGLE3, accept=lambda rid, out, d: 1, **knobs):
    knobs.setdefault("enable_overlap", False)
    policy = SglangPolicy(SglangConfig(page_size=page, speculative=spec, **knobs), PolicyContext(4096))
    state = SchedulerState(RadixCachePool(num_tokens // page, page), 4096)
    state.speculation = Speculation(policy.speculative, accept=accept)
    return state, policy


def add(state, i, prompt, output, max_tokens=None) -> Request:
    r = Request(i, 0.0, prompt, max_tokens if max_tokens is not None else output)
    assert state.add_arrival(r, output, 0.0)
    return r


def step(state, policy, t):
    batch = policy.schedule(state, t)
    state.commit(batch, t + 1.0)
    return batch


@pytest.mark.parametrize("page", [1, 4])
def test_a_decode_step_tops_its_kv_up_to_committed_plus_two_verify_widths(page):
    state, policy = make(page=page)
    r = add(state, 0, 10, 7)
    # prefill: 10 tokens, one item, no drafts; one token out. SGLang's draft extend drafts k = 3.
    b = step(state, policy, 0.0)
    assert b.items == (BatchItem(0, 10, 0),) and b.drafts is None
    assert len(r.block_ids) == -(-10 // page)                 # page 1: 10 slots; page 4: 3 pages (12)
    assert state.speculation.drafts == {0: 3}
    # decode 1: committed 10 (prompt + 1 output - 1); reserve 2 x max(3 x 1, 3 + 1) = 8: its KV
    # grows to 10 + 8 = 18 slots (page 4: ceil(18 / 4) = 5 pages = 20 slots, 2 pages more).
    # The verify item: the last token and 3 drafts, 4 query tokens over the 10 committed.
    b = step(state, policy, 1.0)
    assert b.items == (BatchItem(0, 4, 10),) and b.drafts == {0: 3}
    assert len(r.block_ids) * page == (18 if page == 1 else 20)
    # a = 1 accepted: 1 draft + the bonus token, outputs 1 -> 3; committed 10 + 1 + 1 = 12
    # (the 2 rejected drafts' slots stay allocated: 18 > 12)
    assert (r.num_output_tokens, r.num_computed_tokens) == (3, 12)
    # decode 2: 12 + 8 = 20 slots, 2 more (page 4: 20 is 5 pages, none more)
    b = step(state, policy, 2.0)
    assert b.items == (BatchItem(0, 4, 12),)
    assert len(r.block_ids) * page == 20
    step(state, policy, 3.0)                                    # outputs 5 -> 7: done
    assert r.num_output_tokens == 7 and not state.running
    # released: its committed 16 (10 + 7 - 1) tokens into the tree (whole pages), the
    # over-allocation freed
    assert state.kv.num_free_tokens == 1000 - 16 // page * page


def test_accepted_tokens_per_step_under_a_fixed_acceptance_and_the_counters():
    # k = 3, every verify step accepts 2: 3 tokens a step. Output 8: the prefill gives 1, then
    # 3, 3, and the last step's 3 trimmed to the 1 left (outputs 1, 4, 7, 8).
    state, policy = make(accept=lambda rid, out, d: 2)
    r = add(state, 0, 5, 8)
    outs = []
    for t in range(4):
        step(state, policy, float(t))
        outs.append(r.num_output_tokens)
    assert outs == [1, 4, 7, 8]
    s = state.speculation.summary()
    # 3 verify steps of 3 drafts; 2 accepted each (positions 1 and 2): 6 of 9
    assert (s["num_drafts"], s["num_draft_tokens"], s["num_accepted_tokens"]) == (3, 9, 6)
    assert s["num_accepted_tokens_per_pos"] == [3, 3, 0]
    assert s["mean_acceptance_length"] == 3.0 and s["acceptance_rate"] == pytest.approx(2 / 3)


def test_the_verify_step_carries_k_plus_one_query_tokens_a_request():
    state, policy = make(spec={"method": "mtp", "num_speculative_tokens": 2, "acceptance_length": 1.5})
    add(state, 0, 30, 20)
    add(state, 1, 50, 20)
    step(state, policy, 0.0)                                    # both prefilled in one batch
    b = policy.schedule(state, 1.0)
    # 2 requests x (1 + 2) = 6 query tokens, each a decode over its context (30 and 50), 2 drafts each
    assert isinstance(b, Batch)
    assert (b.num_tokens, b.decode_seqs, b.decode_context, b.num_spec_tokens) == (6, 2, 80, 4)
    assert b.num_prefill_seqs == 0


def test_a_retraction_that_only_the_speculative_reserve_causes():
    # Pool 54, k = 3 (reserve 8). A and B: prompt 20, max_tokens 4. Admission: A needs
    # 20 + 4 + 1 = 25 < 54; the offset is then 25, B needs 25 < 54 - 25 = 29: both prefilled,
    # 40 slots used, 14 free. Without speculation the decode needs 1 + 1 = 2 <= 14; with it
    # 2 x (20 + 8 - 20) = 16 > 14 (nothing evictable: both prompts are locked): B (equal outputs
    # and prompts: the later one) is retracted, its prompt unlocked and evicted (20 x 1 request
    # left), 34 free, and A's 8 fit.
    state, policy = make(num_tokens=54)
    a, b_ = add(state, 0, 20, 4), add(state, 1, 20, 4)
    assert step(state, policy, 0.0).items == (BatchItem(0, 20, 0), BatchItem(1, 20, 0))
    assert state.kv.num_free_tokens == 14
    b = step(state, policy, 1.0)
    assert b.items == (BatchItem(0, 4, 20),) and b.drafts == {0: 3}
    assert list(state.waiting) == [b_] and b_.num_preemptions == 1
    assert state.speculation.drafts.get(1) is None             # its drafts went with its KV
    # new_token_ratio after it: min(1, (A's 1 output + 20) / (4 + 1)) = 1
    assert policy.new_token_ratio == 1.0
    assert len(a.block_ids) == 28 and state.kv.num_free_tokens == 54 - 28
    # the same pool without speculation decodes both
    plain = SglangPolicy(SglangConfig(enable_overlap=False), PolicyContext(4096))
    st = SchedulerState(RadixCachePool(54, 1), 4096)
    add(st, 0, 20, 4), add(st, 1, 20, 4)
    step(st, plain, 0.0)
    assert step(st, plain, 1.0).items == (BatchItem(0, 1, 20), BatchItem(1, 1, 20))


def test_sglang_defaults_with_speculation():
    # _handle_eagle_family: max_running_requests 48 when unset (a given one stays); the memory
    # defaults were resolved before it; on a CPU the overlap loop is off.
    cpu = PolicyContext(4096, "cpu")
    p = make_policy(SglangConfig(speculative=EAGLE3), cpu)
    assert p.max_num_seqs == 48 and not p.pipelined and p.speculative.num_speculative_tokens == 3
    assert p.knobs()["enable_overlap"] is False and p.knobs()["max_running_requests"] == 48
    assert make_policy(SglangConfig(speculative=EAGLE3, max_running_requests=7), cpu).max_num_seqs == 7
    plain = make_policy(SglangConfig(enable_overlap=False), GPU)
    spec = make_policy(SglangConfig(enable_overlap=False, speculative=EAGLE3), GPU)
    assert spec.mem_fraction == plain.mem_fraction and spec.chunk_size == plain.chunk_size
    # k = 0: no speculation, the plain policy (a sweep's baseline)
    off = make_policy(SglangConfig(speculative={"num_speculative_tokens": 0}), GPU)
    assert off.speculative is None and off.pipelined and off.max_num_seqs == 4096
    # eagle_topk 1 is SGLang's chain, accepted
    assert make_policy(SglangConfig(enable_overlap=False, speculative={**EAGLE3, "eagle_topk": 1}),
                       GPU).speculative.num_speculative_tokens == 3


@pytest.mark.parametrize("spec, field", [
    ({**EAGLE3, "eagle_topk": 4}, "policy.speculative.eagle_topk"),
    ({"method": "ngram", "num_speculative_tokens": 3, "acceptance_length": 2}, "policy.speculative.method"),
    ({"method": "draft_model", "num_speculative_tokens": 3, "acceptance_length": 2}, "policy.speculative.method"),
    ({**EAGLE3, "acceptance_length": 9}, "policy.speculative.acceptance_length"),
    ({**EAGLE3, "ngram_match_rate": 0.5}, "policy.speculative.ngram_match_rate"),
])
def test_what_sglang_refuses_or_batchsim_does_not_model_names_its_field(spec, field):
    with pytest.raises(ConfigError, match=f"w.yaml: field '{field}'"):
        policy_config({"kind": "sglang", "speculative": spec}, "w.yaml")


def test_mixed_chunks_with_speculation_are_refused_and_the_overlap_loop_stays_on_a_gpu():
    with pytest.raises(ValueError, match="policy.enable_mixed_chunk true with policy.speculative"):
        make_policy(SglangConfig(speculative=EAGLE3, enable_mixed_chunk=True), GPU)
    p = make_policy(SglangConfig(speculative=EAGLE3), GPU)       # spec v2 keeps event_loop_overlap
    assert p.pipelined and p.overlap_loop and p.knobs()["enable_overlap"] is True


def _overlap(num_tokens=1000, accept=lambda rid, out, d: 1):
    state, policy = make(num_tokens=num_tokens, accept=accept, enable_overlap=True)
    assert policy.pipelined and policy.overlap_loop
    return state, policy


def _launch(state, policy, t):
    """Choose a batch with the one before it in flight, as event_loop_overlap does."""
    batch = policy.schedule(state, t)
    state.pending.append(batch)
    return batch


def test_overlap_verify_chosen_while_the_one_before_runs_by_hand():
    # k = 3 (reserve 8), every verify accepts 1: 2 tokens a verify. Prompt 10, output 7.
    state, policy = _overlap()
    r = add(state, 0, 10, 7)
    b1 = _launch(state, policy, 0.0)                            # the prefill, 10 tokens
    assert b1.items == (BatchItem(0, 10, 0),)
    # B2, with B1 in flight: r is merged into the running batch; a prefill's tokens are
    # committed when it is chosen (kv_committed_len 10), so its KV tops up to 10 + 8 = 18 and the
    # verify sits over its 10 tokens (its bonus token, B1's, resolved on the device).
    b2 = _launch(state, policy, 0.0)
    assert b2.items == (BatchItem(0, 4, 10),) and b2.drafts == {0: 3}
    assert len(r.block_ids) == 18
    state.commit_overlap(b1, 1.0)                               # token 1
    # B3, with B2 in flight: committed is still 10 (a verify commits at its results), so
    # 10 + 8 = 18 asks for no page more: the double buffer holds B2's 4 tokens and B3's.
    b3 = _launch(state, policy, 1.0)
    assert b3.items == (BatchItem(0, 4, 10),) and len(r.block_ids) == 18
    state.commit_overlap(b2, 2.0)                               # accepts 1: tokens 2, 3; committed 12
    assert (r.num_output_tokens, r.num_computed_tokens) == (3, 12)
    b4 = _launch(state, policy, 2.0)                            # over 12: tops up to 20
    assert b4.items == (BatchItem(0, 4, 12),) and len(r.block_ids) == 20
    state.commit_overlap(b3, 3.0)                               # tokens 4, 5; committed 14
    # B5 keeps r: its next output is not its last by length (5 + 1 < 7), though B4 may end it
    b5 = _launch(state, policy, 3.0)
    assert b5.items == (BatchItem(0, 4, 14),)
    state.commit_overlap(b4, 4.0)                               # tokens 6, 7: done
    assert r.num_output_tokens == 7 and not state.running
    state.commit_overlap(b5, 5.0)                               # its item thrown away, uncounted
    assert state.speculation.summary()["num_drafts"] == 3
    # its release: committed 16 tokens into the tree, B5's over-allocation freed
    assert state.kv.num_free_tokens == 1000 - 16


def test_overlap_request_whose_verify_in_flight_yields_its_last_token_sits_out():
    # max_tokens 2: after the prefill (1 output), the verify in flight (B2) gives at least 1 more,
    # its last: _reqs_finishing_inflight leaves it out of B3, and nothing else decodes.
    state, policy = _overlap(accept=lambda rid, out, d: 0)
    r = add(state, 0, 10, 2)
    b1 = _launch(state, policy, 0.0)
    b2 = _launch(state, policy, 0.0)
    state.commit_overlap(b1, 1.0)
    assert r.num_output_tokens == 1
    b3 = policy.schedule(state, 1.0)
    assert isinstance(b3, Idle)
    state.commit_overlap(b2, 2.0)
    assert r.num_output_tokens == 2 and not state.running


@pytest.mark.parametrize("overlap", [False, True])
def test_a_whole_run_reports_the_spec_decode_counters(overlap):
    """Through the runner: the proposer's weights and KV out of the pool, the summary's
    counters, and the drawn acceptance near the model's mean (2.5 of k = 3)."""
    from conftest import WORKLOADS
    from sim.run.config import load_workload
    from sim.run.runner import run_workload
    cfg = load_workload(WORKLOADS / "sharegpt_poisson.yaml", {
        "num_requests": 60, "profile": {"model": "llama-3.1-8b", "gpu": "h100-sxm"},
        "policy": {"kind": "sglang", "enable_overlap": overlap,
                   "speculative": {"method": "eagle3", "num_speculative_tokens": 3, "acceptance_length": 2.5}}})
    s = run_workload(cfg).summary
    assert s["completed"] == 60
    assert s["spec_decode_mean_acceptance_length"] == pytest.approx(2.5, abs=0.05)
    assert s["spec_decode_num_draft_tokens"] == 3 * s["spec_decode_num_drafts"]   # SGLang never cuts drafts
    # every output token but each request's first comes from a verify step, less what a
    # request's last verify step accepted past its end (at most k = 3 a request)
    past_end = s["spec_decode_num_accepted_tokens"] + s["spec_decode_num_drafts"] - (s["total_output_tokens"] - 60)
    assert 0 <= past_end <= 3 * 60

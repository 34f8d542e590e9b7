"""Speculative decoding in the tensorrt_llm policy (rule 7 of policies/tensorrt_llm.py), by hand:
the micro batch scheduler's tokens with k drafts a generation request, the KV a step allocates
(1 + k slots, the one-model drafter's k - 1 extra slots with the first chunk) and the blocks the
rewind of rejected drafts gives back, GUARANTEED_NO_EVICT and MAX_UTILIZATION admission with
drafts, the refusals, and a whole run's counters.

Every scenario runs the synchronous executor loop (disable_overlap_scheduler true, which rule 7
requires), committing each step before the next, with a fixed acceptance (``Speculation``'s
``accept``), 4-token blocks and no block reuse unless said.
"""

from __future__ import annotations

import pytest

from policies.config import policy_config
from policies.tensorrt_llm import TensorRtLlmConfig, TensorRtLlmPolicy
from sim.base.strict import ConfigError
from sim.core.batch import BatchItem
from sim.core.kv import BlockManager
from sim.core.policy import PolicyContext, PolicyError
from sim.core.prefix import PrefixCachePool
from sim.core.request import Request
from sim.core.speculative import Speculation
from sim.core.state import SchedulerState

MTP = {"method": "mtp", "num_speculative_tokens": 3, "acceptance_length": 2.0}
CTX = PolicyContext(4096)


def make(num_blocks: int = 100, spec: dict | None = MTP, accept=lambda rid, out, d: 1, reuse: bool = False,
         **knobs):
    knobs.setdefault("disable_overlap_scheduler", True)
    policy = TensorRtLlmPolicy(TensorRtLlmConfig(tokens_per_block=4, enable_block_reuse=reuse, speculative=spec,
                                                 **knobs), CTX)
    pool = (PrefixCachePool if reuse else BlockManager)(num_blocks, 4)
    state = SchedulerState(pool, 4096)
    if policy.speculative is not None:
        state.speculation = Speculation(policy.speculative, accept=accept)
    return state, policy


def add(state, i, prompt, output) -> Request:
    r = Request(i, 0.0, prompt, output)
    assert state.add_arrival(r, output, 0.0)
    return r


def step(state, policy, t):
    batch = policy.schedule(state, t)
    state.commit(batch, t + 1.0)
    return batch


def accepts(*counts):
    it = iter(counts)
    return lambda rid, out, d: next(it)


@pytest.mark.parametrize("reuse", [False, True])
def test_blocks_allocated_per_step_and_freed_by_the_rewind(reuse):
    # k = 3 (MTP's num_nextn_predict_layers), extra KV slots k - 1 = 2; prompt 10, max_tokens 7.
    state, policy = make(accept=accepts(2, 0, 1), reuse=reuse)
    r = add(state, 0, 10, 7)
    # step 1, the context: 10 tokens (no drafts for a context request); its KV sequence is the
    # prompt plus 2 extra slots: 12 tokens = 3 blocks
    b = step(state, policy, 0.0)
    assert b.items == (BatchItem(0, 10, 0),) and b.drafts is None
    assert len(r.block_ids) == 3
    assert (r.num_output_tokens, r.num_computed_tokens) == (1, 10)
    # step 2, a generation step: its token and 3 placeholder drafts, 4 tokens over 10 computed;
    # KV 10 + 2 + 4 = 16 tokens = 4 blocks. Accepts 2: outputs 1 + 3 = 4, computed 10 + 1 + 2 = 13
    b = step(state, policy, 1.0)
    assert b.items == (BatchItem(0, 4, 10),) and b.drafts == {0: 3}
    assert len(r.block_ids) == 4
    assert (r.num_output_tokens, r.num_computed_tokens) == (4, 13)
    # step 3: the rewind of its 1 rejected draft leaves 13 + 2 = 15 tokens (4 blocks); the step
    # adds 4: 19 tokens = 5 blocks. Accepts 0: outputs 5, computed 14
    b = step(state, policy, 2.0)
    assert b.items == (BatchItem(0, 4, 13),) and b.drafts == {0: 3}
    assert len(r.block_ids) == 5
    assert (r.num_output_tokens, r.num_computed_tokens) == (5, 14)
    # the next pass first rewinds the 3 rejected drafts: 14 + 2 = 16 tokens, 4 blocks: one given back
    free = state.kv.num_free_blocks
    policy._rewind(state)
    assert len(r.block_ids) == 4 and state.kv.num_free_blocks == free + 1
    # step 4: 16 + 4 = 20 tokens, 5 blocks again. Accepts 1: 2 tokens, outputs 7: done, all freed
    b = step(state, policy, 3.0)
    assert b.items == (BatchItem(0, 4, 14),)
    assert r.num_output_tokens == 7 and not state.running
    assert state.kv.num_free_blocks == 100
    # the counters: 3 verify steps of 3 drafts, 2 + 0 + 1 accepted (position 1 twice, position 2 once)
    s = state.speculation.summary()
    assert (s["num_drafts"], s["num_draft_tokens"], s["num_accepted_tokens"]) == (3, 9, 3)
    assert s["num_accepted_tokens_per_pos"] == [2, 1, 0]


@pytest.mark.parametrize("spec, decoded", [(None, [0, 1, 2]), (MTP, [0, 1])])
def test_a_generation_request_takes_one_plus_k_tokens_of_max_num_tokens(spec, decoded):
    # max_num_tokens 10; three prompts of 3 tokens: one context step of 9 tokens (contexts take no
    # drafts). Then without speculation each decode takes 1 token (3 of 10); with k = 3 each takes
    # 4: 4 + 4 = 8, the third would make 12 > 10 and ends the list.
    state, policy = make(spec=spec, max_num_tokens=10)
    for i in range(3):
        add(state, i, 3, 5)
    b = step(state, policy, 0.0)
    assert b.items == tuple(BatchItem(i, 3, 0) for i in range(3))
    b = policy.schedule(state, 1.0)
    assert [it.req_id for it in b.items] == decoded
    assert sum(it.num_new_tokens for it in b.items) == (3 if spec is None else 8)
    assert b.drafts == (None if spec is None else {0: 3, 1: 3})


def test_a_context_request_counts_its_prompt_only():
    # max_num_tokens 10: a generation request takes 1 + 3 = 4, a waiting prompt of 6 the 6 left
    # (were its drafts counted, 6 + 3 = 9 > 6 would end the list)
    state, policy = make(max_num_tokens=10)
    add(state, 0, 3, 5)
    step(state, policy, 0.0)
    add(state, 1, 6, 5)
    b = policy.schedule(state, 1.0)
    assert b.items == (BatchItem(0, 4, 3), BatchItem(1, 6, 0)) and b.drafts == {0: 3}


def test_guaranteed_no_evict_reserves_no_draft_slots():
    # A: prompt 8, max_tokens 4: to completion 12 tokens = 3 blocks; its context takes 8 + 2 extra
    # = 10 tokens = 3 blocks, all of them (it reserves 0 more). Pool 7: 4 free.
    state, policy = make(num_blocks=7, accept=accepts(0, 0, 0, 0))
    a = add(state, 0, 8, 4)
    step(state, policy, 0.0)
    assert len(a.block_ids) == 3 and state.kv.num_free_blocks == 4
    # B (the same) needs 3 blocks to completion <= 4 - 0: admitted beside A's generation step,
    # though A's step then takes 10 + 4 = 14 tokens = 4 blocks, one past its reservation, and B's
    # context 3: the pool is full
    b_req = add(state, 1, 8, 4)
    b = step(state, policy, 1.0)
    assert b.items == (BatchItem(0, 4, 8), BatchItem(1, 8, 0)) and b.drafts == {0: 3}
    assert (len(a.block_ids), len(b_req.block_ids), state.kv.num_free_blocks) == (4, 3, 0)


def test_guaranteed_no_evict_runs_dry_on_draft_slots_it_did_not_reserve():
    # The same with a pool of 6: B's 3 blocks to completion fit the 3 free, A's draft slots take
    # one of them, and B's context finds the pool dry (TensorRT-LLM's KV manager fails too).
    state, policy = make(num_blocks=6)
    add(state, 0, 8, 4)
    step(state, policy, 0.0)
    add(state, 1, 8, 4)
    with pytest.raises(PolicyError, match="request 1 has no KV blocks for its context"):
        policy.schedule(state, 1.0)


@pytest.mark.parametrize("spec, admitted", [(None, [0, 1]), (MTP, [0])])
def test_max_utilization_counts_a_generation_steps_draft_slots(spec, admitted):
    # Pool 5; A: prompt 8, max_tokens 8. Without speculation its context holds 8 tokens (2 blocks,
    # 3 free) and its next step 1 block (its blocks are full); B waiting, its 8 known tokens 2:
    # 1 + 2 <= 3, both run. With k = 3: A holds 8 + 2 = 10 tokens (3 blocks, 2 free) and its next
    # step adds min(1 + 3, 8 - 2) = 4 slots, 14 tokens = 4 blocks: 1 more; 1 + 2 > 2: B waits.
    state, policy = make(num_blocks=5, spec=spec, capacity_scheduler_policy="MAX_UTILIZATION")
    add(state, 0, 8, 8)
    step(state, policy, 0.0)
    add(state, 1, 8, 8)
    b = policy.schedule(state, 1.0)
    assert [it.req_id for it in b.items] == admitted
    assert not state.num_preemptions


def test_refused_with_the_overlap_scheduler_on():
    with pytest.raises(ValueError, match="disable_overlap_scheduler: true"):
        TensorRtLlmPolicy(TensorRtLlmConfig(speculative=MTP), CTX)
    # k = 0 is no speculation (a sweep's baseline): the overlap scheduler stays on
    p = TensorRtLlmPolicy(TensorRtLlmConfig(speculative={"num_speculative_tokens": 0}), CTX)
    assert p.speculative is None and p.pipelined


@pytest.mark.parametrize("method, words", [("ngram", "NGram drafter"), ("draft_model", "separate draft model")])
def test_methods_not_modelled_are_refused(method, words):
    with pytest.raises(ConfigError, match=words):
        policy_config({"kind": "tensorrt_llm", "disable_overlap_scheduler": True,
                       "speculative": {"method": method, "num_speculative_tokens": 3, "acceptance_length": 2.0}},
                      "w.yaml")


@pytest.mark.parametrize("method", ["mtp", "eagle3", "eagle"])
def test_one_model_methods_are_taken(method):
    cfg = policy_config({"kind": "tensorrt_llm", "disable_overlap_scheduler": True,
                         "speculative": {"method": method, "num_speculative_tokens": 2, "acceptance_length": 2.0}},
                        "w.yaml")
    p = TensorRtLlmPolicy(cfg, CTX)
    assert (p.num_drafts, p.extra_kv, p.decode_stretch, p.pipelined) == (2, 1, False, False)


def test_a_whole_run_reports_the_spec_decode_counters():
    """Through the runner: the summary's counters, and the drawn acceptance near the model's mean
    (2.5 of k = 3)."""
    from conftest import WORKLOADS
    from sim.run.config import load_workload
    from sim.run.runner import run_workload
    spec = {"method": "eagle3", "num_speculative_tokens": 3, "acceptance_length": 2.5}
    cfg = load_workload(WORKLOADS / "sharegpt_poisson.yaml", {
        "num_requests": 60, "profile": {"model": "llama-3.1-8b", "gpu": "h100-sxm"},
        "policy": {"kind": "tensorrt_llm", "disable_overlap_scheduler": True, "speculative": spec}})
    s = run_workload(cfg).summary
    assert s["completed"] == 60
    assert s["spec_decode_mean_acceptance_length"] == pytest.approx(2.5, abs=0.05)
    assert s["spec_decode_num_draft_tokens"] == 3 * s["spec_decode_num_drafts"]   # k placeholders, never cut
    # every output token but each request's first comes from a verify step, less what a request's
    # last verify step accepted past its end (at most k = 3 a request)
    past_end = s["spec_decode_num_accepted_tokens"] + s["spec_decode_num_drafts"] - (s["total_output_tokens"] - 60)
    assert 0 <= past_end <= 3 * 60
    # the overlap scheduler on (the default): refused, naming the knob
    cfg = load_workload(WORKLOADS / "sharegpt_poisson.yaml", {
        "num_requests": 60, "profile": {"model": "llama-3.1-8b", "gpu": "h100-sxm"},
        "policy": {"kind": "tensorrt_llm", "speculative": spec}})
    with pytest.raises(ConfigError, match="disable_overlap_scheduler: true"):
        run_workload(cfg)


def test_chunked_prefill_sizes_chunks_after_the_verify_items():
    # max_num_tokens 16, chunked prefill: A's generation step takes 1 + 3 = 4, B's prompt of 20
    # the 12 left (FIRST_COME_FIRST_SERVED, whole 4-token units); B's first chunk takes its whole
    # prompt's KV plus the 2 extra slots: 22 tokens = 6 blocks
    state, policy = make(max_num_tokens=16, enable_chunked_prefill=True)
    add(state, 0, 4, 5)
    step(state, policy, 0.0)
    b_req = add(state, 1, 20, 5)
    b = policy.schedule(state, 1.0)
    assert b.items == (BatchItem(0, 4, 4), BatchItem(1, 12, 0)) and b.drafts == {0: 3}
    assert len(b_req.block_ids) == 6

"""vLLM (prefill-first) scheduling, with the token arithmetic in comments."""

from __future__ import annotations

from conftest import add, make_state

from sim.core.policy import PolicyContext
from policies.vllm import VllmConfig, VllmPolicy
from sim.core.batch import Batch, BatchItem, Idle
from sim.core.request import Status


def test_prefill_first_within_token_budget_then_decode_only():
    state = make_state()
    policy = VllmPolicy(VllmConfig(max_num_batched_tokens=400, max_num_seqs=8), PolicyContext(max_model_len=400))
    for i, p in enumerate((100, 200, 300)):
        add(state, i, p, 5)
    b = policy.schedule(state, 0.0)
    # 100 + 200 = 300 <= 400; + 300 = 600 > 400 -> request 2 waits.
    assert b.items == (BatchItem(0, 100, 0), BatchItem(1, 200, 0))
    state.commit(b, 1.0)
    # Request 2 still fits a prefill of its own: prefill-first, and never mixed with decodes.
    b = policy.schedule(state, 1.0)
    assert b.items == (BatchItem(2, 300, 0),)
    state.commit(b, 2.0)
    b = policy.schedule(state, 2.0)
    assert b.items == (BatchItem(0, 1, 100), BatchItem(1, 1, 200), BatchItem(2, 1, 300))
    assert b.num_prefill_tokens == 0 and b.decode_seqs == 3


def test_max_num_seqs_limits_admission():
    state = make_state()
    policy = VllmPolicy(VllmConfig(max_num_seqs=2), PolicyContext(max_model_len=4096))
    for i in range(3):
        add(state, i, 10, 5)
    b = policy.schedule(state, 0.0)
    assert [it.req_id for it in b.items] == [0, 1]
    assert len(state.waiting) == 1


def test_default_token_budget_is_max_of_context_and_2048():
    assert VllmPolicy(VllmConfig(), PolicyContext(max_model_len=1024)).token_budget == 2048
    assert VllmPolicy(VllmConfig(), PolicyContext(max_model_len=8192)).token_budget == 8192


def test_out_of_blocks_preempts_newest_by_recompute():
    # 4 blocks of 4 tokens. A and B: 4-token prompts, 10 outputs each.
    state = make_state(num_blocks=4, block_size=4)
    policy = VllmPolicy(VllmConfig(), PolicyContext(max_model_len=64))
    a = add(state, 0, 4, 10)
    b_ = add(state, 1, 4, 10)
    batch = policy.schedule(state, 0.0)            # prefill both: 1 block each, 2 free
    assert batch.items == (BatchItem(0, 4, 0), BatchItem(1, 4, 0))
    state.commit(batch, 1.0)                       # each: computed 4, 1 output token
    t = 1.0
    # Decodes at context 4..7 need a 2nd block each: 2 + 2 = 4 blocks, pool full.
    for ctx in range(4, 8):
        batch = policy.schedule(state, t)
        assert [it.context_len for it in batch.items] == [ctx, ctx]
        t += 1.0
        state.commit(batch, t)
    assert state.kv.num_free_blocks == 0
    # Context 8 needs a 3rd block each; none free -> the newest (B) is preempted,
    # its 2 blocks freed, and A decodes alone.
    batch = policy.schedule(state, t)
    assert batch.items == (BatchItem(0, 1, 8),)
    assert b_.status == Status.PREEMPTED and b_.num_preemptions == 1
    assert b_.num_computed_tokens == 0 and b_.block_ids == []
    assert state.waiting[0] is b_                  # back at the queue's front
    # B re-prefills prompt + its 5 outputs so far = 9 tokens when it fits again.
    assert b_.num_uncomputed_tokens == 4 + 5
    assert a.num_output_tokens == 5


def test_budget_below_max_model_len_is_refused_at_start_up():
    """vLLM v0 without chunked prefill refuses max_num_batched_tokens < max_model_len."""
    import pytest
    with pytest.raises(ValueError, match=r"max_num_batched_tokens \(512\) is smaller than max_model_len \(4096\)"):
        VllmPolicy(VllmConfig(max_num_batched_tokens=512), PolicyContext(max_model_len=4096))
    with pytest.raises(ValueError, match=r"must be >= max_num_seqs \(256\)"):
        VllmPolicy(VllmConfig(max_num_batched_tokens=128), PolicyContext(max_model_len=128))


def test_prompt_over_the_policy_limit_is_rejected_with_its_reason():
    state = make_state(max_prompt_tokens=512)
    from sim.core.request import Request
    r = Request(0, 0.0, 600, 10)
    assert not state.add_arrival(r, 10, 0.0)
    assert r.status == Status.REJECTED and r.reject_reason == "prompt_limit" and state.num_rejected == 1
    policy = VllmPolicy(VllmConfig(), PolicyContext(max_model_len=4096))
    assert isinstance(policy.schedule(state, 0.0), Idle)


def test_watermark_holds_back_new_admissions():
    # 100 blocks, watermark 0.1 -> 10 blocks stay free for running requests.
    state = make_state(num_blocks=100, block_size=16, watermark=0.1)
    policy = VllmPolicy(VllmConfig(), PolicyContext(max_model_len=4096))
    add(state, 0, 16 * 85, 5)                      # 85 blocks: 15 free >= 10 -> admitted
    add(state, 1, 16 * 6, 5)                       # 6 more -> 9 free < 10 -> waits
    b = policy.schedule(state, 0.0)
    assert [it.req_id for it in b.items] == [0]
    assert isinstance(b, Batch)

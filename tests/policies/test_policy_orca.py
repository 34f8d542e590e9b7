"""Orca: iteration-level, whole prompts join decode iterations, reserved memory."""

from __future__ import annotations

from conftest import add, make_state

from sim.core.policy import PolicyContext
from policies.orca import OrcaConfig, OrcaPolicy
from sim.core.batch import BatchItem
from sim.core.request import Status

CONTEXT = PolicyContext(max_model_len=1 << 16)        # make_state's default


def test_whole_prompts_join_decode_iterations():
    state = make_state()
    policy = OrcaPolicy(OrcaConfig(), CONTEXT)
    add(state, 0, 50, 3)
    b = policy.schedule(state, 0.0)
    assert b.items == (BatchItem(0, 50, 0),)
    state.commit(b, 1.0)
    add(state, 1, 700, 3, arrival_s=1.0)
    b = policy.schedule(state, 1.0)
    # hybrid: request 0 decodes while request 1's whole 700-token prompt runs
    assert b.items == (BatchItem(0, 1, 50), BatchItem(1, 700, 0))


def test_finished_request_leaves_and_waiting_joins_next_iteration():
    state = make_state()
    policy = OrcaPolicy(OrcaConfig(max_batch_size=1), CONTEXT)
    first = add(state, 0, 10, 2)
    add(state, 1, 10, 2)
    b = policy.schedule(state, 0.0)
    assert [it.req_id for it in b.items] == [0]
    state.commit(b, 1.0)                            # output 1 of 2
    state.commit(policy.schedule(state, 1.0), 2.0)  # output 2 of 2 -> finished
    assert first.status == Status.FINISHED
    assert 0 not in state.requests and len(state.records) == 1   # it left the requests in flight
    b = policy.schedule(state, 2.0)
    assert b.items == (BatchItem(1, 10, 0),)


def test_reservation_max_limits_concurrency():
    # 64 blocks x 16 = 1024 tokens; reserve=max with max_model_len 256 -> 4 at once.
    state = make_state(num_blocks=64, block_size=16, max_model_len=256)
    policy = OrcaPolicy(OrcaConfig(reserve="max"), PolicyContext(max_model_len=256))
    for i in range(10):
        add(state, i, 10, 5)
    b = policy.schedule(state, 0.0)
    assert len(b.items) == 1024 // 256 == 4
    assert state.kv.num_free_blocks == 0


def test_reservation_max_tokens_reserves_prompt_plus_max_tokens():
    state = make_state(num_blocks=100, block_size=16)
    policy = OrcaPolicy(OrcaConfig(), CONTEXT)
    r = add(state, 0, 100, 20, max_tokens=60)
    policy.schedule(state, 0.0)
    assert len(r.block_ids) == -(-(100 + 60) // 16) == 10


def test_pow2_and_oracle_use_true_length():
    # pow2 rounds the true output (20) up to 32: 100 + 32 = 132 tokens = 9 blocks.
    for reserve, expected_tokens in (("oracle", 100 + 20), ("pow2", 100 + 32)):
        state = make_state(num_blocks=100, block_size=16)
        r = add(state, 0, 100, 20, max_tokens=500)
        OrcaPolicy(OrcaConfig(reserve=reserve), CONTEXT).schedule(state, 0.0)
        assert len(r.block_ids) == -(-expected_tokens // 16)


def test_pow2_reserves_as_the_vllm_paper_does():
    """vLLM paper section 6.1: the output is rounded up to a power of two, the
    prompt is not. Prompt 100 + 5 outputs: 100 + 8 = 108; prompt 40 + 25
    outputs: 40 + 32 = 72; a single output token reserves 1 (2^0)."""
    from policies.base import reservation_tokens
    assert reservation_tokens("pow2", 100, 500, 5, 4096) == 108
    assert reservation_tokens("pow2", 40, 500, 25, 4096) == 72
    assert reservation_tokens("pow2", 40, 500, 32, 4096) == 72
    assert reservation_tokens("pow2", 40, 500, 33, 4096) == 40 + 64
    assert reservation_tokens("pow2", 7, 500, 1, 4096) == 8
    assert reservation_tokens("pow2", 4000, 500, 200, 4096) == 4096     # capped at max_model_len

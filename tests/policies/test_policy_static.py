"""Static batching: full batches, padded prompts, finished slots keep costing."""

from __future__ import annotations

from conftest import add, make_state, simulate

from sim.core.policy import PolicyContext
from policies.static import StaticConfig, StaticPolicy
from sim.core.batch import BatchItem, Idle
from sim.core.request import Status

CONTEXT = PolicyContext(max_model_len=1 << 16)        # make_state's default


def test_waits_for_a_full_batch_then_pads_prompts():
    state = make_state()
    policy = StaticPolicy(StaticConfig(batch_size=2), CONTEXT)
    r0 = add(state, 0, 10, 1)
    assert isinstance(policy.schedule(state, 0.0), Idle)    # 1 < 2 waiting
    r1 = add(state, 1, 30, 3)
    b = policy.schedule(state, 0.0)
    # both prompts padded to the longest: 10 + 20 pad, 30 + 0 pad
    assert b.items == (BatchItem(0, 10, 0, 20), BatchItem(1, 30, 0, 0))
    assert b.num_tokens == 60
    state.commit(b, 1.0)
    # request 0 wanted 1 output token: done, but its slot keeps burning a padded decode
    assert state.requests[0] is r0 and r0.status == Status.FINISHED    # still held by its group
    b = policy.schedule(state, 1.0)
    assert b.items == (BatchItem(0, 0, 10, 1), BatchItem(1, 1, 30))
    assert b.decode_seqs == 2 and b.num_decode_tokens == 1
    state.commit(b, 2.0)
    state.commit(policy.schedule(state, 2.0), 3.0)           # request 1: 3rd token
    # nothing returns until the longest finishes: both complete at t = 3
    assert r0.finished_s == r1.finished_s == 3.0
    assert r0.first_token_s == 1.0
    assert not state.requests and len(state.records) == 2
    assert not state.running and state.kv.num_used_blocks == 0


def test_nothing_joins_a_running_batch():
    state = make_state()
    policy = StaticPolicy(StaticConfig(batch_size=1), CONTEXT)
    add(state, 0, 10, 5)
    state.commit(policy.schedule(state, 0.0), 1.0)
    add(state, 1, 10, 5, arrival_s=1.0)
    b = policy.schedule(state, 1.0)
    assert [it.req_id for it in b.items] == [0]


def test_partial_batch_launches_once_arrivals_end():
    server, reqs = simulate([(0.0, 10, 3), (0.5, 10, 3), (1.0, 10, 3)], StaticConfig(batch_size=2))
    assert all(r.status == Status.FINISHED for r in reqs)
    # the third request ran alone after the first batch
    assert reqs[2].first_scheduled_s >= reqs[0].finished_s

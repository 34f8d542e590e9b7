"""Dynamic batching: launch when full OR when the oldest waited max_queue_delay_s."""

from __future__ import annotations

from conftest import add, make_state, simulate

from sim.core.policy import PolicyContext
from policies.dynamic import DynamicConfig, DynamicPolicy
from sim.core.batch import Idle

CONTEXT = PolicyContext(max_model_len=1 << 16)        # make_state's default


def test_idle_until_the_oldest_request_has_waited_the_delay():
    state = make_state()
    policy = DynamicPolicy(DynamicConfig(max_batch_size=4, max_queue_delay_s=0.5), CONTEXT)
    add(state, 0, 10, 2, arrival_s=1.0)
    d = policy.schedule(state, 1.2)
    assert isinstance(d, Idle) and d.wake_at_s == 1.0 + 0.5
    b = policy.schedule(state, 1.5)
    assert [it.req_id for it in b.items] == [0]


def test_full_batch_launches_immediately():
    state = make_state()
    policy = DynamicPolicy(DynamicConfig(max_batch_size=2, max_queue_delay_s=10.0), CONTEXT)
    add(state, 0, 10, 2)
    add(state, 1, 10, 2)
    assert len(policy.schedule(state, 0.0).items) == 2


def test_driver_wakes_at_the_deadline_without_new_arrivals():
    # one request at t=0, next at t=100: the batch must start at t=0.25, not 100.
    server, reqs = simulate([(0.0, 10, 2), (100.0, 10, 2)],
                            DynamicConfig(max_batch_size=8, max_queue_delay_s=0.25))
    assert reqs[0].first_scheduled_s == 0.25
    assert reqs[1].first_scheduled_s == 100.25

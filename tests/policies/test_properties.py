"""Invariants over random workloads, for every policy (hypothesis).

tokens conserved, KV never over capacity, every request finishes, timestamps ordered.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import HealthCheck, find, given, settings
from hypothesis import strategies as st

from cases import CASES, KINDS

from policies import POLICIES
from sim.core.request import Status

BLOCK = 8
MAX_MODEL_LEN = 512


# Knob ranges small enough to crowd the pool and the batch (tests/policies/cases.py); a knob not
# named there keeps its default.
RANGES = {kind: case.ranges for kind, case in CASES.items()}


def policy_configs():
    """A config of any policy of the table (``cases.KINDS``), its knobs drawn from ``RANGES``."""
    return st.sampled_from(KINDS).flatmap(
        lambda kind: st.builds(POLICIES[kind][0], **RANGES.get(kind, {})))


@pytest.mark.parametrize("kind", KINDS)
def test_every_registered_policy_is_drawn(kind):
    assert find(policy_configs(), lambda cfg: cfg.kind == kind).kind == kind


def test_ranges_name_registered_policies_and_their_knobs():
    for kind, ranges in RANGES.items():
        assert kind in POLICIES, kind
        assert set(ranges) <= {f.name for f in dataclasses.fields(POLICIES[kind][0])}, kind


workloads = st.lists(
    st.tuples(st.floats(0.0, 0.2), st.integers(1, 300), st.integers(1, 60)),
    min_size=1, max_size=25)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(policy_cfg=policy_configs(), raw=workloads, num_blocks=st.integers(MAX_MODEL_LEN // BLOCK, 200))
def test_invariants(policy_cfg, raw, num_blocks):
    t = 0.0
    specs = []
    for gap, p, o in raw:
        t += gap
        specs.append((t, min(p, 500), o))
    kv_seen = []

    def check_step(start_s, batch, result):
        state = server.state
        kv = state.kv
        assert 0 <= kv.num_used_blocks <= kv.num_blocks
        # Block ids (a paged pool's), or counts (SGLang's radix pool: block_ids = range(pages held));
        # these requests share no content, so no block is held twice either way.
        owned = [b for r in state.running for b in r.block_ids]
        assert len(owned) == kv.num_used_blocks, "block leaked"
        if type(kv) is BlockManager:
            assert len(owned) == len(set(owned)), "block owned twice"
            assert len(set(kv._free_ids)) == len(kv._free_ids)
        for r in state.running:                      # every computed token has a KV slot
            assert r.num_computed_tokens <= len(r.block_ids) * BLOCK
        kv_seen.append(kv.num_used_blocks)

    def on_step(start_s, batch, result):
        check_step(start_s, batch, result)

    import simpy

    from conftest import linear_profile, policy_state

    from policies import make_policy
    from sim.loop.server import Server, SimExecutor
    from sim.loop.feed import feed
    from sim.core.kv import BlockManager
    from sim.core.request import Request
    env = simpy.Environment()
    policy = make_policy(policy_cfg, MAX_MODEL_LEN)
    state = policy_state(policy, num_blocks, BLOCK, MAX_MODEL_LEN)     # the policy's own pool, as a run's
    server = Server(env, policy, state, SimExecutor(linear_profile()), on_step=on_step)
    reqs = [Request(i, a, p, o) for i, (a, p, o) in enumerate(specs)]
    env.process(feed(env, [server], reqs, [o for _, _, o in specs]))
    env.run()

    # every request finished or was rejected up front (too long for the context)
    for r, (_, p, o) in zip(reqs, specs):
        if p + o > MAX_MODEL_LEN or (policy.max_prompt_tokens is not None and p > policy.max_prompt_tokens):
            assert r.status == Status.REJECTED
            continue
        assert r.status == Status.FINISHED, (r, policy_cfg)
        assert r.num_output_tokens == o
        assert r.arrival_s <= r.first_scheduled_s <= r.first_token_s <= r.finished_s
        assert r.block_ids == []
    assert not state.running and not state.waiting
    assert state.kv.num_used_blocks == 0
    # token conservation: one logged token per output token, in time order per request
    ids, times = state.token_log()
    finished = [r for r in reqs if r.status == Status.FINISHED]
    assert len(ids) == sum(r.num_output_tokens for r in finished)
    assert np.all(np.diff(times) >= 0)
    for r in finished:
        t_r = times[ids == r.req_id]
        assert t_r[0] == r.first_token_s and t_r[-1] == r.last_token_s
    # computed tokens: prompt + output - 1 each, plus what preemption made recompute
    log = server.log
    total_new = sum(np.frombuffer(log.ints, dtype=np.int64).reshape(-1, 8)[:, 1:3].sum(axis=1))
    expected = sum(r.num_prompt_tokens + r.num_output_tokens - 1 for r in finished)
    assert total_new >= expected
    if state.num_preemptions == 0:
        assert total_new == expected

"""Token ids of replayed prompts from their contents (``calibrate.serving.content``)."""

from __future__ import annotations

import numpy as np
import pytest

from calibrate.serving.content import ReplayPlan, allowed_ids, token_ids
from workloads.generate import Contents

ALLOWED = allowed_ids(4096, (0, 1, 2))


def test_equal_pairs_are_equal_ids_wherever_they_sit():
    a = token_ids(7, np.arange(10), ALLOWED, salt=5)
    assert a.tolist() == token_ids(7, np.arange(10), ALLOWED, salt=5).tolist()      # a function of its input
    assert a[4:].tolist() == token_ids(7, np.arange(4, 10), ALLOWED, salt=5).tolist()  # offset, not position
    assert a.tolist() != token_ids(8, np.arange(10), ALLOWED, salt=5).tolist()        # another key
    assert a.tolist() != token_ids(7, np.arange(10), ALLOWED, salt=6).tolist()        # another replay
    many = token_ids(1 << 61, np.arange(20_000), ALLOWED, salt=0)                     # keys of any int64 size
    assert many.min() >= 3 and many.max() < 4096 and len(set(many.tolist())) > 3500  # specials left out
    assert allowed_ids(5, (0, 1, 2, 9)).tolist() == [3, 4]
    with pytest.raises(ValueError, match="whole vocabulary"):
        allowed_ids(3, (0, 1, 2))


def test_plan_shares_runs_and_takes_the_servers_ids_for_an_earlier_output():
    # r0: 5 tokens of key 1, output key 100; r1 (a next turn): 3 tokens of key 1, r0's first 4
    # outputs (key 100), 2 tokens of key 2
    plan = ReplayPlan.build([(100, 1, 5), (101, 1, 3, 100, 4, 2, 2)], 4096, salt=9, avoid=(0, 1, 2))
    assert plan.waits_for == [[], [0]] and plan.wants_ids == [True, False] and plan.fallbacks == []
    p0 = plan.prompt(0)
    own = token_ids(2, np.arange(2), plan.allowed, 9).tolist()
    assert plan.prompt(1, [[7, 8, 9, 10, 11], None]) == p0[:3] + [7, 8, 9, 10] + own
    # the server returned 2 of the 4: the simulator's ids (key 100, offsets 2, 3) stand in, said once
    sim_ids = token_ids(100, np.arange(4), plan.allowed, 9).tolist()
    assert plan.prompt(1, [[7, 8], None]) == p0[:3] + [7, 8] + sim_ids[2:] + own
    assert len(plan.fallbacks) == 1 and "returned 2 of the 4 output ids of request 0" in plan.fallbacks[0]
    assert plan.prompt(1) == p0[:3] + sim_ids + own           # nothing known: all the simulator's


def test_plan_of_a_later_output_and_of_requests_without_contents():
    later = ReplayPlan.build([(100, 101, 4), (101, 1, 2)], 4096, salt=1)
    assert later.waits_for == [[], []] and later.wants_ids == [False, False]
    assert "request 0 holds the output of request 1, which is not sent before it" in later.fallbacks[0]
    bare = ReplayPlan.of_requests(None, [6, 6], 4096, salt=1)   # each prompt a run of its own
    assert bare.waits_for == [[], []] and len(bare.prompt(0)) == 6 and bare.prompt(0) != bare.prompt(1)
    contents = Contents(np.array([1, 2, 1], np.int64), np.array([4, 2, 4], np.int64),
                        np.array([0, 2, 3], np.int64), np.array([10, 11], np.int64))
    plan = ReplayPlan.of_requests(contents, [6, 4], 4096, salt=1)
    assert plan.prompt(0)[:4] == plan.prompt(1) and len(plan.prompt(0)) == 6

"""The prefix_aware router (sim.loop.feed.pick_replica) on cases worked out by hand."""

from __future__ import annotations

from dataclasses import dataclass

from sim.core.prefix import PrefixCachePool
from sim.core.request import Request
from sim.core.state import SchedulerState
from sim.loop.feed import pick_replica

B = 4


@dataclass
class Replica:                    # what pick_replica reads of a Server
    state: SchedulerState
    num_outstanding_requests: int = 0


def replica(*cached: tuple[int, ...], load: int = 0) -> Replica:
    """A replica whose pool holds the full blocks of each content in ``cached``, freed (still cached)."""
    pool = PrefixCachePool(64, B)
    for i, content in enumerate(cached):
        r = Request(req_id=100 + i, arrival_s=0.0, num_prompt_tokens=sum(content[2::2]), max_output_tokens=1,
                    content=content)
        pool.allocate(r, r.num_prompt_tokens)
        pool.free(r)
    return Replica(SchedulerState(pool, 1024), load)


def incoming(content: tuple[int, ...]) -> Request:
    return Request(req_id=0, arrival_s=0.0, num_prompt_tokens=sum(content[2::2]), max_output_tokens=1,
                   content=content)


def test_the_longest_cached_prefix_wins():
    # The request: key 7 x 12 tokens + 5 own = 3 whole shared blocks. Replica 1 caches 7 x 8
    # (2 blocks), replica 2 caches 7 x 12 (3 blocks), replica 0 nothing: replica 2.
    fleet = [replica(), replica((1, 7, 8)), replica((2, 7, 12))]
    assert pick_replica("prefix_aware", fleet, 0, incoming((9, 7, 12, 8, 5))) is fleet[2]


def test_the_load_guard_passes_over_a_busy_replica():
    # Loads 2, 4, 5: the guard admits loads <= 1.25 x 2 + 1 = 3.5, so only replica 0, although
    # replica 2 holds the prefix. With loads 2, 3, 3 replica 2 is a candidate again.
    r = incoming((9, 7, 12, 8, 5))
    fleet = [replica(load=2), replica((1, 7, 8), load=4), replica((2, 7, 12), load=5)]
    assert pick_replica("prefix_aware", fleet, 0, r) is fleet[0]
    fleet[1].num_outstanding_requests = fleet[2].num_outstanding_requests = 3
    assert pick_replica("prefix_aware", fleet, 0, r) is fleet[2]


def test_no_prefix_anywhere_is_least_loaded_then_lowest_index():
    fleet = [replica(load=3), replica(load=1), replica(load=1)]
    assert pick_replica("prefix_aware", fleet, 0, incoming((9, 6, 16))) is fleet[1]
    # equal matches: the less loaded one
    fleet = [replica((1, 7, 8), load=2), replica((2, 7, 8), load=1)]
    assert pick_replica("prefix_aware", fleet, 0, incoming((9, 7, 8, 3, 4))) is fleet[1]

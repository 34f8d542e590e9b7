"""The prefix-caching block pool (sim.core.prefix), rule by rule, on cases
worked out by hand. (tests/policies/test_vllm_v1_differential.py checks the
same rules against vLLM's own KV manager on random workloads.)"""

from __future__ import annotations

import pytest

from policies.vllm_v1 import VllmV1Config, VllmV1Policy
from sim.core.batch import Batch
from sim.core.policy import PolicyContext
from sim.core.prefix import PrefixCachePool, extend_hashes, own_content
from sim.core.request import Request
from sim.core.state import SchedulerState

B = 4   # block size of these cases


def req(i: int, content: tuple[int, ...], max_tokens: int = 4) -> Request:
    prompt = sum(content[2::2])
    return Request(req_id=i, arrival_s=0.0, num_prompt_tokens=prompt, max_output_tokens=max_tokens, content=content)


def test_equal_runs_hash_equal_blocks_and_chain_from_the_first():
    # r0: key 7 x 10 tokens + key 8 x 3; r1: key 7 x 10 + key 9 x 3. Blocks of 4: [0,4) [4,8) lie in
    # run 7 in both: equal hashes; [8,12) holds 7:8-9 + 8:0-1 vs 7:8-9 + 9:0-1: differs; r0's 13
    # tokens make 3 full blocks.
    r0, r1 = req(0, (100, 7, 10, 8, 3)), req(1, (101, 7, 10, 9, 3))
    h0, h1 = extend_hashes(r0, 13, B), extend_hashes(r1, 13, B)
    assert len(h0) == len(h1) == 3
    assert h0[:2] == h1[:2] and h0[2] != h1[2]
    # r2 = key 7 x 4 + key 8 x 9: block 0 (7:0-3) matches r0's, block 1 (8:0-3 vs 7:4-7) does not.
    r2 = req(2, (102, 7, 4, 8, 9))
    h2 = extend_hashes(r2, 8, B)
    assert h2[0] == h0[0] and h2[1] != h0[1]
    # Output tokens complete blocks too: r0 with 3 outputs knows 16 tokens, block 3 = 8:2 + out 0-2.
    r0.num_output_tokens = 3
    assert len(extend_hashes(r0, 16, B)) == 4


def test_a_request_without_content_shares_nothing():
    a = Request(req_id=0, arrival_s=0.0, num_prompt_tokens=8, max_output_tokens=1)
    b = Request(req_id=1, arrival_s=0.0, num_prompt_tokens=8, max_output_tokens=1)
    assert extend_hashes(a, 8, B) != extend_hashes(b, 8, B)[:2]
    assert a.content == own_content(0, 8)


def test_lookup_is_capped_one_token_short_in_whole_blocks():
    pool = PrefixCachePool(16, B)
    r0 = req(0, (100, 7, 8))                 # 8 tokens: 2 full blocks
    pool.allocate(r0, 8)                     # schedules all 8: both registered at once
    assert pool.num_cached_blocks == 2
    # Same 8-token prompt: the hit is capped at 8 - 1 = 7 tokens, i.e. 1 whole block: the last
    # block is recomputed in full.
    assert len(pool.lookup(req(1, (101, 7, 8)))) == 1
    # A 9-token prompt with the same first 8: cap 8 tokens = 2 blocks, both cached.
    assert len(pool.lookup(req(2, (102, 7, 8, 5, 1)))) == 2
    # A miss in the first block stops the walk, whatever follows.
    assert pool.lookup(req(3, (103, 6, 1, 7, 8))) == []


def test_free_puts_hashed_blocks_last_in_lru_order_and_unhashed_first():
    pool = PrefixCachePool(6, B)
    r0 = req(0, (100, 7, 10))               # 10 tokens: blocks 0, 1 full (hashed), block 2 partial
    pool.allocate(r0, 10)
    assert r0.block_ids == [0, 1, 2] and pool.num_cached_blocks == 2
    pool.free(r0)
    # Tail first: 2 (unhashed) to the front, then 1, 0 (hashed) to the LRU end in that order.
    assert pool.num_used_blocks == 0 and pool.num_cached_free_blocks == 2
    r1 = req(1, (101, 9, 8))
    pool.allocate(r1, 8)
    # Front first (2), then never-used 3: no eviction yet.
    assert r1.block_ids == [2, 3] and pool.evictions == 0
    r2 = req(2, (102, 5, 16))
    pool.allocate(r2, 16)
    # 4, 5 never used, then the LRU: 1 (r0's tail block, freed first) before 0.
    assert r2.block_ids == [4, 5, 1, 0] and pool.evictions == 2
    assert pool.lookup(req(3, (103, 7, 10))) == []           # r0's prefix is gone


def test_a_hit_on_a_free_block_leaves_the_free_queue():
    pool = PrefixCachePool(4, B)
    r0 = req(0, (100, 7, 8))
    pool.allocate(r0, 8)
    pool.free(r0)                            # blocks 0, 1 free but cached
    r1 = req(1, (101, 7, 8, 3, 4))           # 12 tokens: cap 11 -> 2 blocks hit
    hit = pool.lookup(r1)
    assert hit == [0, 1] and pool.num_evictable(hit) == 2
    free_before = pool.num_free_blocks       # 4: two never used, two cached
    pool.touch(r1, hit)
    assert pool.num_free_blocks == free_before - 2 and pool.num_cached_free_blocks == 0
    pool.allocate(r1, 12)                    # one more block: never-used 2
    assert r1.block_ids == [0, 1, 2] and r1.num_hashed_blocks == 3


def test_two_blocks_with_one_hash_the_first_serves_and_the_second_takes_over():
    pool = PrefixCachePool(8, B)
    r0, r1 = req(0, (100, 7, 8)), req(1, (101, 7, 8))
    pool.allocate(r0, 8)
    r1.block_ids = []
    pool._take(2, r1.block_ids)              # r1 computed the same blocks without a lookup (vLLM: same step
    pool.cache(r1, 8)                        # before r0's were registered): both registered
    assert pool.num_cached_blocks == 4
    assert pool.lookup(req(2, (102, 7, 8, 1, 1))) == [0, 1]      # the first registered
    pool.free(r0)                            # 1, 0 to the LRU; r1 holds 2, 3
    other = req(3, (103, 9, 8))
    pool.allocate(other, 8)                  # never-used 4, 5
    pool.allocate(req(4, (104, 9, 1, 5, 7)), 8)      # 6, 7
    pool.allocate(req(5, (105, 2, 8)), 8)    # evicts 1 then 0
    assert pool.evictions == 2
    assert pool.lookup(req(6, (106, 7, 8, 1, 1))) == [2, 3]      # r1's copies now serve


def test_vllm_v1_registers_blocks_when_scheduled_so_the_same_step_hits():
    # Block size 4, budget 64. r0 and r1 share a 9-token prompt (+ 1 own token) and arrive
    # together. Step 0: r0 schedules 10 tokens, which registers its 2 full blocks at once; r1's
    # lookup (cap 9 tokens -> 2 blocks) then hits both: 8 cached tokens, 2 to compute, and it
    # takes no budget for the hit.
    pool = PrefixCachePool(32, B)
    state = SchedulerState(pool, 64)
    policy = VllmV1Policy(VllmV1Config(max_num_seqs=4, max_num_batched_tokens=64), PolicyContext(64))
    for i in range(2):
        state.add_arrival(req(i, (100 + i, 7, 9, 50 + i, 1)), 2, 0.0)
    batch = policy.schedule(state, 0.0)
    assert isinstance(batch, Batch)
    assert [(it.req_id, it.num_new_tokens, it.context_len) for it in batch.items] == [(0, 10, 0), (1, 2, 8)]
    assert pool.queries == 20 and pool.hits == 8
    assert state.requests[1].num_cached_tokens == 8 and state.requests[0].num_cached_tokens == 0
    # The two share blocks 0 and 1: 3 + 1 blocks in use, not 6.
    assert pool.num_used_blocks == 4


def test_the_admission_check_counts_hit_blocks_that_sit_in_the_free_queue():
    # 5 usable blocks of 4. r0 (8 tokens, 1 output) runs and finishes: its 2 full blocks (and the
    # third it grew into: 8 + 1 tokens known) are freed, 2 cached. r1: 17 tokens = the same 8 + 9
    # own; its whole prompt needs ceil(17 / 4) = 5 blocks, 2 of them hit. vLLM counts 5 - 2 = 3 new
    # + 2 evictable hits = 5 <= 5 free: admitted. With one block held elsewhere (4 free) it waits,
    # although 3 new blocks would fit.
    for held, admitted in ((0, True), (1, False)):
        pool = PrefixCachePool(5, B)
        state = SchedulerState(pool, 64)
        policy = VllmV1Policy(VllmV1Config(max_num_seqs=4, max_num_batched_tokens=64), PolicyContext(64))
        state.add_arrival(req(0, (100, 7, 8), max_tokens=1), 1, 0.0)
        first = policy.schedule(state, 0.0)
        state.commit(first, 1.0)             # samples its one token and finishes
        assert pool.num_used_blocks == 0 and pool.num_cached_free_blocks == 2
        if held:
            blocker = req(9, (109, 3, 2))
            pool.allocate(blocker, 2)
        state.add_arrival(req(1, (101, 7, 8, 8, 9), max_tokens=1), 1, 1.0)
        step = policy.schedule(state, 1.0)
        got = [(it.req_id, it.num_new_tokens, it.context_len) for it in getattr(step, "items", ())]
        assert got == ([(1, 9, 8)] if admitted else []), (held, got)


@pytest.mark.parametrize("block_size", [1, 3, 16])
def test_hashes_do_not_depend_on_how_far_they_were_computed(block_size):
    # Extending 5 blocks at a time or all at once gives the same chain.
    content = (900, 1, 7, 2, 30, 3, 11)
    a, b = req(0, content), req(1, content)
    for n in range(0, 48, 5):
        extend_hashes(a, n, block_size)
    a.num_output_tokens = b.num_output_tokens = 0
    assert extend_hashes(a, 48, block_size)[:48 // block_size] == extend_hashes(b, 48, block_size)

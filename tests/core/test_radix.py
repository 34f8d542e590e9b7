"""SGLang's radix cache as a pool (sim.core.radix), rule by rule, on cases
worked out by hand. (tests/policies/test_sglang_differential.py checks the
tree against SGLang's own RadixCache on random operations.)"""

from __future__ import annotations

import sys

from sim.core.radix import RadixCachePool, RadixTree, TokenPool, token_runs
from sim.core.request import Request, Status


def req(i: int, content: tuple[int, ...], max_tokens: int = 4) -> Request:
    prompt = sum(content[2::2])
    return Request(req_id=i, arrival_s=0.0, num_prompt_tokens=prompt, max_output_tokens=max_tokens, content=content)


def test_token_runs_are_the_prompts_segments_then_the_outputs():
    r = req(0, (100, 7, 10, 8, 3))
    assert token_runs(r, 11) == [(7, 0, 10), (8, 0, 1)]
    r.num_output_tokens = 2
    assert token_runs(r, 15) == [(7, 0, 10), (8, 0, 3), (100, 0, 2)]
    own = Request(req_id=5, arrival_s=0.0, num_prompt_tokens=4, max_output_tokens=1)
    assert len(token_runs(own, 4)) == 1 and own.content is not None      # a prompt of its own


def test_a_match_ending_inside_a_node_splits_it_and_an_insert_hangs_the_rest_below():
    tree = RadixTree()
    assert tree.insert([(7, 0, 10)])[0] == 0                 # nothing cached: one leaf of 10
    assert tree.num_nodes == 1 and tree.total_tokens == 10
    # (7, 0..3) then (9, 0..2): 4 tokens agree; the node splits into 4 + 6
    n, node = tree.match([(7, 0, 4), (9, 0, 3)])
    assert n == 4 and node.length == 4 and tree.num_nodes == 2
    cached, leaf = tree.insert([(7, 0, 4), (9, 0, 3)])
    assert cached == 4 and leaf.length == 3 and leaf.parent is node
    assert tree.total_tokens == tree.evictable_tokens == 10 + 3
    # tokens agree only where key and offset agree: (7, 2..) is not (7, 0..)
    assert tree.match([(7, 2, 6)])[0] == 0
    assert tree.peek([(7, 0, 10), (5, 0, 1)]) == 10          # peek: no stamp, no split
    assert tree.num_nodes == 3


def test_lru_evicts_unlocked_leaves_only_whole_and_oldest_first():
    tree = RadixTree()
    _, x = tree.insert([(1, 0, 5)])                          # stamp 1
    _, y = tree.insert([(2, 0, 5)])                          # stamp 2
    _, z = tree.insert([(3, 0, 5)])                          # stamp 3
    tree.lock(y)
    assert tree.evictable_tokens == 15 - 5
    tree.match([(1, 0, 5)])                                  # x stamped 4: z is now the oldest
    # evicting 6 tokens takes z (5, stamp 3), then x (5, stamp 4): whole nodes, 10 >= 6; y is locked
    assert tree.evict(6) == 10
    assert list(tree.root.children.values()) == [y]
    assert tree.evict(1) == 0                                # nothing unlocked left
    tree.unlock(y)
    assert tree.evictable_tokens == 5 and tree.evict(1) == 5


def test_a_parent_left_childless_is_evicted_after_its_leaf():
    tree = RadixTree()
    tree.insert([(1, 0, 5)])
    tree.insert([(1, 0, 5), (4, 0, 3)])                      # a child of 3 below the 5
    assert tree.evict(1) == 3                                # the leaf only
    assert tree.total_tokens == 5
    assert tree.evict(1) == 5                                # then its parent, now a leaf


def test_pages_round_matches_down_and_tell_children_by_their_first_page():
    tree = RadixTree(page_size=4)
    tree.insert([(7, 0, 8)])                                 # two pages
    # 6 tokens agree: rounded down to 4, the node splits after its first page
    assert tree.match([(7, 0, 6), (9, 0, 2)])[0] == 4
    # a sequence that shares the first token but not the whole first page is a sibling
    cached, _ = tree.insert([(7, 0, 1), (8, 0, 3)])
    assert cached == 0 and len(tree.root.children) == 2


def test_the_pool_counts_free_tree_and_own_pages_through_a_requests_life():
    pool = RadixCachePool(100, 1)
    a = req(0, (100, 7, 10))
    pool.hold(a, 0, pool.tree.root)
    pool.allocate(a, 10)                                     # its prompt: 10 own pages
    assert isinstance(a.block_ids, range) and len(a.block_ids) == 10
    assert (pool.num_free_blocks, pool.num_used_blocks) == (90, 10)
    pool.checkpoint(a, 10)                                   # the prefill ends: 10 tokens to the tree, locked
    assert pool.tree.total_tokens == 10 and pool.tree.evictable_tokens == 0
    assert (pool.num_free_blocks, pool.num_used_blocks) == (90, 10)
    a.num_output_tokens = 3                                  # 3 outputs: 12 tokens computed at the end
    pool.allocate(a, 12)
    a.num_computed_tokens = 12
    a.status = Status.FINISHED
    pool.free(a)                                             # checkpointed with its outputs, then unlocked
    assert a.block_ids == []
    # 12 tokens in the tree, split at the prompt's end (10 + 2), all evictable: 88 free + 12 cached
    assert pool.tree.total_tokens == 12 and pool.tree.num_nodes == 2
    assert (pool.num_free_blocks, pool.num_used_blocks, pool.num_cached_free_blocks) == (100, 0, 12)
    # b: the same prompt; its match is capped at 10 - 1 = 9 tokens (the node splits at 9)
    b = req(1, (101, 7, 10))
    n, node = pool.match(b, 10 - 1)
    assert n == 9
    pool.hold(b, n, node)
    assert pool.tree.evictable_tokens == 12 - 9 and len(b.block_ids) == 9
    assert pool.cached_prefix_blocks(b) == 10                # a router's view: the whole prompt, no cap


def test_duplicates_computed_in_one_batch_are_freed_at_the_checkpoint():
    pool = RadixCachePool(100, 1)
    a, b = req(0, (100, 7, 10)), req(1, (101, 7, 10))
    for r in (a, b):
        pool.hold(r, 0, pool.tree.root)
        pool.allocate(r, 10)
    assert pool.num_free_blocks == 80
    pool.checkpoint(a, 10)
    pool.checkpoint(b, 10)                                   # the tree already holds all 10: b's copies freed
    assert pool.num_free_blocks == 90 and pool.tree.total_tokens == 10
    b.status = Status.PREEMPTED                              # retracted: no insert, its lock dropped
    pool.free(b)
    a.status = Status.PREEMPTED
    pool.free(a)
    assert pool.num_free_blocks == 100 and pool.num_cached_free_blocks == 10


def test_allocation_evicts_only_the_shortfall():
    pool = RadixCachePool(20, 1)
    for i, key in enumerate((7, 8)):                         # two finished prompts of 8 in the tree
        r = req(i, (100 + i, key, 8))
        pool.hold(r, 0, pool.tree.root)
        pool.allocate(r, 8)
        r.num_computed_tokens, r.status = 8, Status.FINISHED
        pool.free(r)
    assert (pool.num_free_tokens, pool.num_cached_free_blocks) == (4, 16)
    c = req(2, (102, 9, 10))
    pool.hold(c, 0, pool.tree.root)
    pool.allocate(c, 10)                                     # 10 > 4 free: evicts the oldest node (8)
    assert pool.evictions == 8 and pool.num_free_tokens == 4 + 8 - 10
    assert pool.num_cached_free_blocks == 8


def test_a_disabled_cache_counts_pages_and_shares_nothing():
    pool = TokenPool(50, 1)
    assert not pool.caching
    a = req(0, (100, 7, 10))
    pool.hold(a, 0, pool.tree.root)
    pool.allocate(a, 10)
    pool.checkpoint(a, 10)
    a.num_computed_tokens, a.status = 10, Status.FINISHED
    pool.free(a)
    assert pool.match(req(1, (101, 7, 10))) == (0, pool.tree.root)
    assert pool.num_free_blocks == 50 and pool.tree.total_tokens == 0


def test_tree_operations_cost_runs_not_tokens():
    pool = RadixCachePool(1 << 22, 1)
    long = req(0, (100, 7, 1_000_000, 8, 1_000_000))        # a 2M-token prompt in two runs
    pool.hold(long, 0, pool.tree.root)
    pool.allocate(long, 2_000_000)
    pool.checkpoint(long, 2_000_000)
    assert sys.getsizeof(long.block_ids) < 100               # a range, not 2M ints
    n, _ = pool.match(req(1, (101, 7, 1_000_000, 9, 5)))
    assert n == 1_000_000 and pool.tree.num_nodes == 2


def test_a_checkpoint_past_the_prompt_splits_at_the_prompts_end():
    # a retracted request re-prefills its 10 prompt tokens and 2 outputs: the 12 enter the tree as
    # 10 + 2, so an eviction can take the outputs and keep the prompt
    pool = RadixCachePool(100, 1)
    r = req(0, (100, 7, 10))
    r.num_output_tokens = 2
    pool.hold(r, 0, pool.tree.root)
    pool.allocate(r, 12)
    pool.checkpoint(r, 12)
    assert pool.tree.num_nodes == 2
    r.status = Status.PREEMPTED
    pool.free(r)
    assert pool.tree.evict(1) == 2 and pool.tree.total_tokens == 10

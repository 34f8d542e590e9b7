"""TensorRT-LLM's capacity and micro batch schedulers (policies.tensorrt_llm), with the token and
block arithmetic in comments. Scenarios marked "port:" repeat a TensorRT-LLM unit test with the
results it asserts: cpp/tests/unit_tests/batch_manager/capacitySchedulerTest.cpp and
microBatchSchedulerTest.cpp (ContextChunkingTest) of NVIDIA/TensorRT-LLM.
"""

from __future__ import annotations

import pytest
from conftest import add, make_state

from policies.config import policy_config
from policies.tensorrt_llm import TensorRtLlmConfig, TensorRtLlmPolicy
from policies.tensorrt_llm_rules import chunk_sizes, reused_chunk
from sim.core.batch import Batch, BatchItem
from sim.core.policy import KvMemory, PolicyContext
from sim.core.prefix import PrefixCachePool
from sim.core.request import Request, Status
from sim.core.state import SchedulerState

CTX = PolicyContext(max_model_len=1 << 16)


def policy(**knobs) -> TensorRtLlmPolicy:
    return TensorRtLlmPolicy(TensorRtLlmConfig(**knobs), CTX)


def drive(p: TensorRtLlmPolicy, state: SchedulerState, max_steps: int = 10_000) -> list[tuple[BatchItem, ...]]:
    """Schedule and commit one step per unit of time until every request is done; the items of each step."""
    steps = []
    t = 0.0
    while (state.waiting or state.running) and len(steps) < max_steps:
        batch = p.schedule(state, t)
        assert isinstance(batch, Batch), f"idle at step {len(steps)}"
        steps.append(batch.items)
        t += 1.0
        state.commit(batch, t)
    return steps


def ids(items) -> list[int]:
    return [it.req_id for it in items]


def cached_state(num_blocks: int, block_size: int) -> SchedulerState:
    return SchedulerState(PrefixCachePool(num_blocks, block_size), 1 << 16)


def add_content(state: SchedulerState, req_id: int, content: tuple[int, ...], output: int) -> Request:
    r = Request(req_id, 0.0, sum(content[2::2]), output, content=content)
    assert state.add_arrival(r, output, 0.0)
    return r


# ---- declarations --------------------------------------------------------------------------------
def test_defaults_are_the_llm_apis():
    p = policy()
    # max_num_tokens 8192, max_batch_size 2048, KV 0.9 of free memory, 32-token pages, no chunking:
    # prompts longer than one step's 8192 tokens are refused at arrival
    assert (p.token_budget, p.max_num_seqs, p.block_size) == (8192, 2048, 32)
    assert p.kv_memory == KvMemory(0.9, "free") and p.kv_pool_class is PrefixCachePool
    assert p.max_prompt_tokens == 8192 and policy(enable_chunked_prefill=True).max_prompt_tokens is None
    assert p.knobs()["capacity_scheduler_policy"] == "GUARANTEED_NO_EVICT"


def test_bad_knobs_are_refused_naming_the_field():
    with pytest.raises(ValueError, match="capacity_scheduler_policy must be one of GUARANTEED_NO_EVICT"):
        policy(capacity_scheduler_policy="max_utilization")
    with pytest.raises(ValueError, match="context_chunking_policy must be one of"):
        policy(context_chunking_policy="FCFS")
    with pytest.raises(ValueError, match=r"free_gpu_memory_fraction must be in \(0, 1\]"):
        policy(free_gpu_memory_fraction=1.5)
    # chunks are whole blocks: a budget below one block could never chunk a long prompt
    with pytest.raises(ValueError, match=r"max_num_tokens \(16\) must be at least tokens_per_block \(32\)"):
        policy(max_num_tokens=16, enable_chunked_prefill=True)


def test_enable_chunked_prefill_is_its_own_knob_in_a_workload():
    # vLLM's alias (policy.kind vllm + enable_chunked_prefill -> sarathi) leaves this policy's knob alone
    cfg = policy_config({"kind": "tensorrt_llm", "enable_chunked_prefill": True}, "w.yaml")
    assert cfg.enable_chunked_prefill is True and cfg.kind == "tensorrt_llm"


# ---- capacity scheduler: GUARANTEED_NO_EVICT ------------------------------------------------------
def test_no_evict_reserves_to_completion_and_stops_at_the_first_misfit():
    # 10 blocks of 4 tokens. A: 8 + 8 = 16 tokens = 4 blocks to completion; B: 4 + 24 = 28 = 7 blocks;
    # C: 4 + 4 = 8 = 2 blocks. 10 free: A fits (6 left), B needs 7 > 6: the scan stops, and C, which
    # would fit, waits behind B (no skipping). Only A's prompt blocks are taken: 2, 8 free.
    state = make_state(num_blocks=10, block_size=4)
    p = policy()
    add(state, 0, 8, 8), add(state, 1, 4, 24), add(state, 2, 4, 4)
    first = p.schedule(state, 0.0)
    assert first.items == (BatchItem(0, 8, 0),)
    assert ids(state.waiting) == [1, 2] and state.kv.num_free_blocks == 8
    state.commit(first, 1.0)
    # A decodes at context 8 (its 2 blocks full: it takes a 3rd). Its blocks to completion are
    # 4 - 2 = 2, so 8 - 2 = 6 remain for B's 7: B still waits, and C behind it.
    second = p.schedule(state, 1.0)
    assert second.items == (BatchItem(0, 1, 8),)
    assert ids(state.waiting) == [1, 2] and len(state.running[0].block_ids) == 3


def test_no_evict_admits_a_request_when_the_blocks_to_completion_fit():
    # 10 blocks of 4: A (8 + 8: 4 blocks) and B (4 + 20 = 24: 6 blocks) both fit: 4 + 6 = 10.
    state = make_state(num_blocks=10, block_size=4)
    add(state, 0, 8, 8), add(state, 1, 4, 20)
    assert policy().schedule(state, 0.0).items == (BatchItem(0, 8, 0), BatchItem(1, 4, 0))
    # 2 + 1 prompt blocks taken, 7 free; nobody is ever preempted in the whole run
    assert state.kv.num_free_blocks == 7


def test_port_simple_doesnt_fit_guaranteed_completion():
    # port: CapacitySchedulerTest.SimpleDoesntFitGuaranteedCompletion. 100 tokens of KV in blocks of
    # 10, two requests of prompt 10 and 80 new tokens (90 tokens = 9 blocks each): only request 0 runs
    # for its 80 iterations (1 prefill + 79 decodes), then request 1 for 80: 160 iterations.
    state = make_state(num_blocks=10, block_size=10)
    a, b = add(state, 0, 10, 80), add(state, 1, 10, 80)
    steps = drive(policy(max_batch_size=2), state)
    assert len(steps) == 160
    assert all(ids(s) == [0] for s in steps[:80]) and all(ids(s) == [1] for s in steps[80:])
    assert a.num_preemptions == b.num_preemptions == 0


@pytest.mark.parametrize("capacity", ["GUARANTEED_NO_EVICT", "MAX_UTILIZATION", "STATIC_BATCH"])
def test_port_simple_should_fit(capacity):
    # port: CapacitySchedulerTest.SimpleShouldFit. 200 tokens of KV (20 blocks of 10): both requests
    # (2 x 9 blocks) run side by side for all 80 iterations, under every capacity policy.
    state = make_state(num_blocks=20, block_size=10)
    add(state, 0, 10, 80), add(state, 1, 10, 80)
    steps = drive(policy(max_batch_size=2, capacity_scheduler_policy=capacity), state)
    assert len(steps) == 80 and all(ids(s) == [0, 1] for s in steps)


def test_static_batch_admits_only_while_nothing_decodes():
    # 100 blocks: room for all. A and B are admitted together; C arrives after the first step: it
    # waits until both have finished (A: 3 tokens, B: 5), then runs alone.
    state = make_state(num_blocks=100, block_size=4)
    p = policy(capacity_scheduler_policy="STATIC_BATCH")
    add(state, 0, 4, 3), add(state, 1, 4, 5)
    batch = p.schedule(state, 0.0)
    assert ids(batch.items) == [0, 1]
    state.commit(batch, 1.0)
    add(state, 2, 4, 2, arrival_s=1.0)
    steps = drive(p, state)
    # steps 2-3 decode A and B (A's 3rd token ends it), steps 4-5 B alone, then C: prefill + decode
    assert [ids(s) for s in steps] == [[0, 1], [0, 1], [1], [1], [2], [2]]


# ---- capacity scheduler: MAX_UTILIZATION ----------------------------------------------------------
def test_max_utilization_takes_next_step_blocks_only():
    # The state of the first no-evict test: B (prompt 4) needs only its prompt's 1 block now, and C its 1:
    # all three are admitted (2 + 1 + 1 blocks of the 10).
    state = make_state(num_blocks=10, block_size=4)
    add(state, 0, 8, 8), add(state, 1, 4, 24), add(state, 2, 4, 4)
    batch = policy(capacity_scheduler_policy="MAX_UTILIZATION").schedule(state, 0.0)
    assert batch.items == (BatchItem(0, 8, 0), BatchItem(1, 4, 0), BatchItem(2, 4, 0))
    assert state.kv.num_free_blocks == 6


def test_max_utilization_pauses_the_newest_running_request():
    # 4 blocks of 4 tokens; A and B: prompt 4, 12 outputs. Step 1: both prefill (1 block each).
    # Step 2: both at context 4 need a 2nd block (4 used). Steps 3-5: contexts 5-7, no block. Step 6:
    # A at context 8 needs a 3rd block, none free: the last running request, B, is paused (its 2
    # blocks freed, back to the queue with its 5 outputs), A takes one; nobody waiting is taken.
    state = make_state(num_blocks=4, block_size=4)
    p = policy(capacity_scheduler_policy="MAX_UTILIZATION")
    a, b = add(state, 0, 4, 12), add(state, 1, 4, 12)
    steps = drive(p, state, max_steps=5)
    assert [ids(s) for s in steps] == [[0, 1]] * 5 and state.kv.num_free_blocks == 0
    sixth = p.schedule(state, 5.0)
    assert sixth.items == (BatchItem(0, 1, 8),)
    assert b.status == Status.PREEMPTED and b.num_output_tokens == 5 and ids(state.waiting) == [1]
    assert len(a.block_ids) == 3 and state.kv.num_free_blocks == 1
    state.commit(sixth, 6.0)
    # B must recompute 4 + 5 = 9 tokens = 3 blocks; 1 free: it waits while A grows to its 4th block
    # (context 12), and comes back when A finishes (12 outputs: steps 7-11 after step 6).
    rest = drive(p, state)
    assert [ids(s) for s in rest[:6]] == [[0]] * 6
    assert rest[6] == (BatchItem(1, 9, 0),)
    assert b.num_output_tokens == 12 and b.num_preemptions == 1 and a.num_preemptions == 0


def test_port_simple_doesnt_fit_max_utilization():
    # port: CapacitySchedulerTest.SimpleDoesntFitMaxUtilization. 10 blocks of 10 tokens, prompt 10,
    # 80 new tokens each. Each request takes a block at contexts 10, 20, 30, 40 (iterations 1, 11, 21,
    # 31): 2 x 5 = 10 blocks. At iteration 41 both are at context 50: request 1 is paused with 41
    # tokens generated; request 0 runs alone to its 80th token (iteration 79); at iteration 80 request
    # 1 returns with prompt 10 + 41 = 51 tokens and 39 to go: 1 prefill + 38 decodes, 119 iterations.
    state = make_state(num_blocks=10, block_size=10)
    a, b = add(state, 0, 10, 80), add(state, 1, 10, 80)
    steps = drive(policy(max_batch_size=2, capacity_scheduler_policy="MAX_UTILIZATION",
                         enable_block_reuse=False), state)
    assert len(steps) == 119
    assert all(ids(s) == [0, 1] for s in steps[:41]) and all(ids(s) == [0] for s in steps[41:80])
    assert steps[80] == (BatchItem(1, 51, 0),) and all(ids(s) == [1] for s in steps[81:])
    assert (a.num_preemptions, b.num_preemptions) == (0, 1)


# ---- micro batch scheduler -------------------------------------------------------------------------
def two_decodes_and(state: SchedulerState, prompts: tuple[int, ...]) -> None:
    """Requests 0 and 1 decoding at context 4 (one block of 4 each), then waiting prompts 2, 3, ..."""
    for i in (0, 1):
        r = add(state, i, 4, 10)
        state.kv.allocate(r, 4)
        state.admit(r, 0.0)
        r.num_computed_tokens, r.num_output_tokens = 4, 1
    for j, n in enumerate(prompts):
        add(state, 2 + j, n, 4)


def test_decodes_first_then_whole_prefills_while_the_budget_lasts():
    # max_num_tokens 20: decodes 1 + 1 = 2, then C's 10 (12), then D's 10 would make 22 > 20: D waits
    # though its blocks fit, and it ends the scan.
    state = make_state(num_blocks=100, block_size=4)
    two_decodes_and(state, (10, 10))
    batch = policy(max_num_tokens=20).schedule(state, 0.0)
    assert batch.items == (BatchItem(0, 1, 4), BatchItem(1, 1, 4), BatchItem(2, 10, 0))
    assert ids(state.waiting) == [3]


@pytest.mark.parametrize("chunking,expected", [
    # budget 16 - 2 decodes = 14 for prompts of 20 and 20, chunk unit 4:
    # FCFS: C takes min(20, 14) = 14, cut to 12 (a multiple of 4); D gets min(20, 2) = 2 -> 0: waits.
    ("FIRST_COME_FIRST_SERVED", [(2, 12, 0)]),
    # EQUAL_PROGRESS: rounds of 4 each: 4 + 4 = 8, 8 + 8 = 16 > 14 stops D; C's 12 would make 16 too:
    # nothing grows, C 8, D 4.
    ("EQUAL_PROGRESS", [(2, 8, 0), (3, 4, 0)]),
])
def test_chunked_prefills_share_what_the_decodes_leave(chunking, expected):
    state = make_state(num_blocks=100, block_size=4)
    two_decodes_and(state, (20, 20))
    p = policy(max_num_tokens=16, tokens_per_block=4, enable_chunked_prefill=True, context_chunking_policy=chunking)
    batch = p.schedule(state, 0.0)
    assert batch.items == (BatchItem(0, 1, 4), BatchItem(1, 1, 4), *(BatchItem(*e) for e in expected))
    # a first chunk takes all of its prompt's blocks: 20 tokens = 5
    assert len(state.requests[2].block_ids) == 5


def test_a_chunk_is_at_most_max_num_tokens():
    # a lone prompt of 20 with max_num_tokens 16: 20 > 16, so it is chunked: min(20, 16) = 16 (a
    # multiple of 4), then the last 4
    state = make_state(num_blocks=100, block_size=4)
    add(state, 0, 20, 2)
    steps = drive(policy(max_num_tokens=16, tokens_per_block=4, enable_chunked_prefill=True), state)
    assert steps[:2] == [(BatchItem(0, 16, 0),), (BatchItem(0, 4, 16),)]


def test_max_batch_size_counts_decodes_and_prefills():
    state = make_state(num_blocks=100, block_size=4)
    two_decodes_and(state, (4, 4))
    batch = policy(max_batch_size=3).schedule(state, 0.0)
    assert ids(batch.items) == [0, 1, 2] and ids(state.waiting) == [3]


# port: microBatchSchedulerTest.cpp ContextChunkingTest: (lengths, unit, capacity, max context length)
# -> positions after each iteration, for EQUAL_PROGRESS and FIRST_COME_FIRST_SERVED.
CHUNKING_CASES = {
    "NoLimit": ((25, 25), 20, None, None, [(25, 25)], [(25, 25)]),
    "ContextLengthNeverSatisfied": ((25, 25), 100, None, 20, [(0, 0)], [(0, 0)]),
    "ChunkLongerThanContext": ((25, 25), 30, None, 25, [(25, 25)], [(25, 25)]),
    "ContextLengthSatisfied": ((10, 25), 10, None, 20, [(10, 20), (10, 25)], [(10, 20), (10, 25)]),
    "TokenCapacitySmallerThanContext": ((25, 25), 20, 20, None, [(20, 0), (25, 0), (25, 20), (25, 25)],
                                        [(20, 0), (25, 0), (25, 20), (25, 25)]),
    "TokenCapacitySmallerThanChunkUnit": ((25, 25), 20, 10, None, [(0, 0)], [(0, 0)]),
    "SchedulingOrder": ((25, 25), 5, 30, None, [(15, 15), (25, 25)], [(25, 5), (25, 25)]),
    "CompletionOrder": ((25, 15), 5, 30, None, [(15, 15), (25, 15)], [(25, 5), (25, 15)]),
    "LongFirstShortLater": ((25, 15), 5, 30, 10, [(10, 10), (20, 15), (25, 15)], [(10, 10), (20, 15), (25, 15)]),
    "FrontPriority": ((25, 25), 5, 15, None, [(10, 5), (20, 10), (25, 20), (25, 25)],
                      [(15, 0), (25, 5), (25, 20), (25, 25)]),
}


@pytest.mark.parametrize("name", list(CHUNKING_CASES))
def test_port_context_chunking(name):
    lengths, unit, capacity, max_context, equal, fcfs = CHUNKING_CASES[name]
    for chunking, expected in (("EQUAL_PROGRESS", equal), ("FIRST_COME_FIRST_SERVED", fcfs)):
        positions = [0] * len(lengths)
        seen = []
        for _ in expected:       # the C++ fixture stops after the expected iterations
            sizes = chunk_sizes([n - p for n, p in zip(lengths, positions)], capacity, unit, max_context, chunking)
            positions = [p + s for p, s in zip(positions, sizes)]
            seen.append(tuple(positions))
        assert seen == expected, (name, chunking)


# ---- block reuse -----------------------------------------------------------------------------------
# Content: (output key, key, length, key, length, ...): the prompt is runs of tokens (key, 0..length-1).
SHARED = (7, 8)                  # 8 tokens both prompts share: 2 blocks of 4


def test_reuse_hits_whole_blocks_up_to_prompt_minus_one():
    # A's 12-token prompt is cached after A runs. An identical prompt B may reuse at most 12 - 1 = 11
    # tokens in whole blocks: 2 blocks, 8 tokens; it computes 4. A 13-token prompt C sharing A's 12
    # reuses (13 - 1) // 4 = 3 blocks, 12 tokens, and computes 1.
    state = cached_state(100, 4)
    p = policy()
    add_content(state, 0, (100, 7, 12), 1)
    drive(p, state)
    b = add_content(state, 1, (101, 7, 12), 1)
    c = add_content(state, 2, (102, 7, 12, 9, 1), 1)
    batch = p.schedule(state, 10.0)
    assert batch.items == (BatchItem(1, 4, 8), BatchItem(2, 1, 12))
    assert (b.num_cached_tokens, c.num_cached_tokens) == (8, 12)


def test_skip_a_request_whose_next_block_another_request_is_computing():
    # A and B share their first 2 blocks, nothing is cached. A's first uncached block is its block 0;
    # B's is the same block: B is passed over (its blocks and its 12 tokens would fit), so that it can
    # reuse A's blocks next step.
    state = cached_state(100, 4)
    add_content(state, 0, (100, *SHARED, 11, 4), 5)
    b = add_content(state, 1, (101, *SHARED, 12, 4), 5)
    first = policy().schedule(state, 0.0)
    assert first.items == (BatchItem(0, 12, 0),) and ids(state.waiting) == [1]
    state.commit(first, 1.0)
    # Step 2: A's blocks are cached; B's first uncached block is its own block 2: admitted, reusing
    # 8 tokens. Its budget was charged before the lookup: 1 (A's decode) + 12 = 13 <= 13.
    second = policy(max_num_tokens=13).schedule(state, 1.0)
    assert second.items == (BatchItem(0, 1, 12), BatchItem(1, 4, 8)) and b.num_cached_tokens == 8


def test_without_reuse_both_prefill_in_one_step():
    # the same two requests, enable_block_reuse off (a counting pool): no skip, no hit
    state = make_state(num_blocks=100, block_size=4)
    add(state, 0, 12, 5), add(state, 1, 12, 5)
    assert policy(enable_block_reuse=False).schedule(state, 0.0).items == (BatchItem(0, 12, 0), BatchItem(1, 12, 0))


def test_reuse_does_not_lower_the_budget_the_prefill_was_charged():
    # As above, but max_num_tokens 12: A's decode + B's whole 12-token prompt = 13 > 12, so B waits,
    # though it would compute only 4 tokens (the budget is charged before the lookup).
    state = cached_state(100, 4)
    p = policy(max_num_tokens=12)
    add_content(state, 0, (100, *SHARED, 11, 4), 5)
    add_content(state, 1, (101, *SHARED, 12, 4), 5)
    state.commit(p.schedule(state, 0.0), 1.0)
    assert p.schedule(state, 1.0).items == (BatchItem(0, 1, 12),) and ids(state.waiting) == [1]


def test_a_reused_first_chunk_moves_past_the_hit():
    # 8 tokens of B's 20-token prompt are cached (A's prefix). Chunked, max_num_tokens 8: the scheduler
    # sizes B's first chunk before the lookup: 8 tokens; the hit then moves it to tokens 8-15 (ends on
    # a block boundary, 8 + 8 = 16 < 20), so B still computes 8 tokens in that step, then its last 4.
    state = cached_state(100, 4)
    p = policy(max_num_tokens=8, tokens_per_block=4, enable_chunked_prefill=True)
    add_content(state, 0, (100, 7, 8, 11, 1), 1)               # prompt 9: caches its 2 full blocks
    drive(p, state)
    add_content(state, 1, (101, 7, 8, 12, 12), 3)
    steps = drive(p, state)
    assert steps[:2] == [(BatchItem(1, 8, 8),), (BatchItem(1, 4, 16),)]
    # the rule itself: a hit of 8, chunk 8, prompt 20, blocks of 4 -> 16 // 4 * 4 - 8 = 8; a chunk that
    # reaches the end computes the rest: hit 8, chunk 16 -> 20 - 8 = 12
    assert reused_chunk(8, 8, 20, 4) == 8 and reused_chunk(8, 16, 20, 4) == 12 and reused_chunk(0, 5, 20, 4) == 5


def test_a_chunked_prefill_is_reusable_only_once_its_last_chunk_is_scheduled():
    # A: a 16-token prompt, max_num_tokens 12: chunk min(16, 12) = 12. Then B arrives, sharing A's
    # first 8 tokens. A's computed blocks are not stored before its last chunk, so B's first uncached
    # block is A's block 0, which A (an unfinished prefill) produces: B is passed over. Without the
    # skip, FCFS would give A its last 4 and B min(12, 12 - 4) = 8 tokens.
    state = cached_state(100, 4)
    p = policy(max_num_tokens=12, tokens_per_block=4, enable_chunked_prefill=True)
    add_content(state, 0, (100, 7, 16), 2)
    first = p.schedule(state, 0.0)
    assert first.items == (BatchItem(0, 12, 0),)
    state.commit(first, 1.0)
    b = add_content(state, 1, (101, 7, 8, 12, 4), 2)
    second = p.schedule(state, 1.0)
    assert second.items == (BatchItem(0, 4, 12),) and ids(state.waiting) == [1]
    state.commit(second, 2.0)
    # A's last chunk was scheduled: its 4 prompt blocks are stored; B reuses 8 tokens, computes 4
    assert p.schedule(state, 2.0).items == (BatchItem(0, 1, 16), BatchItem(1, 4, 8)) and b.num_cached_tokens == 8

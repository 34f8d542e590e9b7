"""LMDeploy 0.18.0's PyTorch engine (policies/lmdeploy.py), on hand-built states, with the
token and block arithmetic in comments."""

from __future__ import annotations

import dataclasses

import pytest
from conftest import add, linear_profile, make_state, simulate

from policies import make_policy
from policies.lmdeploy import LmdeployConfig, LmdeployPolicy
from policies.lmdeploy_queue import requeue_by_arrival
from sim.core.batch import Batch, BatchItem
from sim.core.policy import KvMemory, PolicyContext
from sim.core.prefix import PrefixCachePool
from sim.core.request import Request, Status
from sim.core.state import SchedulerState
from sim.run.runner import policy_context

GIB = 1024**3
CTX = PolicyContext(max_model_len=1 << 16)


def lmdeploy(**knobs) -> LmdeployPolicy:
    return LmdeployPolicy(LmdeployConfig(**knobs), CTX)


def decoding(state, req_id: int, prompt: int, outputs: int = 1, true_output: int = 100,
             arrival_s: float = 0.0) -> Request:
    """A running request that sampled ``outputs`` tokens and decodes next, holding the blocks of its
    computed tokens only (so its next decode may need a block)."""
    r = add(state, req_id, prompt, true_output, arrival_s=arrival_s)
    computed = prompt + outputs - 1
    state.kv.allocate(r, computed)
    state.admit(r, 0.0)
    r.num_computed_tokens, r.num_output_tokens = computed, outputs
    return r


def kind(batch) -> str:
    assert isinstance(batch, Batch), batch
    return "decode" if batch.num_prefill_tokens == 0 else "prefill"


# ---- declarations ------------------------------------------------------------------------------
def test_defaults_follow_lmdeploys_config_and_the_gpu():
    p = lmdeploy()
    assert (p.token_budget, p.max_num_seqs, p.block_size) == (8192, 128, 64)
    assert p.kv_memory == KvMemory(0.8, "free") and p.num_reserved_blocks == 1
    assert not p.kv_pool_class.caching
    # utils.get_max_batch_size: 1024 on H100/H200, 384 on A100, 128 elsewhere
    profile = linear_profile()
    for device, size in (("NVIDIA H200", 1024), ("NVIDIA H100 80GB HBM3", 1024),
                         ("NVIDIA A100-SXM4-80GB", 384), ("NVIDIA L40S", 128)):
        prof = dataclasses.replace(profile, device=device, memory_bytes_per_gpu=80 * GIB)
        policy = make_policy(LmdeployConfig(), policy_context(4096, prof))
        assert policy.max_num_seqs == size and policy.knobs()["max_batch_size"] == size, device


def test_engine_refuses_what_pytorchengineconfig_asserts():
    with pytest.raises(ValueError, match=r"cache_max_entry_count must be in \(0, 1\)"):
        lmdeploy(cache_max_entry_count=1.0)
    with pytest.raises(ValueError, match="block_size must be a power of 2 >= 16"):
        lmdeploy(block_size=48)


# ---- rule 1: prefill or decode -------------------------------------------------------------------
def test_nothing_waiting_decodes():
    st = make_state(block_size=16)
    decoding(st, 0, 10)
    assert kind(lmdeploy().schedule(st, 0.0)) == "decode"


def test_fewer_than_half_max_batch_size_running_prefills_at_once():
    # 3 running < 8 x 0.5 = 4: the waiting prompt is prefilled, alone (the running ones pause)
    st = make_state(block_size=16)
    for i in range(3):
        decoding(st, i, 10)
    add(st, 3, 10, 5)
    b = lmdeploy(max_batch_size=8).schedule(st, 0.0)
    assert b.items == (BatchItem(3, 10, 0),)


def test_prefill_interval_consecutive_decodes_force_a_prefill():
    # 4 running, not < 8 x 0.5; 10 waiting tokens < 8192: decode, counting. The 16th decode makes
    # the count 16 = prefill_interval, so the 17th step prefills and resets it.
    st = make_state(block_size=16)
    p = lmdeploy(max_batch_size=8)
    for i in range(4):
        decoding(st, i, 10)
    add(st, 4, 10, 5)
    t = 0.0
    for step in range(16):
        b = p.schedule(st, t)
        assert kind(b) == "decode" and b.decode_seqs == 4, step
        t += 1.0
        st.commit(b, t)
    assert p.schedule(st, t).items == (BatchItem(4, 10, 0),)
    assert p._decode_count == 0


def test_waiting_tokens_reaching_max_prefill_token_num_prefill_within_its_budget():
    # 4 running of max_batch_size 8; waiting 60 + 50 = 110 >= 100: prefill. The first request always
    # goes, the second would make 60 + 50 = 110 > 100 tokens: the scan stops.
    st = make_state(block_size=16)
    for i in range(4):
        decoding(st, i, 10)
    add(st, 4, 60, 5)
    add(st, 5, 50, 5)
    b = lmdeploy(max_batch_size=8, max_prefill_token_num=100).schedule(st, 0.0)
    assert b.items == (BatchItem(4, 60, 0),)


# ---- rule 2: prefill admission -------------------------------------------------------------------
def test_a_prefill_needs_blocks_for_its_tokens_plus_the_prealloc_and_stops_at_the_first_misfit():
    # 10 blocks of 16, prealloc prefill_interval = 16: A 60 + 16 = 76 tokens = 5 blocks (5 left),
    # B 30 + 16 = 46 = 3 blocks (2 left), C 20 + 16 = 36 = 3 blocks > 2: stops, D (1 block) waits too
    st = make_state(num_blocks=10, block_size=16)
    for i, prompt in enumerate((60, 30, 20, 1)):
        add(st, i, prompt, 5)
    b = lmdeploy(block_size=16).schedule(st, 0.0)
    assert b.items == (BatchItem(0, 60, 0), BatchItem(1, 30, 0))
    assert st.kv.num_free_blocks == 2 and [r.req_id for r in st.waiting] == [2, 3]


def test_the_prefill_prealloc_is_cut_at_the_pool():
    # 4 blocks of 16 = 64 tokens; prompt 50 + max_tokens 14 = 64 fits the pool, but 50 + 16 = 66
    # tokens of prealloc would need 5 blocks: cut to the pool's 64 (LMDeploy itself would wait forever)
    st = make_state(num_blocks=4, block_size=16)
    r = add(st, 0, 50, 14)
    assert lmdeploy(block_size=16).schedule(st, 0.0).items == (BatchItem(0, 50, 0),)
    assert len(r.block_ids) == 4


# ---- rule 3: decode and preemption ---------------------------------------------------------------
def test_a_decode_that_cannot_grow_preempts_itself_newest_first():
    # Ported from lmdeploy tests/pytorch/paging/test_scheduler.py, TestScheduler.test_evict ("test
    # running append"): 4 blocks of 16; seq1 holds 1 block, seq2 3, both full, both need one more.
    # schedule_running walks from the newest: seq2 finds no free block and is evicted (back to
    # WAITING, 3 blocks freed); seq1 then takes one: 2 blocks free, as the LMDeploy test asserts.
    st = make_state(num_blocks=4, block_size=16)
    seq1 = decoding(st, 0, 16, true_output=10)       # computed 16 = 1 full block
    seq2 = decoding(st, 1, 48, true_output=16)       # computed 48 = 3 full blocks
    b = lmdeploy(block_size=16).schedule(st, 0.0)
    assert b.items == (BatchItem(0, 1, 16),)
    assert seq2.status == Status.PREEMPTED and seq2.block_ids == [] and list(st.waiting) == [seq2]
    assert len(seq1.block_ids) == 2 and st.kv.num_free_blocks == 2


def test_the_newest_is_served_first_so_an_older_request_can_be_the_victim():
    # 5 blocks of 16: A (oldest) and B hold 2 full blocks each, 1 is free. B, walked first, takes
    # it (16 + 32 = 48 tokens = 3 blocks); A finds none and preempts itself.
    st = make_state(num_blocks=5, block_size=16)
    a = decoding(st, 0, 32, true_output=20)
    b_ = decoding(st, 1, 32, true_output=20)
    b = lmdeploy(block_size=16).schedule(st, 0.0)
    assert b.items == (BatchItem(1, 1, 32),)
    assert a.status == Status.PREEMPTED and len(b_.block_ids) == 3


def test_preempted_requests_wait_in_arrival_order():
    # LMDeploy sorts the waiting queue by arrive_time. A (t=0) is preempted, then B (t=1): the
    # state puts each at the front ([B, A, C]); requeue_by_arrival moves B behind A: [A, B, C]
    st = make_state(num_blocks=100, block_size=16)
    a = decoding(st, 0, 32, arrival_s=0.0)
    b_ = decoding(st, 1, 32, arrival_s=1.0)
    c = add(st, 2, 8, 5, arrival_s=2.0)
    for r in (a, b_):
        st.preempt(r)
        requeue_by_arrival(st.waiting)
    assert list(st.waiting) == [a, b_, c]


# ---- rule 4: long prompts ------------------------------------------------------------------------
def test_a_long_prompt_is_chunked_and_a_chunk_never_follows_a_chunk():
    # max_prefill_token_num 100, prompt 250: chunks 100, 100, then the last 50. With a request
    # decoding, a non-final chunk after a chunk defers to a decode; the last chunk runs at once
    # (do_prefill is true while it is pending), then both decode.
    st = make_state(block_size=16)
    decoding(st, 0, 10)
    add(st, 1, 250, 5)
    p = lmdeploy(max_prefill_token_num=100, max_batch_size=8)
    expected = [(1, 100, 0), "decode", (1, 100, 100), (1, 50, 200), "decode"]
    t = 0.0
    for want in expected:
        b = p.schedule(st, t)
        if want == "decode":
            assert kind(b) == "decode" and b.decode_seqs == 1 + (t > 3.0), t
        else:
            assert b.items == (BatchItem(*want),), t
        t += 1.0
        st.commit(b, t)
    # the chunks hold just their tokens; the last one its whole prompt + the 16-token prealloc
    assert len(st.requests[1].block_ids) == -(-(250 + 16) // 16)


def test_a_long_prompt_goes_only_first_and_alone():
    # 60 first, then the 250-token prompt's first chunk would make 60 + 100 > 100: the scan stops
    st = make_state(block_size=16)
    add(st, 0, 60, 5)
    add(st, 1, 250, 5)
    p = lmdeploy(max_prefill_token_num=100)
    assert p.schedule(st, 0.0).items == (BatchItem(0, 60, 0),)


def test_with_a_long_prompt_waiting_short_prompts_go_first_smallest_first():
    # max_prefill_token_num 100; L (250 tokens) waits first. The long turn is not due (no short turn
    # yet): a short-only turn admits the normal prompts smallest first, 30 + 50 = 80 <= 100; the
    # next prefill finds only L, so its long turn runs L's first chunk of 100
    st = make_state(block_size=16)
    add(st, 0, 250, 5, arrival_s=0.0)
    add(st, 1, 50, 5, arrival_s=1.0)
    add(st, 2, 30, 5, arrival_s=2.0)
    p = lmdeploy(max_prefill_token_num=100)
    b = p.schedule(st, 2.0)
    assert b.items == (BatchItem(2, 30, 0), BatchItem(1, 50, 0))
    st.commit(b, 3.0)
    assert p.schedule(st, 3.0).items == (BatchItem(0, 100, 0),)    # 250 >= 100 waiting tokens: prefill


def test_after_three_short_turns_the_long_prompt_goes_first():
    # LMDEPLOY_PT_TTFT_SHORT_TURNS = 3 short prefills since the last long chunk make the long turn
    # due: the long-first order puts L ahead of the shorter S, and a long prompt ends the scan
    st = make_state(block_size=16)
    add(st, 0, 250, 5, arrival_s=0.0)
    add(st, 1, 30, 5, arrival_s=1.0)
    p = lmdeploy(max_prefill_token_num=100)
    p._short_turns = 3
    assert p.schedule(st, 1.0).items == (BatchItem(0, 100, 0),)


# ---- rule 6: prefix caching ----------------------------------------------------------------------
def test_cached_full_blocks_cost_no_prefill_budget():
    st = SchedulerState(PrefixCachePool(100, 16), 1 << 16)
    p = lmdeploy(block_size=16, enable_prefix_caching=True, max_prefill_token_num=100)
    a = Request(0, 0.0, 64, 1, content=(900, 7, 64))
    assert st.add_arrival(a, 1, 0.0)
    st.commit(p.schedule(st, 0.0), 1.0)              # a is prefilled and done: 4 blocks cached
    assert a.status == Status.FINISHED
    # b starts with a's 64 tokens (4 full blocks), then 30 of its own: 30 to compute, so c (70)
    # fits the budget beside it: 30 + 70 = 100; uncached, 94 + 70 = 164 > 100 would stop at b
    b = Request(1, 1.0, 94, 5, content=(901, 7, 64, 8, 30))
    c = Request(2, 1.0, 70, 5, content=(902, 9, 70))
    assert st.add_arrival(b, 5, 1.0) and st.add_arrival(c, 5, 1.0)
    assert p.schedule(st, 1.0).items == (BatchItem(1, 30, 64), BatchItem(2, 70, 0))


# ---- the loop's fast path under the non-default knobs (the CASES runs use the defaults) --------
@pytest.mark.parametrize("policy", [{"kind": "lmdeploy", "block_size": 16},
                                    {"kind": "lmdeploy", "block_size": 16, "prefill_interval": 32},
                                    {"kind": "lmdeploy", "block_size": 16, "max_prefill_token_num": 128},
                                    {"kind": "lmdeploy", "block_size": 16, "enable_prefix_caching": True}])
def test_fast_path_keeps_lmdeploys_steps(policy: dict) -> None:
    # 120 blocks x 16 = 1,920 token slots for requests of up to 700 tokens: decodes preempt; with a
    # prefill_interval of 32 a decode preallocates 2 blocks (no stretch); 128-token chunks
    from test_policy_tgi import checked_equals_fast, tight

    from sim.run.config import workload_from_dict
    summary = checked_equals_fast(lambda: workload_from_dict(tight(policy, 120)))
    assert summary["completed"] == 120 and summary["num_preemptions"] > 0


def test_a_one_token_last_chunk_is_not_taken_for_a_decode_by_the_fast_path():
    # Found by the fast-path check (tests/loop/test_stretch_check.py): request 0 (250-token prompt)
    # is preempted and recomputes prompt + 79 outputs = 329 tokens in 8-token chunks
    # (max_prefill_token_num 8) on 8-token pages; its last chunk is 1 token, which looks like a
    # decode, but preallocates prefill_interval more: 328 + 1 + 8 = 337 tokens = 43 blocks, 2 more
    # than the 41 it holds, where a decode takes 1. The stretch must not plan that step.
    cfg = LmdeployConfig(max_batch_size=2, max_prefill_token_num=8, prefill_interval=8, block_size=16)
    specs = [(0.0, 250, 80), (0.03125, 110, 68)]
    checked, reqs = simulate(specs, cfg, num_blocks=64, block_size=8, max_model_len=512, check_stretch=True)
    assert reqs[0].num_preemptions >= 1 and [r.num_output_tokens for r in reqs] == [80, 68]

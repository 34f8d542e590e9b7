"""TGI router v3 (policies/tgi.py), on hand-built states, with the token arithmetic in comments."""

from __future__ import annotations

import pytest
from conftest import add, make_state

from policies.tgi import TgiConfig, TgiPolicy
from sim.core.batch import Batch, BatchItem, Idle
from sim.core.policy import KvMemory, PolicyContext
from sim.core.prefix import PrefixCachePool
from sim.core.request import Request, Status
from sim.core.state import SchedulerState

CTX = PolicyContext(max_model_len=1 << 16)


def tgi(**knobs) -> TgiPolicy:
    return TgiPolicy(TgiConfig(**knobs), CTX)


def decoding(state, req_id: int, prompt: int, outputs: int, true_output: int = 100) -> Request:
    """A running request that has sampled ``outputs`` tokens and decodes next, holding TGI's
    reservation of prompt + max_new_tokens - 1 tokens."""
    r = add(state, req_id, prompt, true_output)
    state.kv.allocate(r, prompt + true_output - 1)
    state.admit(r, 0.0)
    r.num_computed_tokens, r.num_output_tokens = prompt + outputs - 1, outputs
    return r


def items_of(decision) -> tuple:
    assert isinstance(decision, Batch), decision
    return decision.items


# ---- declarations ------------------------------------------------------------------------------
def test_attention_sets_the_page_and_chunking_and_memory_is_095_of_free():
    # launcher resolve_attention / Attention::block_size: flashinfer 1, flashdecoding 256, paged 16
    for attention, page, chunking in (("flashinfer", 1, True), ("flashdecoding", 256, True), ("paged", 16, False)):
        p = tgi(attention=attention)
        assert (p.block_size, p.chunking) == (page, chunking)
        assert p.kv_memory == KvMemory(0.95, "free") and p.num_reserved_blocks == 1
    # without chunking the launcher requires max_input_tokens <= max_batch_prefill_tokens
    assert tgi(attention="paged").max_prompt_tokens == 4096 and tgi().max_prompt_tokens is None
    assert (tgi().token_budget, tgi().max_num_seqs) == (4096, 128)


def test_bad_attention_and_prefix_caching_on_paged_are_refused():
    with pytest.raises(ValueError, match="attention must be one of flashinfer, flashdecoding, paged"):
        tgi(attention="sdpa")
    with pytest.raises(ValueError, match="prefix_caching needs attention flashinfer or flashdecoding"):
        tgi(attention="paged", prefix_caching=True)


def test_enable_prefix_caching_points_to_tgis_own_knob():
    from policies.config import policy_config
    from sim.base.strict import ConfigError
    with pytest.raises(ConfigError, match="policy tgi names it 'policy.prefix_caching'"):
        policy_config({"kind": "tgi", "enable_prefix_caching": True}, "w.yaml")
    assert policy_config({"kind": "tgi", "prefix_caching": True}, "w.yaml").prefix_caching


# ---- with chunking (flashinfer, 1-token pages) ----------------------------------------------------
def test_new_prefills_join_the_running_batch_and_the_overflowing_prompt_is_cut():
    st = make_state(num_blocks=10_000, block_size=1)
    p = tgi(max_batch_prefill_tokens=100)
    for i in range(3):
        decoding(st, i, 10, 1)
    add(st, 3, 40, 5)
    add(st, 4, 80, 5)
    # the cached batch: 3 decodes = 3 tokens; room 100 - 3 = 97; A (40) fits, 40 + 80 = 120 > 97:
    # B is cut to 97 - 40 = 57 tokens and ends the scan. One mixed step.
    b = p.schedule(st, 0.0)
    assert items_of(b) == (BatchItem(0, 1, 10), BatchItem(1, 1, 10), BatchItem(2, 1, 10),
                           BatchItem(3, 40, 0), BatchItem(4, 57, 0))
    assert b.num_tokens == 100
    st.commit(b, 1.0)
    add(st, 5, 80, 5)
    # next step: the shard sized B's chunk with the 5 requests of the last step: 100 - (5 - 1) = 96,
    # B has 80 - 57 = 23 left -> 23; the batch is 4 decodes + 23 = 27 tokens, room 73: C is cut to 73
    b = p.schedule(st, 1.0)
    assert items_of(b) == (BatchItem(0, 1, 11), BatchItem(1, 1, 11), BatchItem(2, 1, 11),
                           BatchItem(3, 1, 40), BatchItem(4, 23, 57), BatchItem(5, 73, 0))


def test_a_cut_prompts_next_chunk_counts_the_requests_that_just_finished():
    st = make_state(num_blocks=10_000, block_size=1)
    p = tgi(max_batch_prefill_tokens=100)
    decoding(st, 0, 5, 1, true_output=2)            # samples its last token in the first step
    decoding(st, 1, 5, 1)
    add(st, 2, 1000, 5)
    # 2 decodes, room 98: the 1,000-token prompt is cut to 98
    b = p.schedule(st, 0.0)
    assert items_of(b) == (BatchItem(0, 1, 5), BatchItem(1, 1, 5), BatchItem(2, 98, 0))
    st.commit(b, 1.0)
    assert [r.req_id for r in st.running] == [1, 2]
    add(st, 3, 10, 5)
    # generate_token sized the chunk before request 0 left: 100 - (3 - 1) = 98 (not 99);
    # the batch is 1 + 98 = 99 tokens, so the new request gets a 1-token chunk
    b = p.schedule(st, 1.0)
    assert items_of(b) == (BatchItem(1, 1, 6), BatchItem(2, 98, 98), BatchItem(3, 1, 0))


def test_the_whole_reservation_must_fit_and_the_first_misfit_stops_the_scan():
    # 100 blocks of 1 token; the running request holds 10 + 41 - 1 = 50 of them
    st = make_state(num_blocks=100, block_size=1)
    p = tgi()
    r = decoding(st, 0, 10, 1, true_output=41)
    add(st, 1, 30, 30)                               # 30 + 30 - 1 = 59 blocks > 50 free
    add(st, 2, 5, 5)                                 # 9 blocks would fit, but FCFS stops at 1
    assert items_of(p.schedule(st, 0.0)) == (BatchItem(0, 1, 10),)
    assert st.kv.num_free_blocks == 50               # decodes allocate nothing: all reserved
    # once request 0 has finished, 59 + 9 = 68 <= 100: both join
    st.commit(p.schedule(st, 0.0), 1.0)
    r.num_output_tokens, r.num_computed_tokens = 40, 49          # one decode left
    st.commit(Batch((BatchItem(0, 1, 49),)), 2.0)
    assert r.status == Status.FINISHED and st.kv.num_free_blocks == 100
    assert items_of(p.schedule(st, 2.0)) == (BatchItem(1, 30, 0), BatchItem(2, 5, 0))
    assert st.kv.num_free_blocks == 100 - 59 - 9


def test_max_concurrent_requests_caps_the_running_batch():
    st = make_state(num_blocks=10_000, block_size=1)
    p = tgi(max_concurrent_requests=2)
    for i in range(3):
        add(st, i, 10, 5)
    assert [it.req_id for it in items_of(p.schedule(st, 0.0))] == [0, 1]
    assert [r.req_id for r in st.waiting] == [2]


def test_a_cached_prefix_costs_no_budget_and_a_whole_prompt_recomputes_one_token():
    st = SchedulerState(PrefixCachePool(10_000, 1), 1 << 16)
    p = tgi(max_batch_prefill_tokens=100, prefix_caching=True)
    a = Request(0, 0.0, 50, 1, content=(900, 7, 50))
    assert st.add_arrival(a, 1, 0.0)
    st.commit(p.schedule(st, 0.0), 1.0)              # a's prefill samples its only token: finished
    assert a.status == Status.FINISHED
    # b shares a's first 30 tokens (key 7); c is a's whole prompt
    b = Request(1, 1.0, 50, 5, content=(901, 7, 30, 8, 20))
    c = Request(2, 1.0, 50, 5, content=(902, 7, 50))
    assert st.add_arrival(b, 5, 1.0) and st.add_arrival(c, 5, 1.0)
    # b: 30 tokens cached, 20 to compute; c: 49 cached (at least one token of postfix), 1 to compute
    assert items_of(p.schedule(st, 1.0)) == (BatchItem(1, 20, 30), BatchItem(2, 1, 49))
    assert st.kv.hits == 30 + 49


# ---- without chunking (paged, 16-token pages) -----------------------------------------------------
def test_a_prefill_joins_only_when_enough_wait_or_after_max_waiting_tokens_decodes():
    st = make_state(num_blocks=10_000, block_size=16)
    p = tgi(attention="paged")
    for i in range(10):
        add(st, i, 10, 100)
    b = p.schedule(st, 0.0)                          # nothing runs: the 10 prompts, alone
    assert [it.num_new_tokens for it in items_of(b)] == [10] * 10
    st.commit(b, 1.0)
    add(st, 10, 10, 100)
    add(st, 11, 10, 100)
    # min_size = floor(10 x 0.3) = 3 > 2 waiting: decode. waiting_tokens is 1 after the prefill and
    # grows by one per decode; at 20 (= max_waiting_tokens) min_size is none: 19 decodes, then the join
    t = 1.0
    for step in range(19):
        b = p.schedule(st, t)
        assert b.decode_seqs == 10 and b.num_prefill_tokens == 0, step
        t += 1.0
        st.commit(b, t)
    b = p.schedule(st, t)
    assert items_of(b) == (BatchItem(10, 10, 0), BatchItem(11, 10, 0))    # the running batch pauses
    st.commit(b, t + 1.0)
    b = p.schedule(st, t + 1.0)                      # a joining prefill is always followed by a decode
    assert b.decode_seqs == 12 and b.num_prefill_tokens == 0


def test_enough_waiting_requests_pause_the_batch_at_once():
    st = make_state(num_blocks=10_000, block_size=16)
    p = tgi(attention="paged")
    for i in range(10):
        add(st, i, 10, 100)
    st.commit(p.schedule(st, 0.0), 1.0)
    for i in range(10, 13):                          # 3 >= floor(10 x 0.3) = 3
        add(st, i, 10, 100)
    assert [it.req_id for it in items_of(p.schedule(st, 1.0))] == [10, 11, 12]


def test_the_assembled_batch_must_reach_min_size_or_nobody_joins():
    # 10 running: min_size floor(10 x 0.3) = 3; 3 wait, but the budget
    # (100 tokens) takes only 60 + 30 = 90 of them (+ 60 = 150 > 100), 2 < 3: all go back
    st = make_state(num_blocks=10_000, block_size=16)
    p = tgi(attention="paged", max_batch_prefill_tokens=100)
    for i in range(10):
        add(st, i, 10, 100)
    st.commit(p.schedule(st, 0.0), 1.0)
    for i, prompt in zip(range(10, 13), (60, 30, 60)):
        add(st, i, prompt, 100)
    b = p.schedule(st, 1.0)
    assert b.decode_seqs == 10 and [r.req_id for r in st.waiting] == [10, 11, 12]
    assert st.kv.num_free_blocks == 10_000 - 10 * 7          # (10 + 100 - 1) / 16 -> 7 blocks each


def test_the_prefill_budget_is_padded_to_the_block_size():
    # paged: 100 -> 112 (7 blocks of 16): 60 + 50 = 110 <= 112, both prefill together
    st = make_state(num_blocks=10_000, block_size=16)
    add(st, 0, 60, 5)
    add(st, 1, 50, 5)
    assert items_of(tgi(attention="paged", max_batch_prefill_tokens=100).schedule(st, 0.0)) == (
        BatchItem(0, 60, 0), BatchItem(1, 50, 0))
    # flashinfer pages are 1 token: 100 stays 100, and the second prompt is cut to 40
    st = make_state(num_blocks=10_000, block_size=1)
    add(st, 0, 60, 5)
    add(st, 1, 50, 5)
    assert items_of(tgi(max_batch_prefill_tokens=100).schedule(st, 0.0)) == (BatchItem(0, 60, 0),
                                                                              BatchItem(1, 40, 0))


def test_without_chunking_a_prompt_over_the_prefill_budget_is_refused():
    st = make_state(num_blocks=10_000, block_size=16, max_prompt_tokens=tgi(attention="paged",
                                                                             max_batch_prefill_tokens=64)
                    .max_prompt_tokens)
    r = Request(0, 0.0, 65, 5)
    assert not st.add_arrival(r, 5, 0.0) and r.reject_reason == "prompt_limit"
    assert isinstance(tgi(attention="paged").schedule(st, 0.0), Idle)


# ---- ported from TGI's own queue tests (backends/v3/src/queue.rs, mod tests) --------------------
def tgi_queue_state(num_entries: int) -> SchedulerState:
    """queue.rs's test state: State::new(requires_padding false, block_size 1, no prefix caching,
    speculate 0, max_batch_total_tokens 16, no chunking): 16 one-token blocks, block 0 kept; its
    default_entry has input_length 1 and max_new_tokens 1 (a 1 + 1 - 1 = 1-block reservation)."""
    st = make_state(num_blocks=16 - 1, block_size=1)
    for i in range(num_entries):
        add(st, i, 1, 1)
    return st


def test_next_batch_token_budget_as_queue_rs():
    # test_next_batch_token_budget: a prefill budget of 1 takes entry 0 only (1 + 1 = 2 > 1); with a
    # third entry appended, a budget of 3 takes entries 1 and 2
    st = tgi_queue_state(2)
    p = tgi(attention="paged")
    assert [it.req_id for it in p._next_batch(st, 0.0, 1, None)] == [0]
    add(st, 2, 1, 1)
    assert [it.req_id for it in p._next_batch(st, 0.0, 3, None)] == [1, 2]
    assert not st.waiting and st.kv.num_free_blocks == 15 - 3


def test_next_batch_min_size_as_queue_rs():
    # test_next_batch_min_size: both entries go with no min_size; then with one entry queued,
    # min_size 2 gives nothing and leaves it queued (id 2)
    st = tgi_queue_state(2)
    p = tgi(attention="paged")
    assert [it.req_id for it in p._next_batch(st, 0.0, 2, None)] == [0, 1]
    add(st, 2, 1, 1)
    assert p._next_batch(st, 0.0, 2, 2) == [] and [r.req_id for r in st.waiting] == [2]
    # test_queue_next_batch_min_size: min_size 1 then takes it
    assert [it.req_id for it in p._next_batch(st, 0.0, 2, 1)] == [2]


def test_next_batch_max_size_as_queue_rs():
    # test_next_batch_max_size: max_size 1 (here the running cap) takes entry 0, entry 1 stays
    st = tgi_queue_state(2)
    assert [it.req_id for it in tgi(attention="paged", max_concurrent_requests=1)._next_batch(st, 0.0, 2, None)] == [0]
    assert [r.req_id for r in st.waiting] == [1]


# ---- the loop's fast path under the non-default knobs (the CASES runs use the defaults) --------
def tight(policy: dict, num_blocks: int) -> dict:
    """Long outputs on a small KV pool (tests/loop/test_fast_path.py's tight workload), in the
    policy's own pages (TGI's and LMDeploy's pages are knobs of theirs, not server.block_size)."""
    return {"name": "tight", "seed": 3, "num_requests": 120,
            "arrivals": {"kind": "gamma", "rate": 40.0, "cv": 2.0},
            "lengths": {"kind": "uniform", "prompt_min": 16, "prompt_max": 300, "output_min": 20, "output_max": 400},
            "policy": policy, "server": {"num_blocks": num_blocks, "max_model_len": 1024},
            "profile": {"model": "llama-2-7b", "gpu": "a100-80gb"}}


def checked_equals_fast(make_cfg) -> dict:
    """Run with every stretch stepped through the policy and checked, then on the fast path: the
    same results; returns the summary."""
    import pandas as pd

    from sim.run.runner import run_workload
    checked = run_workload(make_cfg(), check_stretch=True)
    fast = run_workload(make_cfg())
    for name in ("requests", "steps", "tokens"):
        pd.testing.assert_frame_equal(getattr(checked, name), getattr(fast, name), check_exact=True, obj=name)
    assert checked.summary == fast.summary
    return fast.summary


@pytest.mark.parametrize("policy,num_blocks", [({"kind": "tgi"}, 1920), ({"kind": "tgi", "attention": "paged"}, 120),
                                               ({"kind": "tgi", "attention": "flashdecoding"}, 8),
                                               ({"kind": "tgi", "prefix_caching": True}, 1920)])
def test_fast_path_keeps_tgis_steps(policy: dict, num_blocks: int) -> None:
    # 1,920 token slots under each page size (1 token x 1920, 16 x 120, 256 x 8 blocks)
    from sim.run.config import workload_from_dict
    summary = checked_equals_fast(lambda: workload_from_dict(tight(policy, num_blocks)))
    assert summary["completed"] == 120 and summary["num_preemptions"] == 0     # reserved at admission


def test_fast_path_keeps_tgis_steps_with_shared_prefixes() -> None:
    from pathlib import Path

    from sim.run.config import load_workload
    path = Path(__file__).resolve().parents[2] / "workloads" / "prefix_repetition.yaml"
    summary = checked_equals_fast(lambda: load_workload(path, {"num_requests": 150, "policy.kind": "tgi",
                                                               "policy.prefix_caching": True}))
    assert summary["prefix_cache_hits"] > 0

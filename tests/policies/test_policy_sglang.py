"""SGLang's scheduler (policies.sglang), with the token arithmetic in comments."""

from __future__ import annotations

from collections import deque

import pytest

from policies.config import policy_config
from policies.sglang import SglangConfig, SglangPolicy
from policies.sglang_defaults import engine_defaults
from policies.sglang_queue import order_waiting
from sim.base.strict import ConfigError
from sim.core.batch import Batch, BatchItem, Idle
from sim.core.policy import PolicyContext
from sim.core.radix import RadixCachePool, TokenPool
from sim.core.request import Request, Status
from sim.core.state import SchedulerState

GIB = 1024**3


def make(num_tokens: int = 10_000, page: int = 1, max_model_len: int = 4096, **knobs):
    # step() commits each batch before the next is chosen: the synchronous loop (event_loop_normal)
    knobs.setdefault("enable_overlap", False)
    policy = SglangPolicy(SglangConfig(page_size=page, **knobs), PolicyContext(max_model_len))
    return SchedulerState(RadixCachePool(num_tokens // page, page), max_model_len), policy


def add(state, i, prompt, output, max_tokens=None, content=None, arrival_s=0.0) -> Request:
    r = Request(i, arrival_s, prompt, max_tokens if max_tokens is not None else output, content=content)
    assert state.add_arrival(r, output, arrival_s)
    return r


def step(state, policy, t):
    batch = policy.schedule(state, t)
    state.commit(batch, t + 1.0)
    return batch


def test_max_prefill_tokens_is_checked_after_each_admission_so_the_last_one_overshoots():
    state, policy = make(max_prefill_tokens=300)
    for i, p in enumerate((100, 150, 200, 50)):
        add(state, i, p, 5)
    b = policy.schedule(state, 0.0)
    # rem_input 300 - 100 = 200 > 0, - 150 = 50 > 0: the 200 still goes in whole (50 - 200 < 0 only
    # stops the next one); the 50 waits.
    assert b.items == (BatchItem(0, 100, 0), BatchItem(1, 150, 0), BatchItem(2, 200, 0))
    assert [r.req_id for r in state.waiting] == [3]


def test_one_chunked_request_and_prefill_before_decode():
    state, policy = make(chunked_prefill_size=64)
    a, b_ = add(state, 0, 100, 5), add(state, 1, 30, 5)
    # a's 100 > 64: its first chunk, 64 tokens; the chunk budget is spent (64 - 64 = 0): b waits
    assert step(state, policy, 0.0).items == (BatchItem(0, 64, 0),)
    assert policy.chunked is a
    # a's rest, 36 (64 - 36 = 28 left); b's 30 > 28: b becomes the chunked request with 28
    assert step(state, policy, 1.0).items == (BatchItem(0, 36, 64), BatchItem(1, 28, 0))
    assert policy.chunked is b_
    # b's last 2: a prefill batch again, so a (prefilled, one token out) does not decode in it
    assert step(state, policy, 2.0).items == (BatchItem(1, 2, 28),)
    assert step(state, policy, 3.0).items == (BatchItem(0, 1, 100), BatchItem(1, 1, 30))
    # a's chunks entered the tree as they were computed; a holds all 100 tokens there now
    assert state.kv.tree.total_tokens == 100 + 30


def test_memory_reserves_running_outputs_times_new_token_ratio_strictly():
    for prompt, admitted in ((299, True), (300, False)):
        state, policy = make(num_tokens=1200, chunked_prefill_size=4096)
        add(state, 0, 100, 900, max_tokens=1000)
        step(state, policy, 0.0)                       # a prefilled: 100 tokens held, 1 output
        add(state, 1, prompt, 100)
        b = policy.schedule(state, 1.0)
        # free 1200 - 100 = 1100; a reserves min(1000 - 1, 4096) x 0.7 = 699.3: 400.7 remain.
        # b needs prompt + 100 + one page: 299 -> 400 < 400.7 admitted; 300 -> 401 not (strict <).
        assert (b.items[0].req_id == 1) is admitted, prompt
        assert policy.batch_is_full is not admitted


def test_the_reservation_clips_max_tokens_at_4096():
    state, policy = make(num_tokens=12_000, max_model_len=16_384, chunked_prefill_size=8192)
    add(state, 0, 10, 9000, max_tokens=9000)
    step(state, policy, 0.0)
    add(state, 1, 6000, 10, max_tokens=10)
    # free 11,990; a reserves min(8999, 4096) x 0.7 = 2867.2: 9122.8 remain > 6000 + 10 + 1
    # (unclipped, 8999 x 0.7 = 6299.3 would leave 5690.7: too few)
    assert policy.schedule(state, 1.0).items == (BatchItem(1, 6000, 0),)


def test_new_token_ratio_starts_from_conservativeness_and_decays_to_its_floor():
    _, policy = make()
    # init min(0.7 x 1.0, 1) = 0.7; floor 0.7 x 0.14 = 0.098; decay (0.7 - 0.098) / 600 per decode
    assert (policy.init_ratio, policy.min_ratio) == (0.7, pytest.approx(0.098))
    assert policy.ratio_decay == pytest.approx(0.602 / 600)
    _, policy = make(schedule_conservativeness=2.0)
    assert (policy.init_ratio, policy.min_ratio) == (1.0, pytest.approx(0.14))
    state, policy = make()
    add(state, 0, 10, 700)
    step(state, policy, 0.0)                           # a prefill: no decay
    for t in range(1, 11):
        step(state, policy, float(t))                  # 10 decodes
    assert policy.new_token_ratio == pytest.approx(0.7 - 10 * 0.602 / 600)
    for t in range(11, 700):
        step(state, policy, float(t))
    assert policy.new_token_ratio == pytest.approx(0.098)     # at its floor after 600 decodes
    assert state.num_finished == 1                             # 1 + 699 decodes: its 700 tokens
    assert isinstance(policy.schedule(state, 700.0), Idle)     # fully idle: on_idle resets the ratio
    assert policy.new_token_ratio == 0.7


def _running(state, specs, max_tokens):
    """Requests admitted and decoding: (prompt, outputs) each, holding their own pages only."""
    reqs = []
    for i, (prompt, outputs) in enumerate(specs):
        r = add(state, i, prompt, max_tokens)
        state.kv.hold(r, 0, state.kv.tree.root)
        state.kv.allocate(r, prompt + outputs - 1)
        state.admit(r, 0.0)
        r.num_computed_tokens, r.num_output_tokens = prompt + outputs - 1, outputs
        reqs.append(r)
    return reqs


def test_retraction_takes_the_fewest_outputs_then_the_longest_prompt_and_resets_the_ratio():
    state, policy = make(num_tokens=130)
    filler = Request(99, 0.0, 103, 1)
    state.kv.hold(filler, 0, state.kv.tree.root)
    state.kv.allocate(filler, 103)                     # 103 of 130 tokens taken outside the run
    # A (10 prompt, 3 out), B (8, 1), C (6, 1) hold 12 + 8 + 6 = 26: 1 free, the decode needs 3.
    a, b_, c = _running(state, [(10, 3), (8, 1), (6, 1)], 100)
    d = add(state, 3, 20, 5)                           # waiting, and it does not fit: NO_TOKEN
    batch = policy.schedule(state, 1.0)
    # keep order (outputs, -prompt) descending: A (3, -10), C (1, -6), B (1, -8); B goes first.
    # Freed 8: 9 free >= 2 needed, so C stays.
    assert batch.items == (BatchItem(0, 1, 12), BatchItem(2, 1, 6))
    assert b_.status == Status.PREEMPTED and b_.num_computed_tokens == 0
    assert list(state.waiting) == [d, b_]              # to the back of the queue, as SGLang appends it
    # ratio = min(1, (outputs 3 + 1 + 20 x 2 left) / (max_tokens 100 + 100 + 1)) = 44 / 201
    assert policy.new_token_ratio == pytest.approx(44 / 201)
    assert not policy.batch_is_full


def test_a_retracted_request_finds_its_checkpointed_prompt_again():
    state, policy = make(num_tokens=2000, chunked_prefill_size=4096)
    r = add(state, 0, 40, 10, content=(900, 7, 40))
    step(state, policy, 0.0)                           # prefill: its 40 prompt tokens enter the tree
    step(state, policy, 1.0)                           # the checkpoint, then one decode
    assert state.kv.tree.total_tokens == 40
    state.preempt(r)                                   # retracted: its outputs are not inserted
    b = policy.schedule(state, 2.0)
    # known = 40 + 2 outputs; the match finds the 40 prompt tokens (cap 41): 2 to recompute
    assert b.items == (BatchItem(0, 2, 40),)
    assert state.kv.preempted_hits == 40 and state.kv.hits == 0


def test_a_fully_cached_prompt_recomputes_its_last_token():
    state, policy = make()
    add(state, 0, 50, 1, content=(900, 7, 50))
    step(state, policy, 0.0)                           # one output: finishes, 50 + 0 tokens inserted
    add(state, 1, 50, 3, content=(901, 7, 50))
    # the match is capped at 50 - 1 = 49 tokens: one token to compute
    assert policy.schedule(state, 1.0).items == (BatchItem(1, 1, 49),)
    assert state.kv.hits == 49


def test_lpm_sorts_by_cached_prefix_and_defers_in_batch_duplicates():
    pool = RadixCachePool(10_000, 1)
    cached = Request(99, 0.0, 50, 1, content=(999, 7, 50))
    pool.hold(cached, 0, pool.tree.root)
    pool.allocate(cached, 50)
    cached.num_computed_tokens, cached.status = 50, Status.FINISHED
    pool.free(cached)                                  # 50 tokens of key 7 in the tree
    r1 = Request(1, 0.0, 40, 5, content=(901, 9, 40))                 # no match
    r2 = Request(2, 0.0, 60, 5, content=(902, 7, 50, 8, 10))          # 50
    r3 = Request(3, 0.0, 25, 5, content=(903, 7, 20, 3, 5))           # 20
    r4 = Request(4, 0.0, 40, 5, content=(904, 6, 40))                 # 0; the scratch tree takes it
    r5 = Request(5, 0.0, 40, 5, content=(905, 6, 40))                 # 0; shares 40 >= 32 with r4
    waiting = deque([r1, r2, r3, r4, r5])
    order_waiting(pool, waiting, True, 0)
    assert [r.req_id for r in waiting] == [2, 3, 1, 4, 5]
    # more than 128 waiting: fcfs, the order stays
    waiting = deque([Request(10 + i, 0.0, 40, 5, content=(1000 + i, 9, 40)) for i in range(128)] + [r2])
    order_waiting(pool, waiting, True, 0)
    assert waiting[-1] is r2


def test_mixed_chunks_fold_running_decodes_into_the_prefill():
    state, policy = make(chunked_prefill_size=64, enable_mixed_chunk=True)
    add(state, 0, 10, 5)
    step(state, policy, 0.0)
    add(state, 1, 100, 5)
    b = policy.schedule(state, 1.0)
    # one running decode: the chunk budget is 64 - 1 = 63
    assert b.items == (BatchItem(1, 63, 0), BatchItem(0, 1, 10))


def test_defaults_follow_sglangs_gpu_memory_rules():
    # H200 (141 GiB = 144,384 MiB): chunk 8192, decode graph 256; reserve 512 + 1.5 x 8192 + 1024 / 8
    # + 2 x 256 + 8 x 58 prefill sizes = 13,904 MiB; (144,384 - 13,904) / 144,384 = 0.9037
    assert engine_defaults(PolicyContext(4096, "NVIDIA H200", 141 * GIB), None, 16384, None) == (8192, 0.904)
    # H100 80 GiB: the same reserve; (81,920 - 13,904) / 81,920 = 0.8303
    assert engine_defaults(PolicyContext(4096, "NVIDIA H100", 80 * GIB), None, 16384, None) == (8192, 0.83)
    # A100 40 GiB: chunk 4096, graph 32: 512 + 6144 + 128 + 64 + 8 x 50 = 7248 (no 10 GiB floor
    # under 60 GiB); (40,960 - 7248) / 40,960 = 0.8230
    assert engine_defaults(PolicyContext(4096, "NVIDIA A100", 40 * GIB), None, 16384, None) == (4096, 0.823)
    # B200 (180 GiB): chunk 16384, graph 512: 512 + 24,576 + 128 + 1024 + 8 x 74 = 26,832; 0.8544
    assert engine_defaults(PolicyContext(4096, "NVIDIA B200", 180 * GIB), None, 16384, None) == (16384, 0.854)
    assert engine_defaults(PolicyContext(4096), None, 16384, None) == (4096, 0.95)       # unknown device
    policy = SglangPolicy(SglangConfig(), PolicyContext(4096, "NVIDIA H200", 141 * GIB))
    assert policy.kv_memory == (0.904, "static") and policy.block_size == 1
    assert policy.kv_pool_class is RadixCachePool


def test_max_running_requests_comes_from_the_pool():
    # 100,000 tokens / 4096 x 512 = 12,500 -> clamped to 4096; 10,000 -> 1250 -> 2048 (<= 10,000 // 2)
    for tokens, want in ((100_000, 4096), (10_000, 2048)):
        state, policy = make(num_tokens=tokens)
        policy.schedule(state, 0.0)
        assert policy.max_num_seqs == want
    state, policy = make(max_running_requests=2)
    for i in range(3):
        add(state, i, 10, 5)
    assert [it.req_id for it in policy.schedule(state, 0.0).items] == [0, 1]
    assert policy.batch_is_full                        # set until a request leaves


def test_knobs_are_checked():
    with pytest.raises(ValueError, match="schedule_policy"):
        SglangPolicy(SglangConfig(schedule_policy="lof"), PolicyContext(4096))
    assert policy_config({"kind": "sglang", "chunked_prefill_size": -1}, "t").chunked_prefill_size == -1
    with pytest.raises(ConfigError, match="chunked_prefill_size"):
        policy_config({"kind": "sglang", "chunked_prefill_size": 0}, "t")
    off = SglangPolicy(SglangConfig(chunked_prefill_size=-1, disable_radix_cache=True), PolicyContext(4096))
    assert off.chunk_size is None and off.kv_pool_class is TokenPool and not off.kv_pool_class.caching


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("seed", range(6))
def test_random_shared_prefixes_conserve_pages_and_release_every_lock(seed, overlap):
    """Random requests sharing prefixes on a tight radix pool, stepped with the fast path checked
    (check_stretch; the overlap loop has none): pages are conserved after every step (free + tree
    + requests' own = pool), every computed token has a page, and at the end nothing is held and
    every node is evictable."""
    import random

    import simpy
    from conftest import linear_profile

    from sim.loop.feed import feed
    from sim.loop.server import Server, SimExecutor

    rng = random.Random(seed)
    page = rng.choice([1, 1, 4])
    knobs = rng.choice([{}, {"schedule_policy": "lpm"}, {"enable_mixed_chunk": True, "chunked_prefill_size": 32},
                        {"chunked_prefill_size": 16, "max_running_requests": 3}])
    policy = SglangPolicy(SglangConfig(page_size=page, enable_overlap=overlap, **knobs), PolicyContext(512))
    pool = RadixCachePool(600 // page, page)
    state = SchedulerState(pool, 512)

    def check(start_s, batch, result):
        own = sum(len(r.block_ids) - pool._held[r.req_id][1] // page for r in state.running)
        assert pool._free + pool.tree.total_tokens // page + own == pool.num_blocks
        for r in state.running:
            assert r.num_computed_tokens <= len(r.block_ids) * page

    env = simpy.Environment()
    server = Server(env, policy, state, SimExecutor(linear_profile()), on_step=check, check_stretch=True)
    reqs, outs, t = [], [], 0.0
    for i in range(40):
        t += rng.random() * 0.05
        content = (10_000 + i,) + tuple(x for _ in range(rng.randint(1, 3))
                                        for x in (rng.randint(1, 4), rng.randint(5, 60)))
        reqs.append(Request(i, t, sum(content[2::2]), 30, content=content))
        outs.append(rng.randint(1, 30))
    env.process(feed(env, [server], reqs, outs))
    env.run()
    assert all(r.status == Status.FINISHED for r in reqs)
    assert pool.num_used_blocks == 0 and not pool._held
    assert pool.tree.evictable_tokens == pool.tree.total_tokens
    assert pool.hits > 0


def _stepped_and_fast(make_cfg):
    import sim.loop.server
    from sim.run.runner import run_workload
    out = []
    for fast in (False, True):
        sim.loop.server.FAST_PATH = fast
        try:
            out.append(run_workload(make_cfg()))
        finally:
            sim.loop.server.FAST_PATH = True
    stepped, fast_run = out
    import pandas as pd
    for name in ("requests", "steps", "tokens"):
        pd.testing.assert_frame_equal(getattr(stepped, name), getattr(fast_run, name), check_exact=True, obj=name)
    assert stepped.summary == fast_run.summary
    return fast_run.summary


@pytest.mark.filterwarnings("ignore:.*requests were rejected")
def test_fast_path_identical_on_the_mooncake_trace_with_evictions():
    # 250 requests of the Mooncake trace on a 60,000-token radix pool: the cache evicts, the ratio
    # decays over stretches, and the results are those of stepping every iteration.
    from pathlib import Path

    from sim.run.config import load_workload
    path = Path(__file__).resolve().parents[2] / "workloads" / "sglang_prefix.yaml"
    summary = _stepped_and_fast(lambda: load_workload(path, {"num_requests": 250, "server.num_blocks": 60_000,
                                                             "server.max_model_len": 48_000,
                                                             "policy.enable_overlap": False}))
    assert summary["prefix_cache_hits"] > 0 and summary["prefix_cache_evicted_blocks"] > 0


@pytest.mark.parametrize("page", [1, 16])
def test_fast_path_identical_under_memory_pressure_with_retractions(page):
    # 1,920 token slots for 120 requests of up to 700 tokens: decodes outgrow the estimate and retract.
    from sim.run.config import workload_from_dict
    data = {"name": "tight", "seed": 3, "num_requests": 120,
            "arrivals": {"kind": "gamma", "rate": 40.0, "cv": 2.0},
            "lengths": {"kind": "uniform", "prompt_min": 16, "prompt_max": 300, "output_min": 20, "output_max": 400},
            "policy": {"kind": "sglang", "page_size": page, "chunked_prefill_size": 256, "enable_overlap": False},
            "server": {"num_blocks": 1920 // page, "max_model_len": 1024},
            "profile": {"model": "llama-2-7b", "gpu": "a100-80gb"}}
    summary = _stepped_and_fast(lambda: workload_from_dict(data))
    assert summary["num_preemptions"] > 0


def test_ignore_eos_without_the_cache_reserves_every_output_to_come():
    for max_tokens, admitted in ((897, True), (898, False)):
        policy = SglangPolicy(SglangConfig(ignore_eos=True, disable_radix_cache=True), PolicyContext(4096))
        state = SchedulerState(TokenPool(1000, 1), 4096)
        add(state, 0, 100, max_tokens)
        # 1000 free - (100 + one page) = 899 left; the request's 897 outputs leave 2 > 1 (one token
        # per request to spare): admitted; 898 leave 1: not (add_one_req_ignore_eos).
        assert isinstance(policy.schedule(state, 0.0), Batch) is admitted, max_tokens


def test_a_request_that_cannot_decode_even_alone_is_aborted():
    state, policy = make(num_tokens=40)
    filler = Request(99, 0.0, 28, 1)
    state.kv.hold(filler, 0, state.kv.tree.root)
    state.kv.allocate(filler, 28)                      # 28 of 40 tokens taken outside the run
    (a,) = _running(state, [(10, 3)], 20)              # a holds 12: none free for its next token
    assert isinstance(policy.schedule(state, 1.0), Idle)
    # nothing to retract it for: SGLang aborts it; here it ends with its 3 tokens, cut short
    assert a.status == Status.FINISHED and state.num_cut_short == 1 and a.num_output_tokens == 3


@pytest.mark.parametrize("flag", [True, False])
def test_vllms_prefix_caching_flag_points_to_sglangs_own_knob(flag):
    # SGLang's radix cache is on by default and its switch says "disable": vLLM's
    # enable_prefix_caching, either way, is refused naming it (false was once dropped in
    # silence, leaving the cache on)
    with pytest.raises(ConfigError, match=r"field 'policy.enable_prefix_caching': policy sglang names it "
                                          r"'policy.disable_radix_cache', the other way round \(false: cache on\); "
                                          r"its default, false, has the cache on"):
        policy_config({"kind": "sglang", "enable_prefix_caching": flag}, "w.yaml")
    assert policy_config({"kind": "sglang", "disable_radix_cache": True}, "w.yaml").disable_radix_cache

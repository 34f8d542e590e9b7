"""Scheduling and memory rules that a mutation probe showed unpinned, each on a state small
enough to compute by hand (the arithmetic is in the comments). Several of them were pinned
only by the differential test against vLLM's own scheduler, which needs vllm installed;
these do not.
"""

from __future__ import annotations

import pytest
import simpy
from conftest import add, linear_profile, make_state, simulate

from sim.core.policy import PolicyContext
from policies.dynamic import DynamicConfig, DynamicPolicy
from policies.orca import OrcaConfig, OrcaPolicy
from policies.sarathi import SarathiConfig
from policies.static import StaticConfig, StaticPolicy
from policies.vllm import VllmConfig, VllmPolicy
from policies.vllm_v1 import GIB, VllmV1Config, VllmV1Policy, engine_defaults
from sim.core.batch import Batch, BatchItem, Idle
from sim.loop.server import Server, SimExecutor
from sim.loop.feed import pick_replica
from sim.core.kv import BlockManager
from sim.core.request import Request, Status

CTX = PolicyContext(max_model_len=1 << 16)


def running(state, r: Request, computed: int, outputs: int = 0) -> Request:
    """Put waiting ``r`` in the running list holding the KV of ``computed`` tokens, with
    ``outputs`` output tokens sampled."""
    state.kv.allocate(r, computed)
    state.admit(r, 0.0)
    r.num_computed_tokens, r.num_output_tokens = computed, outputs
    return r


# ---- the KV pool ---------------------------------------------------------------------------------
def test_blocks_round_up_at_every_boundary():
    kv = BlockManager(8, 16)
    # ceil(n / 16): 0 -> 0, 1 -> 1, 16 -> 1 (exactly full), 17 -> 2
    assert [kv.num_blocks_for(n) for n in (0, 1, 16, 17, 32, 33)] == [0, 1, 1, 2, 2, 3]


def test_watermark_blocks_round_down_as_vllm_does():
    # 150 blocks x 0.01 = 1.5 -> int() = 1 block kept back. A request of prompt 2380 + max_tokens 4
    # = 2384 tokens = 149 blocks of 16 fits the 150 - 1 = 149 the pool may ever give it.
    st = make_state(num_blocks=150, block_size=16, watermark=0.01)
    assert st.kv.watermark_blocks == 1
    assert add(st, 0, 2380, 4).status == Status.WAITING


def test_freed_blocks_are_reused_in_block_table_order():
    # a holds blocks [0, 1]; freed, the next request gets them back as [0, 1], not [1, 0]
    kv = BlockManager(8, 4)
    a, b = Request(0, 0.0, 8, 1), Request(1, 0.0, 8, 1)
    kv.allocate(a, 8)
    assert a.block_ids == [0, 1]
    kv.free(a)
    kv.allocate(b, 8)
    assert b.block_ids == [0, 1]


def test_a_max_tokens_reservation_is_prompt_plus_max_tokens():
    # orca reserves prompt + max_tokens at admission: 100 + 28 = 128 tokens = 8 blocks of 16,
    # and 100 + 29 = 129 tokens = ceil(129 / 16) = 9 blocks (the block boundary is 128)
    for max_tokens, blocks in ((28, 8), (29, 9)):
        st = make_state(num_blocks=100, block_size=16)
        r = add(st, 0, 100, 5, max_tokens=max_tokens)
        OrcaPolicy(OrcaConfig(), CTX).schedule(st, 0.0)
        assert len(r.block_ids) == blocks


def test_reserved_admission_does_not_keep_the_watermark_back():
    # 100 blocks of 16, watermark 0.1 = 10 blocks. Orca reserves 780 + 20 = 800 tokens = 50 blocks
    # for request 0, then 700 + 20 = 720 = 45 blocks for request 1: both fit the 100 blocks (5
    # left). The watermark is for admissions that may grow later; a reservation cannot.
    st = make_state(num_blocks=100, block_size=16, watermark=0.1)
    add(st, 0, 780, 20)
    add(st, 1, 700, 20)
    batch = OrcaPolicy(OrcaConfig(), CTX).schedule(st, 0.0)
    assert batch.items == (BatchItem(0, 780, 0), BatchItem(1, 700, 0))
    assert st.kv.num_free_blocks == 100 - 50 - 45 == 5


# ---- vLLM v0 -------------------------------------------------------------------------------------
def test_v0_decode_preempts_the_newest_until_the_others_fit():
    # 6 blocks of ONE token: three requests of prompt 2 take 2 + 2 + 2 = 6 blocks in the first step.
    # Each then needs one more block for its decode (3 tokens, 3 blocks), none is free: request 2,
    # the newest, is preempted (frees 2), then 0 and 1 take one each: 0 free, 2 preempted.
    st = make_state(num_blocks=6, block_size=1, max_model_len=64)
    p = VllmPolicy(VllmConfig(), PolicyContext(max_model_len=64))
    reqs = [add(st, i, 2, 3) for i in range(3)]
    first = p.schedule(st, 0.0)
    assert first.items == (BatchItem(0, 2, 0), BatchItem(1, 2, 0), BatchItem(2, 2, 0))
    assert st.kv.num_free_blocks == 0
    st.commit(first, 1.0)
    second = p.schedule(st, 1.0)
    assert second.items == (BatchItem(0, 1, 2), BatchItem(1, 1, 2))
    assert [r.status for r in reqs] == [Status.RUNNING, Status.RUNNING, Status.PREEMPTED]
    assert st.kv.num_free_blocks == 0 and [r.req_id for r in st.waiting] == [2]


def test_v0_prompts_that_exactly_fill_the_budget_share_a_prefill():
    # budget 400: 100 + 300 = 400 <= 400, so both prompts are prefilled in one step
    st = make_state()
    p = VllmPolicy(VllmConfig(max_num_batched_tokens=400, max_num_seqs=8), PolicyContext(max_model_len=400))
    add(st, 0, 100, 5)
    add(st, 1, 300, 5)
    assert p.schedule(st, 0.0).items == (BatchItem(0, 100, 0), BatchItem(1, 300, 0))


def test_v0_budget_must_hold_one_max_model_len_prompt():
    # vLLM v0 without chunked prefill refuses max_num_batched_tokens < max_model_len at start-up
    with pytest.raises(ValueError, match="smaller than max_model_len"):
        VllmPolicy(VllmConfig(max_num_batched_tokens=4095), PolicyContext(max_model_len=4096))
    assert VllmPolicy(VllmConfig(max_num_batched_tokens=4096), PolicyContext(max_model_len=4096)).token_budget == 4096


def test_v0_refuses_for_the_pool_by_the_prompt_and_decodes_into_the_watermark():
    # vLLM v0's block manager refuses a request for good (AllocStatus.NEVER) only when its prompt's
    # blocks exceed the pool above the watermark. 10 blocks of 16, watermark 0.4 = 4 blocks: a prompt
    # of 90 tokens = 6 blocks <= 10 - 4 is admitted though prompt + max_tokens = 100 tokens = 7 blocks
    # > 6; decodes ignore the watermark, so it completes holding 7 blocks. A reserving policy (orca)
    # needs the 7 blocks in the pool at admission, which holds 10: admitted too; with max_tokens 80
    # (170 tokens = 11 blocks > 10) it is refused, while v0 still takes it and cuts it short.
    for cfg in (VllmConfig(), SarathiConfig()):
        server, (r,) = simulate([(0.0, 90, 10)], cfg, num_blocks=10, block_size=16, max_model_len=1024,
                                watermark=0.4)
        assert r.status == Status.FINISHED and r.num_output_tokens == 10 and server.state.num_cut_short == 0
        assert server.log.ints[7::8].tolist()[-1] == 7                # KV blocks in use in the last step
    st = make_state(num_blocks=10, block_size=16, watermark=0.4)
    assert add(st, 0, 90, 10).status == Status.WAITING                # 7 blocks of the whole pool's 10
    r = Request(1, 0.0, 90, 80)
    assert not st.add_arrival(r, 80, 0.0) and r.reject_reason == "kv_pool"
    v0 = make_state(num_blocks=10, block_size=16, watermark=0.4, refuse_by_prompt=True)
    assert v0.add_arrival(Request(1, 0.0, 90, 80), 80, 0.0)            # 6 prompt blocks <= 6
    r = Request(2, 0.0, 97, 1)                                         # 97 tokens = 7 blocks > 6
    assert not v0.add_arrival(r, 1, 0.0) and r.reject_reason == "kv_pool"


def test_v0_cuts_short_a_recompute_that_outgrew_the_pool():
    # 6 blocks of ONE token, watermark 0.2 = int(1.2) = 1 block: at most 5 blocks per admission.
    # One request, prompt 2, 10 output tokens: the prefill takes 2 blocks (step 1: token 1); each
    # decode takes one more (steps 2-5: tokens 2-5, then all 6 blocks are held: decodes ignore the
    # watermark). Step 6 needs a 7th block: the request preempts itself; to come back it must
    # recompute prompt 2 + 5 outputs = 7 tokens = 7 blocks > 5: vLLM v0's FINISHED_IGNORED, it
    # ends then with its 5 tokens (finished, counted as completed, 1 preemption), at the end of step 5.
    for cfg in (VllmConfig(), SarathiConfig()):
        server, (r,) = simulate([(0.0, 2, 10)], cfg, num_blocks=6, block_size=1, max_model_len=64,
                                watermark=0.2)
        st = server.state
        assert (r.status, r.num_output_tokens, r.num_preemptions, st.num_cut_short) == (Status.FINISHED, 5, 1, 1)
        ids, times = st.token_log()
        assert len(ids) == 5 and r.first_token_s == times[0] and r.finished_s == times[-1]
        assert len(server.log) == 5 and st.kv.num_used_blocks == 0 and not st.waiting and not st.running
        assert st.records.pop("output_tokens").tolist() == [5]          # its record: the 5 it streamed
    # The step that preempts it schedules nothing: the policy asks to be called again at once
    # (vLLM's next step), not when something next arrives, and that call cuts it short.
    st = make_state(num_blocks=6, block_size=1, max_model_len=64, watermark=0.2, refuse_by_prompt=True)
    a = running(st, add(st, 0, 2, 10), 6, outputs=5)
    policy = VllmPolicy(VllmConfig(), PolicyContext(max_model_len=64))
    assert policy.schedule(st, 3.0) == Idle(3.0) and a.status == Status.PREEMPTED
    assert policy.schedule(st, 3.0) == Idle() and (a.status, a.finished_s) == (Status.FINISHED, 3.0)


def test_v0_a_cut_request_makes_way_for_the_next_in_the_same_step():
    # 6 blocks of one token, 1 kept back. Request 0 (prompt 3) preempted with 3 outputs must
    # recompute 3 + 3 = 6 tokens = 6 blocks > 5: cut short at 2.0; request 1 (prompt 4, 4 blocks
    # <= 5) behind it is admitted in the same call.
    st = make_state(num_blocks=6, block_size=1, max_model_len=64, watermark=0.2, refuse_by_prompt=True)
    a, b = add(st, 0, 3, 8), add(st, 1, 4, 2)
    running(st, a, 5, outputs=3)
    st.preempt(a)
    assert [r.req_id for r in st.waiting] == [0, 1] and a.num_tokens == 6
    batch = VllmPolicy(VllmConfig(), PolicyContext(max_model_len=64)).schedule(st, 2.0)
    assert batch.items == (BatchItem(1, 4, 0),)
    assert (a.status, a.finished_s, st.num_finished, st.num_cut_short) == (Status.FINISHED, 2.0, 1, 1)
    assert 0 not in st.requests and b.status == Status.RUNNING


# ---- vLLM v1 -------------------------------------------------------------------------------------
def test_v1_no_admission_in_a_step_that_preempted_and_the_victim_goes_first():
    # 4 blocks of 4 tokens, budget 9. Running: request 0 (prompt 12, 4 computed: 1 block) and
    # request 1 (prompt 8 computed + 1 output: 2 blocks); request 2 (prompt 4) waits. 1 block free.
    # Request 0's next chunk is min(12 - 4, 9) = 8 tokens: 12 tokens = 3 blocks, 2 missing, 1 free:
    # request 1 (the newest) is preempted (frees 2 -> 3 free), request 0 takes 2 -> 1 free, budget 1.
    # vLLM v1 admits nothing in a step that preempted: without reserve_full_prompt (vLLM's
    # scheduler_reserve_full_isl off), request 1's first token would fit the one free block and
    # budget (with it, a victim's whole prompt never fits again in the step it was evicted). The
    # victim waits at the queue's front, before request 2.
    st = make_state(num_blocks=4, block_size=4, max_model_len=64)
    p = VllmV1Policy(VllmV1Config(max_num_batched_tokens=9, max_num_seqs=4, reserve_full_prompt=False),
                     PolicyContext(max_model_len=64))
    r0 = running(st, add(st, 0, 12, 4), computed=4)      # 12 + 4 = 16 tokens: fits the 4-block pool
    r1 = running(st, add(st, 1, 8, 5), computed=8, outputs=1)
    add(st, 2, 4, 5)
    assert st.kv.num_free_blocks == 1
    batch = p.schedule(st, 1.0)
    assert batch.items == (BatchItem(0, 8, 4),)
    assert r1.status == Status.PREEMPTED and r1.num_computed_tokens == 0 and len(r0.block_ids) == 3
    assert [r.req_id for r in st.waiting] == [1, 2] and st.kv.num_free_blocks == 1


def test_v1_watermark_only_while_requests_run_and_an_exact_fit_is_admitted():
    # 8 blocks of 4; watermark 0.25 x (8 + vLLM's null block) = int(2.25) = 2 blocks.
    # Nothing runs: request 0 (prompt 28 = 7 blocks) is admitted against all 8 free blocks.
    # Then request 0 runs: request 1 (prompt 4 = 1 block) meets 8 - 7 - 2 = -1 free: it waits.
    st = make_state(num_blocks=8, block_size=4, max_model_len=64)
    p = VllmV1Policy(VllmV1Config(watermark=0.25), PolicyContext(max_model_len=64))
    add(st, 0, 28, 4)
    add(st, 1, 4, 4)
    assert p.schedule(st, 0.0).items == (BatchItem(0, 28, 0),)
    assert [r.req_id for r in st.waiting] == [1]
    # Without a watermark, two prompts of 16 tokens (4 blocks each) fill the 8 blocks exactly: the
    # second needs 4 blocks with 4 free, and is admitted.
    st = make_state(num_blocks=8, block_size=4, max_model_len=64)
    add(st, 0, 16, 4)
    add(st, 1, 16, 4)
    batch = VllmV1Policy(VllmV1Config(), PolicyContext(max_model_len=64)).schedule(st, 0.0)
    assert batch.items == (BatchItem(0, 16, 0), BatchItem(1, 16, 0)) and st.kv.num_free_blocks == 0


def test_v1_engine_defaults_at_the_160_gib_boundary_and_seqs_capped_by_a_given_budget():
    # vLLM 0.32 (EngineArgs.get_batch_defaults): >= 160 GiB -> 16384 tokens / 1024 seqs; below it
    # (and >= 70 GiB, not an A100) 8192 / 1024
    at = PolicyContext(max_model_len=4096, device="gpu", memory_bytes_per_gpu=160 * GIB)
    below = PolicyContext(max_model_len=4096, device="gpu", memory_bytes_per_gpu=160 * GIB - 1)
    assert engine_defaults(at) == (16384, 1024) and engine_defaults(below) == (8192, 1024)
    # an unset max_num_seqs is capped at the budget the user gave: min(256, 128) = 128
    p = VllmV1Policy(VllmV1Config(max_num_batched_tokens=128), PolicyContext(max_model_len=4096))
    assert (p.token_budget, p.max_num_seqs) == (128, 128)


# ---- dynamic batching ----------------------------------------------------------------------------
def test_dynamic_deadline_counts_from_the_oldest_waiting_request():
    # max delay 0.5 s; requests arrive at 1.0 and 1.3: the batch leaves at 1.0 + 0.5 = 1.5
    st = make_state()
    p = DynamicPolicy(DynamicConfig(max_batch_size=4, max_queue_delay_s=0.5), CTX)
    add(st, 0, 10, 2, arrival_s=1.0)
    add(st, 1, 10, 2, arrival_s=1.3)
    wait = p.schedule(st, 1.2)
    assert isinstance(wait, Idle) and wait.wake_at_s == 1.5
    assert [it.req_id for it in p.schedule(st, 1.5).items] == [0, 1]


# ---- batches and the engine ----------------------------------------------------------------------
def test_padded_prompt_tokens_count_in_the_prefill_shape():
    # static batching pads request 0's prompt of 10 to the longest, 30: both chunks are (30, 0);
    # 10 + 30 = 40 real prompt tokens, 40 + 20 padding = 60 computed
    b = Batch((BatchItem(0, 10, 0, 20), BatchItem(1, 30, 0, 0)))
    assert b.prefill_chunks == ((30, 0), (30, 0)) and b.num_prefill_tokens == 40 and b.num_tokens == 60


def test_a_padded_group_decodes_over_the_padded_length():
    # Prompts 10 and 1000, outputs 3 and 5, one static group of 2. Padded to 1000, each row's KV
    # is 1000 + the tokens decoded since, finished row too: decode k (k = 1..4) attends over
    # 2 x (1000 + k - 1) = 2000, 2002, 2004, 2006 tokens, not 1010, 1012, then 11 + 1002 (request
    # 0's own context, frozen once it finished) + ...
    st = make_state(num_blocks=1000, block_size=16)
    p = StaticPolicy(StaticConfig(batch_size=2), CTX)
    add(st, 0, 10, 3)
    add(st, 1, 1000, 5)
    st.all_arrived = True
    first = p.schedule(st, 0.0)
    assert first.prefill_chunks == ((1000, 0), (1000, 0))
    st.commit(first, 1.0)
    contexts = []
    for k in range(4):
        batch = p.schedule(st, 2.0 + k)
        contexts.append((batch.decode_seqs, batch.decode_context))
        st.commit(batch, 3.0 + k)
    assert contexts == [(2, 2000), (2, 2002), (2, 2004), (2, 2006)]
    assert not st.running                                          # request 1's 5th token: both done
    # the fast path prices the same contexts: a static run gives identical results with it on and off
    # (tests/loop/test_fast_path.py); here its step costs follow 2 x (1000 + k - 1) for k = 1..4
    prof = linear_profile(per_token_s=0.0, overhead_s=0.0, decode_per_ctx_s=1e-6)
    server, _ = simulate([(0.0, 10, 3), (0.0, 1000, 5)], StaticConfig(batch_size=2), profile=prof)
    durations = list(server.log.duration_s)[1:]
    assert durations == pytest.approx([2000e-6, 2002e-6, 2004e-6, 2006e-6], rel=1e-9)


def test_a_request_arriving_as_a_step_ends_joins_the_next_step():
    # every step costs 1.0 s (overhead only). Request 0 (t = 0) prefills in [0, 1]; request 1
    # arrives at exactly 1.0 and joins the step [1, 2] beside request 0's decode (orca): its first
    # token at 2.0, then 3.0 and 4.0 (finished); request 0's tokens at 1.0, 2.0, 3.0 (finished).
    prof = linear_profile(per_token_s=0.0, overhead_s=1.0, decode_per_ctx_s=0.0, prefill_per_ctx_s=0.0)
    _, reqs = simulate([(0.0, 10, 3), (1.0, 10, 3)], OrcaConfig(), profile=prof)
    assert [(r.first_scheduled_s, r.first_token_s, r.finished_s) for r in reqs] == [(0.0, 1.0, 3.0),
                                                                                    (1.0, 2.0, 4.0)]


def test_least_tokens_routes_by_the_tokens_still_to_compute():
    # server A runs a request of prompt 100 + max_tokens 100 with 190 computed: 10 tokens left.
    # Server B has one waiting of 20 + 20: 40 left. least_tokens picks A (10 < 40); counting
    # prompt + max_tokens without what is computed (200 vs 40) would pick B.
    env = simpy.Environment()
    servers = []
    for _ in range(2):
        st = make_state()
        servers.append(Server(env, VllmPolicy(VllmConfig(), CTX), st, SimExecutor(linear_profile())))
    a, b = servers
    r = running(a.state, add(a.state, 0, 100, 100), computed=190, outputs=90)
    add(b.state, 1, 20, 20)
    assert (a.num_outstanding_tokens, b.num_outstanding_tokens) == (10, 40) and r.status == Status.RUNNING
    assert pick_replica("least_tokens", servers, 0) is a

"""SGLang's overlap loop (policies.sglang rule 7, enable_overlap), by hand.

Every step of the timelines costs 10 ms (a profile with only a per-step
overhead). SGLang 0.5.23's ``event_loop_overlap`` chooses a batch while the one
before it runs and processes that one's results after launching the next: a
batch's outputs, finishes and frees are seen one iteration late. The unit tests
below put a batch "in flight" by hand (``state.pending``, its KV allocated as
the policy allocates it) and commit it with ``SchedulerState.commit_overlap``.
"""

from __future__ import annotations

import pytest
import simpy

from conftest import linear_profile, policy_state, step_rows
from policies import make_policy
from policies.sglang import SglangConfig
from sim.core.batch import Batch, BatchItem, Idle
from sim.core.request import Request, Status
from sim.loop.feed import feed
from sim.loop.server import Server, SimExecutor

STEP = linear_profile(per_token_s=0.0, overhead_s=0.010, decode_per_ctx_s=0.0, prefill_per_ctx_s=0.0)


def _policy(**knobs):
    knobs = {"max_running_requests": 8, "chunked_prefill_size": 64, **knobs}
    return make_policy(SglangConfig(**knobs), 1024)


def _run(specs, overlap: bool, num_tokens: int = 100):
    """(arrival_s, prompt, max_tokens, true output) per request; (server, requests)."""
    env = simpy.Environment()
    policy = _policy(enable_overlap=overlap)
    server = Server(env, policy, policy_state(policy, num_tokens, 1, 1024), SimExecutor(STEP))
    reqs = [Request(i, a, p, m, content=(500 + i, 1 + i, p)) for i, (a, p, m, _) in enumerate(specs)]
    env.process(feed(env, [server], reqs, [o for *_, o in specs]))
    env.run()
    return server, reqs


def test_the_knob_defaults_on_and_turns_the_pipelined_loop_on():
    on, off = _policy(), _policy(enable_overlap=False)
    assert on.config.enable_overlap and on.pipelined and on.overlap_loop and not on.decode_stretch
    assert not off.pipelined and not off.overlap_loop and off.decode_stretch
    assert on.knobs()["enable_overlap"] is True and on.pipelined_knob == "enable_overlap"


# r0: t=0, prompt 4, max_tokens 10, stops on EOS after 3 tokens (the scheduler cannot know);
# r1: t=15 ms, prompt 4, max_tokens 2 (a length stop, known in advance).
SPECS = [(0.0, 4, 10, 3), (0.015, 4, 2, 2)]


def test_overlap_timeline_by_hand():
    # t=0:  B1 = r0's prompt (4), runs 0-10; B2 chosen at once with B1 in flight: r0 merged into
    #       the running batch, its first token a placeholder: (r0, 1 @ 4).
    # t=10: B1's result: r0's token 1. B2 runs 10-20; B3 chosen: (r0, 1 @ 5).
    # t=20: token 2. B3 runs 20-30; B4 chosen: r1 (arrived at 15) waits, and SGLang runs a
    #       prefill first (no mixed chunks): B4 = r1's prompt alone; r0 sits this one out.
    # t=30: B3's result: token 3, r0 finishes (EOS) and is released; it is in no batch after B3,
    #       so no token is wasted. B4 runs 30-40; B5 chosen: (r1, 1 @ 4), r1 outputs 0 + 1 < 2.
    # t=40: r1's token 1. B5 runs 40-50; B6: r1 has 1 output and its token in flight finishes it
    #       by length (1 + 1 >= 2: _reqs_finishing_inflight): left out, nothing else: idle.
    # t=50: r1's token 2, finished.
    server, (r0, r1) = _run(SPECS, overlap=True)
    assert step_rows(server) == [(0.0, 1, 4, 0), (10.0, 1, 0, 1), (20.0, 1, 0, 1), (30.0, 1, 4, 0), (40.0, 1, 0, 1)]
    assert (r0.first_token_s, r0.finished_s, r0.num_output_tokens) == pytest.approx((0.010, 0.030, 3))
    assert (r1.first_token_s, r1.finished_s, r1.num_output_tokens) == pytest.approx((0.040, 0.050, 2))
    assert r1.first_scheduled_s == pytest.approx(0.020)   # chosen while B3 ran
    assert server.state.done and not server.state.pending


def test_sync_timeline_by_hand():
    # event_loop_normal: B1 0-10 r0's prompt (token 1); B2 10-20 r0 decodes (token 2); at 20 r1
    # (arrived at 15) waits: B3 20-30 r1's prompt alone (its token 1; r0 sits out); B4 30-40
    # decodes both: r0's token 3 (EOS) and r1's token 2 (its last). r0 ends 10 ms later than with
    # the overlap loop (40 against 30), r1 10 ms earlier (40 against 50).
    server, (r0, r1) = _run(SPECS, overlap=False)
    assert step_rows(server) == [(0.0, 1, 4, 0), (10.0, 1, 0, 1), (20.0, 1, 4, 0), (30.0, 2, 0, 2)]
    assert (r0.first_token_s, r0.finished_s) == pytest.approx((0.010, 0.040))
    assert (r1.first_token_s, r1.finished_s) == pytest.approx((0.030, 0.040))


def test_an_eos_stop_runs_one_wasted_decode_whose_kv_enters_the_tree():
    # r0: prompt 4, max_tokens 10, EOS after 2 tokens. B1 prompt 0-10, B2 (r0, 1 @ 4) 10-20,
    # B3 (r0, 1 @ 5) chosen at 10 with B2 in flight. At 20 B2's result finishes r0 while B3 holds
    # its next token: B3 runs 20-30 and its token is thrown away. SGLang's release keeps
    # kv_committed_len = 4 + 2 = 6 tokens (B3 allocated the KV of token 2): the tree holds 6,
    # against 5 (prompt + outputs - 1) in the synchronous loop, which runs no third step.
    server, (r0,) = _run([(0.0, 4, 10, 2)], overlap=True)
    assert step_rows(server) == [(0.0, 1, 4, 0), (10.0, 1, 0, 1), (20.0, 1, 0, 1)]
    assert (r0.finished_s, r0.num_output_tokens) == pytest.approx((0.020, 2))
    kv = server.state.kv
    assert kv.tree.total_tokens == 6 and kv.num_used_blocks == 0 and not kv._held
    sync, (s0,) = _run([(0.0, 4, 10, 2)], overlap=False)
    assert step_rows(sync) == [(0.0, 1, 4, 0), (10.0, 1, 0, 1)]
    assert sync.state.kv.tree.total_tokens == 5 and s0.finished_s == pytest.approx(0.020)


# ---- one pass with a batch in flight, by hand ------------------------------------------------------
def _state(policy, num_tokens, filler_tokens):
    state = policy_state(policy, num_tokens, 1, 1024)
    filler = Request(99, 0.0, filler_tokens, 1)
    state.kv.hold(filler, 0, state.kv.tree.root)
    state.kv.allocate(filler, filler_tokens)        # taken outside the run
    return state


def _running(state, specs, max_tokens):
    """Requests admitted and decoding: (prompt, outputs, max_tokens or None) each, holding their
    own pages only, every one's next token in flight (``state.pending``, its KV allocated)."""
    reqs, items = [], []
    for i, (prompt, outputs, own_max) in enumerate(specs):
        m = own_max or max_tokens
        r = Request(i, 0.0, prompt, m)
        assert state.add_arrival(r, m, 0.0)
        state.kv.hold(r, 0, state.kv.tree.root)
        state.kv.allocate(r, prompt + outputs)       # computed + the token in flight
        state.admit(r, 0.0)
        r.num_computed_tokens, r.num_output_tokens = prompt + outputs - 1, outputs
        state.prefilling.discard(r.req_id)
        items.append(BatchItem(i, 1, prompt + outputs - 1))
        reqs.append(r)
    state.pending.append(Batch(tuple(items)))
    return reqs


def test_a_kv_shortfall_with_a_request_finishing_in_flight_skips_the_decode_instead_of_retracting():
    policy = _policy(enable_overlap=True)
    state = _state(policy, 40, 26)
    # A (prompt 6, 2 outputs, max_tokens 3) and B (5, 1, 20) hold 8 + 6 = 14 with their tokens in
    # flight: 40 - 26 - 14 = 0 free. A's token in flight is its last (2 + 1 >= 3): left out. B's
    # next token needs a page (6 % 1 == 0), none free: SGLang decodes nobody this pass
    # (update_running_batch returns None) and waits for the results that free A.
    a, b = _running(state, [(6, 2, 3), (5, 1, None)], 20)
    assert isinstance(policy.schedule(state, 1.0), Idle)
    assert b.status == Status.RUNNING and state.num_preemptions == 0 and not policy.batch_is_full
    state.commit_overlap(state.pending[0], 2.0)
    # A's token 3: finished, its 8 tokens released into the tree (evictable); B's token 2
    assert a.status == Status.FINISHED and a.num_output_tokens == 3 and b.num_output_tokens == 2
    assert state.kv.tree.evictable_tokens == 8
    # B decodes after its 6 computed tokens, the page evicted from A's
    assert policy.schedule(state, 2.0).items == (BatchItem(1, 1, 6),)


def _retracting_state(policy):
    state = _state(policy, 130, 101)
    # A (prompt 10, 3 out), B (8, 1), C (6, 1) hold 13 + 9 + 7 = 29 with their tokens in flight:
    # 130 - 101 - 29 = 0 free; the next decode needs 3 pages (13, 9 and 7 tokens: whole pages).
    return state, _running(state, [(10, 3, None), (8, 1, None), (6, 1, None)], 100)


def test_a_request_retracted_while_its_token_is_in_flight_gets_no_token_from_that_batch():
    policy = _policy(enable_overlap=True)
    state, (a, b, c) = _retracting_state(policy)
    in_flight = state.pending[0]
    batch = policy.schedule(state, 1.0)
    # keep order (outputs, -prompt) descending: A (3, -10), C (1, -6), B (1, -8); B is retracted,
    # freeing its 9 pages: 9 free >= 2 needed. Contexts count the tokens in flight: A 12 + 1, C 6 + 1.
    assert batch.items == (BatchItem(0, 1, 13), BatchItem(2, 1, 7))
    assert b.status == Status.PREEMPTED and list(state.waiting) == [b]
    # ratio = min(1, (outputs 3 + 1 + 20 x 2 left) / (100 + 100 + 1)) = 44 / 201: the outputs whose
    # results are in
    assert policy.new_token_ratio == pytest.approx(44 / 201)
    state.pending.append(batch)
    state.commit_overlap(in_flight, 2.0)
    # SGLang skips a retracted request's output (is_retracted): B keeps 1 token, A and C sample
    assert (a.num_output_tokens, b.num_output_tokens, c.num_output_tokens) == (4, 1, 2)
    assert list(state.tokens.ids) == [0, 2]
    assert (a.num_computed_tokens, c.num_computed_tokens) == (13, 7)
    # vLLM's async commit (commit_pipelined) delivers the stale token instead: B would have 2
    policy2 = _policy(enable_overlap=True)
    state2, (_, b2, _) = _retracting_state(policy2)
    in_flight2 = state2.pending[0]
    state2.pending.append(policy2.schedule(state2, 1.0))
    state2.commit_pipelined(in_flight2, 2.0)
    assert b2.status == Status.PREEMPTED and b2.num_output_tokens == 2


def test_the_chunk_in_flight_is_stashed_when_the_next_batch_is_chosen():
    policy = _policy(enable_overlap=True, chunked_prefill_size=16)
    state = policy_state(policy, 1000, 1, 1024)
    r = Request(0, 0.0, 40, 5, content=(900, 7, 40))
    assert state.add_arrival(r, 5, 0.0)

    def choose():
        b = policy.schedule(state, 0.0)
        state.pending.append(b)
        return b

    tree = state.kv.tree
    assert choose().items == (BatchItem(0, 16, 0),)        # chunk 1, nothing in flight
    # chunk 1 in flight: stashed (checkpoint_kv_cache up to 16) before chunk 2 is chosen after it
    assert choose().items == (BatchItem(0, 16, 16),) and tree.total_tokens == 16
    state.commit_overlap(state.pending[0], 1.0)            # chunk 1's result
    assert choose().items == (BatchItem(0, 8, 32),) and tree.total_tokens == 32   # the last chunk
    state.commit_overlap(state.pending[0], 2.0)
    # the last chunk in flight: r decodes after it with a placeholder, 32 + 8 = 40; its prompt is
    # checkpointed only once that chunk's result is in
    assert choose().items == (BatchItem(0, 1, 40),) and tree.total_tokens == 32
    state.commit_overlap(state.pending[0], 3.0)            # the last chunk's result: token 1
    assert r.num_output_tokens == 1
    assert choose().items == (BatchItem(0, 1, 41),) and tree.total_tokens == 40


def test_the_ratio_resets_only_when_nothing_is_in_flight():
    # on_idle runs only with no batch chosen and none in flight (is_fully_idle: result_queue empty)
    policy = _policy(enable_overlap=True)
    state = policy_state(policy, 1000, 1, 1024)
    policy.new_token_ratio = 0.5
    state.pending.append(Batch((BatchItem(7, 1, 3),)))     # a finished request's wasted decode
    assert isinstance(policy.schedule(state, 0.0), Idle) and policy.new_token_ratio == 0.5
    state.pending.clear()
    assert isinstance(policy.schedule(state, 1.0), Idle) and policy.new_token_ratio == 0.7


@pytest.mark.parametrize("given", [{}, {"enable_overlap": True}])
def test_a_live_run_refuses_the_overlap_loop_and_names_its_knob(given):
    # the live engine runs one step at a time: it cannot choose a batch while another runs
    from sim.base.strict import ConfigError
    from sim.run.config import workload_from_dict
    from sim.run.runner import build_profile, drive
    cfg = workload_from_dict({"name": "live", "seed": 0, "num_requests": 2,
                              "arrivals": {"kind": "poisson", "rate": 1.0},
                              "lengths": {"kind": "fixed", "prompt_tokens": 8, "output_tokens": 4},
                              "policy": {"kind": "sglang", **given},
                              "profile": {"model": "llama-2-7b", "gpu": "a100-80gb"}})
    said = "is true" if given else "is unset, which means on"
    with pytest.raises(ConfigError, match=rf"field 'policy.enable_overlap' {said}.*set policy.enable_overlap: "
                                          r"false to run it live"):
        drive(cfg, build_profile(cfg), 1000, 1024, simpy.Environment(), SimExecutor(STEP), live=True)

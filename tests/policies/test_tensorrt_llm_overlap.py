"""TensorRT-LLM's overlap scheduler (policies.tensorrt_llm rule 6, disable_overlap_scheduler false), by hand.

Every step of the timelines costs 10 ms (a profile with only a per-step overhead), pages of 4
tokens. ``PyExecutor._executor_loop_overlap`` schedules step N+1 while step N runs and takes in
N's tokens, finishes and frees after launching N+1: the pass that chooses N+1 sees N's tokens
as computed but not what N samples. A context request whose last chunk is in N decodes in N+1;
a request whose token in N is its last by max_tokens (GENERATION_TO_COMPLETE) is left out of N+1
by the micro batch scheduler, though the capacity scheduler still counts it; one that stops on
EOS is still scheduled in N+1, a decode whose token is thrown away. Either's blocks free only
once N's results are in, for the pass that chooses N+2.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import simpy

from conftest import linear_profile, policy_state, step_rows
from policies import make_policy
from policies.tensorrt_llm import TensorRtLlmConfig
from sim.core.batch import Batch, BatchItem, Idle
from sim.core.request import Request, Status
from sim.loop.feed import feed
from sim.loop.server import Server, SimExecutor

STEP = linear_profile(per_token_s=0.0, overhead_s=0.010, decode_per_ctx_s=0.0, prefill_per_ctx_s=0.0)


def _policy(**knobs):
    return make_policy(TensorRtLlmConfig(**{"tokens_per_block": 4, **knobs}), 1024)


def _run(specs, overlap: bool, num_blocks: int = 64, profile=STEP, **knobs):
    """(arrival_s, prompt, max_tokens, true output) per request; (server, requests)."""
    env = simpy.Environment()
    policy = _policy(disable_overlap_scheduler=not overlap, **knobs)
    server = Server(env, policy, policy_state(policy, num_blocks, 4, 1024), SimExecutor(profile))
    reqs = [Request(i, a, p, m, content=(500 + i, 1 + i, p)) for i, (a, p, m, _) in enumerate(specs)]
    env.process(feed(env, [server], reqs, [o for *_, o in specs]))
    env.run()
    return server, reqs


def test_the_knob_defaults_to_the_overlap_scheduler_and_turns_the_pipelined_loop_on():
    on, off = _policy(), _policy(disable_overlap_scheduler=True)
    assert on.pipelined and not on.overlap_loop and not on.decode_stretch      # commit_pipelined, no fast path
    assert not off.pipelined and off.decode_stretch
    assert on.knobs()["disable_overlap_scheduler"] is False
    assert (on.pipelined_knob, on.pipelined_off) == ("disable_overlap_scheduler", True)


# r0: prompt 4, max_tokens 3 (4 + 3 = 7 tokens, 2 pages to completion); r1: prompt 4, max_tokens 4
# (8 tokens, 2 pages). A pool of 3 pages: GUARANTEED_NO_EVICT takes r0 (2 of 3) and leaves r1
# waiting (2 > 1) until r0's pages come back.
def _pair(r0_output: int):
    return [(0.0, 4, 3, r0_output), (0.0, 4, 4, 4)]


def test_a_max_tokens_stop_is_left_out_of_the_next_step_and_frees_its_pages_after_it():
    # t=0:  B1 = r0's prompt (4 @ 0), 0-10. B2 chosen at once, B1 in flight: r0 is already a
    #       generation request (its prompt's last chunk is in B1): (r0, 1 @ 4), its input the token
    #       B1 samples. r1 needs 2 pages: 2 free less the 1 r0 still has to come (2 - 1 held) = 1
    #       < 2: it waits. Then r0 takes its 2nd page (4 >= 1 x 4): 1 free.
    # t=10: B1's token 1 in. B2 10-20; B3 chosen: (r0, 1 @ 5) (1 output + 1 < 3).
    # t=20: token 2. B3 20-30; the pass at 20: B3's token is r0's last (2 + 1 >= 3:
    #       GENERATION_TO_COMPLETE): the micro batch scheduler leaves it out, and r1 still waits
    #       (its 2 pages > the 1 free, r0's pages not yet back): nothing to run, the device ends B3.
    # t=30: B3's token 3: r0 finishes, its 2 pages are freed (3 free); r1 fits: its prompt 30-40,
    #       then (r1, 1 @ 4) 40-50, (r1, 1 @ 5) 50-60, (r1, 1 @ 6) 60-70 (token 4 at 70; the pass at
    #       60 leaves r1 out: 3 + 1 >= 4). No step is wasted: the steps the synchronous loop runs.
    server, (r0, r1) = _run(_pair(3), overlap=True, num_blocks=3)
    assert step_rows(server) == [(0.0, 1, 4, 0), (10.0, 1, 0, 1), (20.0, 1, 0, 1), (30.0, 1, 4, 0),
                                 (40.0, 1, 0, 1), (50.0, 1, 0, 1), (60.0, 1, 0, 1)]
    assert (r0.first_token_s, r0.finished_s, r0.num_output_tokens) == pytest.approx((0.010, 0.030, 3))
    assert r1.first_scheduled_s == pytest.approx(0.030)
    assert (r1.first_token_s, r1.finished_s, r1.num_output_tokens) == pytest.approx((0.040, 0.070, 4))
    assert server.state.done and not server.state.pending and server.state.kv.num_used_blocks == 0


def test_the_synchronous_loop_is_unchanged():
    # _executor_loop: B1 0-10 r0's prompt (token 1), B2 10-20, B3 20-30 (token 3: r0 finishes and
    # frees its pages); at 30 r1 fits: B4 30-40 its prompt, then 3 decodes to 70.
    server, (r0, r1) = _run(_pair(3), overlap=False, num_blocks=3)
    assert step_rows(server) == [(0.0, 1, 4, 0), (10.0, 1, 0, 1), (20.0, 1, 0, 1), (30.0, 1, 4, 0),
                                 (40.0, 1, 0, 1), (50.0, 1, 0, 1), (60.0, 1, 0, 1)]
    assert (r0.first_token_s, r0.finished_s) == pytest.approx((0.010, 0.030))
    assert (r1.first_scheduled_s, r1.first_token_s, r1.finished_s) == pytest.approx((0.030, 0.040, 0.070))


def test_an_eos_stop_costs_one_extra_decode_and_frees_its_pages_a_step_later():
    # r0 now stops on EOS after 2 tokens (the scheduler cannot know). B1 0-10 its prompt; B2
    # (r0, 1 @ 4) chosen at 0; B3 (r0, 1 @ 5) chosen at 10 with B2 in flight (1 + 1 < 3). At 20
    # B2's token 2 ends r0 (finished at 20, as in the synchronous loop) and frees its 2 pages,
    # while B3 holds its next token: B3 runs 20-30, its token thrown away (TorchSampler skips a
    # finished request). The pass at 20 (B3 in flight) admits r1 (2 <= 3 free): its prompt starts
    # when the device is free, at 30; then 40, 50, 60 (token 4 at 70).
    server, (r0, r1) = _run(_pair(2), overlap=True, num_blocks=3)
    assert step_rows(server) == [(0.0, 1, 4, 0), (10.0, 1, 0, 1), (20.0, 1, 0, 1), (30.0, 1, 4, 0),
                                 (40.0, 1, 0, 1), (50.0, 1, 0, 1), (60.0, 1, 0, 1)]
    assert (r0.finished_s, r0.num_output_tokens) == pytest.approx((0.020, 2))
    assert (r1.first_scheduled_s, r1.first_token_s, r1.finished_s) == pytest.approx((0.020, 0.040, 0.070))
    assert server.state.kv.num_used_blocks == 0 and len(server.state.tokens.ids) == 2 + 4
    # the synchronous loop: r0's pages back at 20, r1's prompt 20-30, its token 4 at 60
    sync, (s0, s1) = _run(_pair(2), overlap=False, num_blocks=3)
    assert step_rows(sync) == [(0.0, 1, 4, 0), (10.0, 1, 0, 1), (20.0, 1, 4, 0), (30.0, 1, 0, 1),
                               (40.0, 1, 0, 1), (50.0, 1, 0, 1)]
    assert (s0.finished_s, s1.first_token_s, s1.finished_s) == pytest.approx((0.020, 0.030, 0.060))


def test_a_last_chunk_in_flight_decodes_in_the_very_next_step():
    # Chunked prefill, max_num_tokens 8 (chunks of whole 4-token pages), 10 ms steps of which 4 ms
    # are host work (the device's 6). r0: prompt 12, max_tokens 3.
    # B1 = (r0, 8 @ 0), chosen at 0, starts at 4, ends 10. B2 chosen at 4 with B1 in flight: r0's
    # chunk position has moved to 8 (_update_request_states): its last chunk (r0, 4 @ 8), ready at
    # 8, starts at 10, ends 16. B3 chosen at 10 with B2 in flight: r0 is a generation request
    # already: (r0, 1 @ 12), fed B2's token, ready 14, starts at 16 (right as B2 ends), ends 22.
    # B4 chosen at 16: (r0, 1 @ 13) (B2's token 1 in: 1 + 1 < 3), starts 22, ends 28. The pass at
    # 22 leaves r0 out (2 + 1 >= 3). Tokens at 16 (B2's end), 22, 28.
    host = replace(STEP, host_step_s=0.004)
    server, (r0,) = _run([(0.0, 12, 3, 3)], overlap=True, profile=host, max_num_tokens=8,
                         enable_chunked_prefill=True)
    assert step_rows(server) == [(4.0, 1, 8, 0), (10.0, 1, 4, 0), (16.0, 1, 0, 1), (22.0, 1, 0, 1)]
    assert (r0.first_token_s, r0.finished_s) == pytest.approx((0.016, 0.028))


def test_the_next_chunk_or_the_first_decode_is_chosen_from_the_step_in_flight():
    # By hand. 16 pages of 4, chunks of at most 8. r0: prompt 20, its first chunk (8 @ 0) in
    # flight: the next is (r0, 8 @ 8). r1: prompt 12, its last chunk (4 @ 8) in flight: it decodes
    # at 12 (its 4th page taken: 12 >= 3 x 4), 1 token of the 8, listed first (decodes first),
    # which leaves 7 for r0's chunk, cut to whole pages: (r0, 4 @ 8).
    p = _policy(max_num_tokens=8, enable_chunked_prefill=True, enable_block_reuse=False)
    state = policy_state(p, 16, 4, 1024)
    r0, r1 = _in_flight(state, [(20, 0, 0, 4), (12, 0, 8, 4)], items=[(8, 0), (4, 8)])
    assert p.schedule(state, 0.0).items == (BatchItem(1, 1, 12), BatchItem(0, 4, 8))
    assert len(r1.block_ids) == 4 and len(r0.block_ids) == 5


def test_the_host_part_of_a_step_runs_beside_the_device_step_before_it():
    # 10 ms steps of which 4 ms are host work (Profile.host_step_s): the device's 6 ms. r0: prompt 4,
    # max_tokens 3. The pipelined loop starts a step at max(end of the one before, chosen + 4 ms):
    # B1 chosen at 0, starts at 0 + 4 = 4 (nothing on the device), ends at 10; B2 chosen at 4 with
    # B1 in flight, ready at 8, starts at max(10, 8) = 10, ends 16 (B1's token 1 at 10); B3 chosen at
    # 10, ready 14, starts 16, ends 22 (token 2 at 16, token 3 at 22: r0 ends); the pass at 16
    # leaves r0 out (2 + 1 >= 3). Synchronously each step costs its full 10 ms: r0 ends at 30.
    host = replace(STEP, host_step_s=0.004)
    server, (r0,) = _run([(0.0, 4, 3, 3)], overlap=True, profile=host)
    assert step_rows(server) == [(4.0, 1, 4, 0), (10.0, 1, 0, 1), (16.0, 1, 0, 1)]
    assert (r0.first_token_s, r0.finished_s) == pytest.approx((0.010, 0.022))
    sync, (s0,) = _run([(0.0, 4, 3, 3)], overlap=False, profile=host)
    assert step_rows(sync) == [(0.0, 1, 4, 0), (10.0, 1, 0, 1), (20.0, 1, 0, 1)]
    assert s0.finished_s == pytest.approx(0.030)
    # host longer than the device (7 ms of 10: the device's 3): host-bound, a step every 7 ms.
    # B1 starts at 7, ends 10; B2 chosen at 7, starts 14 (B1's token 1 taken in then, at 14); B3
    # chosen 14, starts 21 (token 2 at 21), ends 24; the pass at 21 leaves r0 out, so B3's token 3
    # comes at its end, 24.
    slow, (h0,) = _run([(0.0, 4, 3, 3)], overlap=True, profile=replace(STEP, host_step_s=0.007))
    assert step_rows(slow) == [(7.0, 1, 4, 0), (14.0, 1, 0, 1), (21.0, 1, 0, 1)]
    assert (h0.first_token_s, h0.finished_s) == pytest.approx((0.014, 0.024))


# ---- one pass with a step in flight, by hand -------------------------------------------------------
def _in_flight(state, specs, items=None):
    """Running requests (prompt, outputs, computed, max_tokens), their pages taken for their known
    tokens, and the step in flight (``state.pending``): each request's item goes from its computed
    tokens to its known ones, or is ``items``' (tokens, context) for it."""
    given, items = items, []
    reqs = []
    for i, (prompt, outputs, computed, max_tokens) in enumerate(specs):
        r = Request(i, 0.0, prompt, max_tokens)
        assert state.add_arrival(r, max_tokens, 0.0)
        known = prompt + outputs
        state.kv.allocate(r, known)
        state.admit(r, 0.0)
        r.num_output_tokens, r.num_computed_tokens = outputs, computed
        if outputs:
            state.prefilling.discard(r.req_id)
        items.append(BatchItem(i, *given[i]) if given else BatchItem(i, known - computed, computed))
        reqs.append(r)
    state.pending.append(Batch(tuple(items)))
    return reqs


def test_max_utilization_counts_the_slots_of_the_step_in_flight():
    # 3 pages of 4, no reuse. r0: prompt 8 (2 pages), its whole prompt in flight (8 @ 0). As the
    # KV manager holds its 8 slots, getNeededBlocksOneStep gives its next step, a decode at 8,
    # one page (8 >= 2 x 4); r1 (prompt 4, waiting) needs one too: 1 + 1 > 1 free, so r1 waits
    # and r0 decodes at once, fed the token in flight: (r0, 1 @ 8), its third page taken.
    p = _policy(capacity_scheduler_policy="MAX_UTILIZATION", enable_block_reuse=False)
    state = policy_state(p, 3, 4, 1024)
    (r0,) = _in_flight(state, [(8, 0, 0, 4)])
    r1 = Request(1, 0.0, 4, 4)
    assert state.add_arrival(r1, 4, 0.0)
    assert p.schedule(state, 0.0).items == (BatchItem(0, 1, 8),)
    assert r1.status == Status.WAITING and len(r0.block_ids) == 3 and state.kv.num_free_blocks == 0


def test_a_request_paused_with_a_token_in_flight_keeps_that_token():
    # 3 pages of 4, all taken. r0: prompt 4, 3 outputs (7 known, 2 pages), its decode at 6 in
    # flight; r1: prompt 3, 1 output (4 known, 1 page), its decode at 3 in flight. MAX_UTILIZATION:
    # r0's next decode at 7 fits its 2nd page (7 < 8): 0 pages; r1's at 4 needs a page (4 >= 4),
    # none free: the last started, r1 itself, is paused (its page freed), and nobody waiting is
    # taken. The step: (r0, 1 @ 7). Then the step in flight's results: r0's token 4; r1's token 2
    # is still taken in (_update_requests runs before _pause_requests), so it waits with 2 outputs
    # and recomputes prompt + both.
    p = _policy(capacity_scheduler_policy="MAX_UTILIZATION", enable_block_reuse=False)
    state = policy_state(p, 3, 4, 1024)
    r0, r1 = _in_flight(state, [(4, 3, 6, 6), (3, 1, 3, 6)])
    batch = p.schedule(state, 0.0)
    assert batch.items == (BatchItem(0, 1, 7),)
    assert r1.status == Status.PREEMPTED and list(state.waiting) == [r1] and state.kv.num_free_blocks == 1
    state.pending.append(batch)
    state.commit_pipelined(state.pending[0], 1.0)
    assert (r0.num_output_tokens, r0.num_computed_tokens) == (4, 7)
    assert (r1.num_output_tokens, r1.num_computed_tokens, r1.status) == (2, 0, Status.PREEMPTED)


def test_no_evict_counts_a_prompt_completing_in_flight_as_a_decode_with_its_reservation():
    # 4 pages of 4, no reuse. r0: prompt 8 in flight (2 pages), max_tokens 4: 12 tokens, 3 pages to
    # completion, 1 still to come. r1 (prompt 4, max_tokens 4: 2 pages) waits behind it: 2 free - 1
    # kept back for r0 = 1 < 2. r0 decodes at 8 (its third page), and r1 waits: the same reservation
    # the synchronous loop makes once r0's prompt is in.
    p = _policy(enable_block_reuse=False)
    state = policy_state(p, 4, 4, 1024)
    (r0,) = _in_flight(state, [(8, 0, 0, 4)])
    r1 = Request(1, 0.0, 4, 4)
    assert state.add_arrival(r1, 4, 0.0)
    assert p.schedule(state, 0.0).items == (BatchItem(0, 1, 8),)
    assert r1.status == Status.WAITING and state.kv.num_free_blocks == 1


def test_a_request_finishing_in_flight_keeps_its_capacity_seat_but_is_not_scheduled():
    # max_batch_size 1, 8 pages of 4. r0: prompt 4, 2 outputs, max_tokens 3, its decode at 5 in
    # flight, its token there its last (2 + 1 >= 3): GENERATION_TO_COMPLETE. The capacity scheduler
    # still takes it, filling the one seat, so r1 (waiting, prompt 4) is not taken; the micro batch
    # scheduler leaves r0 out: nothing runs until the step in flight's results free r0.
    p = _policy(max_batch_size=1, enable_block_reuse=False)
    state = policy_state(p, 8, 4, 1024)
    (r0,) = _in_flight(state, [(4, 2, 5, 3)])
    r1 = Request(1, 0.0, 4, 4)
    assert state.add_arrival(r1, 4, 0.0)
    assert isinstance(p.schedule(state, 0.0), Idle)
    assert r1.status == Status.WAITING and len(r0.block_ids) == 2
    state.commit_pipelined(state.pending[0], 1.0)                  # r0's token 3: finished, freed
    assert r0.status == Status.FINISHED and p.schedule(state, 1.0).items == (BatchItem(1, 4, 0),)


@pytest.mark.parametrize("given", [{}, {"disable_overlap_scheduler": False}])
def test_a_live_run_refuses_the_overlap_scheduler_and_names_its_knob(given):
    # the live engine runs one step at a time: it cannot choose a step while another runs
    from sim.base.strict import ConfigError
    from sim.run.config import workload_from_dict
    from sim.run.runner import build_profile, drive
    cfg = workload_from_dict({"name": "live", "seed": 0, "num_requests": 2,
                              "arrivals": {"kind": "poisson", "rate": 1.0},
                              "lengths": {"kind": "fixed", "prompt_tokens": 8, "output_tokens": 4},
                              "policy": {"kind": "tensorrt_llm", **given},
                              "profile": {"model": "llama-2-7b", "gpu": "a100-80gb"}})
    said = "is false" if given else "is unset, which means on"
    with pytest.raises(ConfigError, match=rf"field 'policy.disable_overlap_scheduler' {said}.*set "
                                          r"policy.disable_overlap_scheduler: true to run it live"):
        drive(cfg, build_profile(cfg), 1000, 1024, simpy.Environment(), SimExecutor(STEP), live=True)

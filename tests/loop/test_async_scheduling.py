"""vllm_v1 with async_scheduling on the pipelined loop (sim.loop.server), by hand.

Every step costs 10 ms (a profile with only a per-step overhead). vLLM's
AsyncScheduler chooses a step while the one before it runs, counting that
step's tokens as computed and its sampled tokens as placeholders; outputs,
finishes and frees of a step are seen when it ends, after the next step was
chosen. With no host part separated (the first timelines) the whole 10 ms is
the device's and steps run back to back; with one (``Profile.host_step_s``,
the last timelines) a step's host work runs beside the device's step before
it (sim.loop.server.pipelined_start_s).
"""

from __future__ import annotations

import pytest
import simpy

from conftest import linear_profile, policy_state, step_rows
from policies import make_policy
from policies.vllm_v1 import VllmV1Config
from sim.loop.feed import feed
from sim.loop.server import Server, SimExecutor
from sim.core.request import Request

STEP = linear_profile(per_token_s=0.0, overhead_s=0.010, decode_per_ctx_s=0.0, prefill_per_ctx_s=0.0)


def _run(specs, async_scheduling: bool, step=STEP):
    """(arrival_s, prompt, max_tokens, true output) per request; (server, requests)."""
    env = simpy.Environment()
    policy = make_policy(VllmV1Config(max_num_seqs=8, max_num_batched_tokens=64, enable_prefix_caching=False,
                                      async_scheduling=async_scheduling), 1024)
    server = Server(env, policy, policy_state(policy, 100, 4, 1024), SimExecutor(step))
    reqs = [Request(i, a, p, m) for i, (a, p, m, _) in enumerate(specs)]
    env.process(feed(env, [server], reqs, [o for *_, o in specs]))
    env.run()
    return server, reqs


# r0: t=0, prompt 4, max_tokens 10, stops on EOS after 3 tokens (the scheduler cannot know);
# r1: t=15 ms, prompt 4, max_tokens 2 (a length stop, known in advance).
SPECS = [(0.0, 4, 10, 3), (0.015, 4, 2, 2)]


def test_async_timeline_by_hand() -> None:
    # t=0:  S1 = r0's prompt (4), runs 0-10; S2 chosen at once with S1 in flight: r0 has 4
    #       computed and a placeholder, so one more token: (r0, 1 @ 4).
    # t=10: S1's output: r0's token 1. S2 runs 10-20; S3 chosen: (r0, 1 @ 5).
    # t=20: token 2. S3 runs 20-30; S4 chosen: (r0, 1 @ 6) and r1 (arrived at 15), prompt 4.
    # t=30: token 3, r0 finishes (EOS) and frees. S4 runs 30-40 (r0's token is thrown away);
    #       S5 chosen: (r1, 1 @ 4).
    # t=40: S4's output: r1's token 1. S5 runs 40-50; S6 would be r1 at 5 computed plus its
    #       placeholder = prompt + max_tokens - 1: its token in flight is its last, passed over.
    # t=50: r1's token 2, finished.
    server, (r0, r1) = _run(SPECS, async_scheduling=True)
    assert step_rows(server) == [(0.0, 1, 4, 0), (10.0, 1, 0, 1), (20.0, 1, 0, 1), (30.0, 2, 4, 1), (40.0, 1, 0, 1)]
    assert (r0.first_token_s, r0.finished_s, r0.num_output_tokens) == pytest.approx((0.010, 0.030, 3))
    assert (r1.first_token_s, r1.finished_s, r1.num_output_tokens) == pytest.approx((0.040, 0.050, 2))
    assert server.state.done and not server.state.pending


def test_sync_timeline_by_hand() -> None:
    # The synchronous loop: S1 0-10 r0's prompt; S2 10-20 r0 decodes; at 20 r1 (arrived at 15)
    # joins: S3 20-30 = r0's decode (its 3rd and last token) + r1's prompt (its 1st token);
    # S4 30-40 r1's last token. r1: TTFT 15 ms against 25 ms under async scheduling.
    server, (r0, r1) = _run(SPECS, async_scheduling=False)
    assert step_rows(server) == [(0.0, 1, 4, 0), (10.0, 1, 0, 1), (20.0, 2, 4, 1), (30.0, 1, 0, 1)]
    assert (r0.first_token_s, r0.finished_s) == pytest.approx((0.010, 0.030))
    assert (r1.first_token_s, r1.finished_s) == pytest.approx((0.030, 0.040))


# ---- the SimPy loop against the engine calls of the differential harness -------------------------
# calibrate.serving.vllm_diff.AsyncBatchsimSide drives the policy through vLLM's own engine calls
# (and is checked batch for batch against vLLM's AsyncScheduler); the SimPy loop must choose the
# same batches in the same order. With every request there at the start, arrival timing plays no
# part (the timeline test above pins it), so the two sequences of batches must be equal.
@pytest.mark.parametrize("seed", range(40))
def test_the_simpy_loop_chooses_the_harness_batches(seed: int) -> None:
    pytest.importorskip("vllm")          # the harness's module imports vLLM's side lazily, its cases need it
    from dataclasses import replace

    from calibrate.serving.vllm_diff import AsyncBatchsimSide
    from policies.vllm_v1 import VllmV1Policy
    from sim.core.policy import PolicyContext
    from sim.core.state import SchedulerState
    from test_vllm_v1_differential import async_case, random_case, random_prefix_case

    case = async_case((random_case if seed % 2 else random_prefix_case)(seed), seed)
    case = replace(case, arrival_steps=(0,) * len(case.prompts))
    side = AsyncBatchsimSide(case)
    for i, (p, o) in enumerate(zip(case.prompts, case.outputs)):
        side.add(i, p, o)
    want = []
    while not (side.done and not side.busy):
        want += [[tuple(it) for it in step.items] for _, step in side.tick() if step.items]
    env = simpy.Environment()
    policy = VllmV1Policy(side.policy.config, PolicyContext(case.max_model_len))
    pool = type(side.state.kv)(case.num_blocks - policy.num_reserved_blocks, case.block_size)
    got = []
    server = Server(env, policy, SchedulerState(pool, case.max_model_len), SimExecutor(STEP),
                    on_step=lambda start, batch, result: got.append([tuple(it[:3]) for it in batch.items]))
    eos = case.eos_stops or (False,) * len(case.prompts)
    reqs = [Request(i, 0.0, p, case.max_model_len - p if e else o, content=case.contents[i] if case.contents else None)
            for i, (p, o, e) in enumerate(zip(case.prompts, case.outputs, eos))]
    env.process(feed(env, [server], reqs, list(case.outputs)))
    env.run()
    assert got == want


def test_a_one_token_prompt_item_is_prefill_unless_the_batch_ahead_completes_the_prompt() -> None:
    # steps.csv's prefill count of a pipelined step is taken when the step is chosen, beside the
    # batch in flight: r0 (prompt 5) is admitted with a 4-token chunk in flight; the batch chosen
    # after gives r0 its 5th prompt token, a prefill item. Had the batch in flight held the whole
    # prompt, the one-token item after it would be a decode.
    from sim.core.batch import Batch, BatchItem
    from conftest import add, make_state
    state = make_state(num_blocks=100, block_size=4)
    r = add(state, 0, 5, 4)
    state.admit(r, 0.0)
    assert state.prefill_items(Batch((BatchItem(0, 1, 4),)), Batch((BatchItem(0, 4, 0),))) == 1
    assert state.prefill_items(Batch((BatchItem(0, 1, 5),)), Batch((BatchItem(0, 5, 0),))) == 0


def test_a_prefill_item_whose_request_the_next_choice_preempts_stays_prefill() -> None:
    # Found in review (a random search): 3 slots, 16-token budget, long-prefill threshold 3, 10
    # blocks of 4. A batch [(r2, 3 @ 15), (r3, 1 @ 15)] gives r3 the 16th and last token of its
    # prompt; the choice made while it runs preempts r3, which leaves SchedulerState.prefilling
    # before the batch ends. Counted when the batch ended, r3's token was logged as a decode; it
    # is a prefill token: 4 prefill tokens, 0 decodes, 2 prefill sequences.
    from conftest import linear_profile
    specs = [(0.01, 8, 4, 2), (0.01, 23, 4, 1), (0.02, 27, 4, 3), (0.03, 16, 2, 2), (0.04, 5, 12, 1),
             (0.05, 17, 4, 4), (0.06, 17, 6, 1), (0.07, 28, 6, 5)]
    env = simpy.Environment()
    policy = make_policy(VllmV1Config(max_num_seqs=3, max_num_batched_tokens=16, long_prefill_token_threshold=3,
                                      enable_prefix_caching=False, async_scheduling=True), 256)
    batches = []
    server = Server(env, policy, policy_state(policy, 10, 4, 256), SimExecutor(linear_profile(0, 0.01, 0, 0)),
                    on_step=lambda start, batch, result: batches.append([tuple(it[:3]) for it in batch.items]))
    reqs = [Request(i, a, p, m) for i, (a, p, m, _) in enumerate(specs)]
    env.process(feed(env, [server], reqs, [o for *_, o in specs]))
    env.run()
    rows = [row for *_, ints in server.log.chunks() for row in ints.reshape(-1, 8)]
    (j,) = [k for k, b in enumerate(batches) if b == [(2, 3, 15), (3, 1, 15)]]
    assert reqs[3].num_preemptions == 1
    assert list(rows[j][:5]) == [2, 4, 0, 0, 2]


# ---- the overlap rule: a step's host work runs beside the device's step before it ----------------
# The same 10 ms steps, now with a host part (Profile.host_step_s): sim.loop.server.pipelined_start_s,
# start(N+1) = max(end(N), chosen(N+1) + host(N+1)); step N+1 is chosen when N-1 is committed, at
# start(N), so a steady stream runs at max(host, device) a step. The decisions are the same as in
# test_async_timeline_by_hand (r1, arriving at 15 ms, is first seen by S4's choice in both).
def _run_split(specs, host_s: float, async_scheduling: bool = True):
    from dataclasses import replace
    return _run(specs, async_scheduling, replace(STEP, host_step_s=host_s))


def _durations_ms(server) -> list[float]:
    return [round(d * 1000, 6) for _, ds, _, _ in server.log.chunks() for d in ds]


def test_async_timeline_host_longer_than_device() -> None:
    # host 6 ms, device 10 - 6 = 4 ms: each step waits for its host work, period 6 ms.
    # t=0:  S1 (r0's prompt) chosen; its host work 0-6, device 6-10. S2 chosen at 6: (r0, 1 @ 4).
    # t=6:  S2's host work 6-12; start = max(end S1 10, 12) = 12. At 12 S1 is committed (r0's
    #       token 1), S2 runs 12-16, S3 chosen: (r0, 1 @ 5); host 12-18.
    # t=18: start S3 = max(16, 18) = 18; S2 committed (token 2); S3 18-22; S4 chosen at 18 with
    #       r1 (arrived at 15): (r0, 1 @ 6) + r1's prompt 4; host 18-24.
    # t=24: start S4 = max(22, 24) = 24; S3 committed: r0's 3rd token, EOS, r0 finishes at 24.
    #       S4 24-28; S5 chosen: (r1, 1 @ 4); host 24-30.
    # t=30: start S5 = max(28, 30) = 30; S4 committed: r1's token 1. S5 30-34. Nothing to choose
    #       (r1's token in flight is its last): S5 ends at 34, r1's token 2, finished.
    # Against the sum (10 ms a step, test_async_timeline_by_hand): r1 finishes at 34, not 50 ms.
    server, (r0, r1) = _run_split(SPECS, host_s=0.006)
    assert step_rows(server) == [(6.0, 1, 4, 0), (12.0, 1, 0, 1), (18.0, 1, 0, 1), (24.0, 2, 4, 1), (30.0, 1, 0, 1)]
    assert _durations_ms(server) == [4.0] * 5                # the log's rows: the device's seconds
    assert (r0.first_token_s, r0.finished_s, r0.num_output_tokens) == pytest.approx((0.012, 0.024, 3))
    assert (r1.first_token_s, r1.finished_s, r1.num_output_tokens) == pytest.approx((0.030, 0.034, 2))
    assert server.state.done and not server.state.pending


def test_async_timeline_device_longer_than_host() -> None:
    # host 3 ms, device 7 ms: the host work hides behind the device's step before, period 7 ms.
    # t=0:  S1 host 0-3, device 3-10. S2 chosen at 3, host 3-6; start = max(10, 6) = 10.
    # t=10: S1 committed (r0's token 1); S2 10-17; S3 chosen, host 10-13; start max(17, 13) = 17.
    # t=17: S2 committed (token 2); S3 17-24; S4 chosen with r1 (arrived at 15): (r0, 1 @ 6) +
    #       r1's prompt; host 17-20; start max(24, 20) = 24.
    # t=24: S3 committed: r0's 3rd token, finished. S4 24-31; S5 (r1, 1 @ 4) chosen, host 24-27.
    # t=31: S4 committed: r1's token 1; S5 31-38; at 38 r1's token 2, finished.
    # Only the first step, with nothing in flight, pays its host work before its forward pass.
    server, (r0, r1) = _run_split(SPECS, host_s=0.003)
    assert step_rows(server) == [(3.0, 1, 4, 0), (10.0, 1, 0, 1), (17.0, 1, 0, 1), (24.0, 2, 4, 1), (31.0, 1, 0, 1)]
    assert _durations_ms(server) == [7.0] * 5
    assert (r0.first_token_s, r0.finished_s) == pytest.approx((0.010, 0.024))
    assert (r1.first_token_s, r1.finished_s) == pytest.approx((0.031, 0.038))


def test_a_host_part_leaves_the_synchronous_loop_as_it_was() -> None:
    # The synchronous loop pays host and device one after the other: the same 10 ms steps,
    # whatever part of them is host work (test_sync_timeline_by_hand's timeline).
    plain, plain_reqs = _run(SPECS, async_scheduling=False)
    split, split_reqs = _run_split(SPECS, host_s=0.006, async_scheduling=False)
    assert step_rows(split) == step_rows(plain) == [(0.0, 1, 4, 0), (10.0, 1, 0, 1), (20.0, 2, 4, 1), (30.0, 1, 0, 1)]
    assert _durations_ms(split) == _durations_ms(plain) == [10.0] * 4
    assert [(r.first_token_s, r.finished_s) for r in split_reqs] == [(r.first_token_s, r.finished_s)
                                                                    for r in plain_reqs]


def test_the_overlap_rule() -> None:
    from sim.loop.server import pipelined_start_s
    assert pipelined_start_s(None, 0.5, 0.25) == 0.75     # nothing on the device: once the host is done
    assert pipelined_start_s(2.0, 0.5, 0.25) == 2.0       # device busy until 2: 0.5 + 0.25 hidden under it
    assert pipelined_start_s(0.625, 0.5, 0.25) == 0.75    # host longer: the device waits 0.125
    assert pipelined_start_s(2.0, 0.5, 0.0) == 2.0        # no host part: back to back, as before

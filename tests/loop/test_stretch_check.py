"""The fast path's declarations are checked, not trusted.

A server built with ``check_stretch`` plans every stretch as the fast path
does (``sim.loop.stretch``), then steps each planned iteration through the
policy and fails on the first that differs. Every policy of the table
(``tests/policies/cases.py``) that declares a stretch runs so on random
workloads; a policy whose declaration lies is caught; a policy that spins on
Idle is stopped (tests/loop/test_guards.py).
"""

from __future__ import annotations

from collections import deque

import pytest
from cases import CASES, KINDS
from conftest import simulate
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import sim.loop.server
from policies import POLICIES
from policies.vllm_v1 import VllmV1Config, VllmV1Policy
from sim.core.batch import Idle
from sim.core.policy import PolicyContext
from sim.loop.stretch import StretchMismatch

STRETCHING = [kind for kind in KINDS if POLICIES[kind][1].decode_stretch]
WORKLOADS = st.lists(st.tuples(st.floats(0.0, 0.05), st.integers(1, 300), st.integers(1, 80)), min_size=1,
                     max_size=30)


def _run(specs, cfg, num_blocks, *, fast: bool, check: bool = False, policy=None, contents=None):
    sim.loop.server.FAST_PATH = fast
    try:
        server, reqs = simulate(specs, cfg, num_blocks=num_blocks, block_size=8, max_model_len=512,
                                check_stretch=check, policy=policy, contents=contents)
    finally:
        sim.loop.server.FAST_PATH = True
    return server, [(r.first_token_s, r.finished_s, r.num_output_tokens, r.num_preemptions, r.num_cached_tokens)
                    for r in reqs]


def _specs(raw):
    t, out = 0.0, []
    for gap, prompt, output in raw:
        t += gap
        out.append((t, prompt, output))
    return out


def test_every_policy_that_stretches_is_checked() -> None:
    assert STRETCHING, "no policy declares a stretch: the check below would check nothing"
    assert set(STRETCHING) == {k for k, (_, cls) in POLICIES.items() if cls.decode_stretch}


@pytest.mark.parametrize("kind", STRETCHING)
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), raw=WORKLOADS, num_blocks=st.integers(64, 160))
def test_check_mode_steps_every_stretch_as_planned(kind, data, raw, num_blocks) -> None:
    # 64..160 blocks of 8 tokens for prompts of up to 300 + 80 outputs: the pool runs dry and
    # preempts, stretches stop at dry pools, finishes and arrivals.
    cfg = data.draw(st.builds(POLICIES[kind][0], **CASES[kind].ranges))
    specs = _specs(raw)
    checked, got = _run(specs, cfg, num_blocks, fast=True, check=True)      # raises StretchMismatch
    _, fast = _run(specs, cfg, num_blocks, fast=True)
    _, stepped = _run(specs, cfg, num_blocks, fast=False)
    assert got == fast == stepped


SHARED = st.lists(st.tuples(st.floats(0.0, 0.05), st.integers(0, 3), st.integers(0, 120), st.integers(1, 80)),
                  min_size=1, max_size=30)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(raw=SHARED, num_blocks=st.integers(40, 160), reserve=st.booleans(),
       budget=st.sampled_from([32, 64, 600]))
def test_check_mode_with_shared_prefixes(raw, num_blocks, reserve, budget) -> None:
    # vllm_v1 with prefix caching: each request is one of 4 prefixes (0 .. 3 x 50 tokens, prefix 0
    # empty) + its own suffix; 40..160 blocks of 8 evict cached prefixes and preempt. Checked ==
    # fast == stepped, whichever way reserve_full_prompt makes the policy stretch.
    specs, contents, t = [], [], 0.0
    for i, (gap, prefix, suffix, output) in enumerate(raw):
        t += gap
        runs = ((7, 50 * prefix) if prefix else ()) + ((1000 + i, suffix) if suffix else ())
        if not runs:
            runs = (1000 + i, 1)
        prompt = sum(runs[1::2])
        specs.append((t, prompt, output))
        contents.append((5000 + i, *runs))
    cfg = VllmV1Config(max_num_seqs=8, max_num_batched_tokens=budget, reserve_full_prompt=reserve,
                       async_scheduling=False)       # the fast path is the synchronous loop's
    server, checked = _run(specs, cfg, num_blocks, fast=True, check=True, contents=contents)
    assert server.state.kv.caching
    _, fast = _run(specs, cfg, num_blocks, fast=True, contents=contents)
    _, stepped = _run(specs, cfg, num_blocks, fast=False, contents=contents)
    assert checked == fast == stepped


@pytest.mark.parametrize("kind", STRETCHING)
def test_check_mode_really_checks_steps(kind) -> None:
    # Not a check that checks nothing: on a busy run most steps are planned and then stepped. A
    # policy that never stretches while requests wait (lmdeploy) gets its requests spaced out.
    gap_s = 0.001 if CASES[kind].stretches_while_waiting else 0.05
    specs = [(gap_s * i, 40 + 7 * i, 30 + i % 9) for i in range(24)]
    # The fast path is the synchronous loop's: a policy's pipelined loop (vLLM's async scheduling,
    # SGLang's overlap), if it has one, is off.
    knob_name = POLICIES[kind][1].pipelined_knob
    sync = {knob_name: POLICIES[kind][1].pipelined_off} if knob_name else {}
    cfg = POLICIES[kind][0](**CASES[kind].small, **sync)
    server, _ = _run(specs, cfg, 400, fast=True, check=True)
    assert server.num_stretch_steps_checked > 0.3 * len(server.log), (server.num_stretch_steps_checked,
                                                                      len(server.log))


class HeldAdmissions(VllmV1Policy):
    """vllm_v1 that admits only in even 10 ms ticks: a time-based rule, so the
    same queue gives different batches at different times, yet it keeps
    ``decode_stretch = True`` from its parent. The fast path would skip the
    tick where admission opens (nothing is scheduled there)."""

    TICK_S = 0.01

    def schedule(self, state, now_s):
        if not state.waiting or int(now_s / self.TICK_S) % 2 == 0:
            return super().schedule(state, now_s)
        waiting, state.waiting = state.waiting, deque()           # hold admissions this tick
        try:
            decision = super().schedule(state, now_s)
        finally:
            waiting.extendleft(reversed(state.waiting))            # preempted ones go back in front
            state.waiting = waiting
        if isinstance(decision, Idle):
            return Idle(wake_at_s=(int(now_s / self.TICK_S) + 1) * self.TICK_S)
        return decision


def test_a_declaration_that_lies_is_caught() -> None:
    specs = [(0.0, 50, 400)] + [(0.0015 + 0.013 * i, 30, 5) for i in range(8)]
    policy = HeldAdmissions(VllmV1Config(max_num_seqs=16, max_num_batched_tokens=256, async_scheduling=False),
                            PolicyContext(512))
    _, stepped = _run(specs, None, 400, fast=False, policy=policy)
    _, fast = _run(specs, None, 400, fast=True, policy=policy)
    assert fast != stepped                    # the lie changes results: why the flag must be checked
    with pytest.raises(StretchMismatch, match="HeldAdmissions at t=.*num_waiting|HeldAdmissions at t=.*requests"):
        _run(specs, None, 400, fast=True, check=True, policy=policy)


def test_a_cached_resume_that_looks_like_a_decode_is_no_evidence() -> None:
    # Found by the property test above: TensorRT-LLM under MAX_UTILIZATION pauses request 2
    # (prompt 229, 4 outputs) and caches its blocks; it resumes with 232 tokens found cached
    # and 1 computed, a one-token item that looks like a decode, while its chunk took 233 of
    # the 236-token budget (TensorRT-LLM sizes a chunk before the lookup), so request 3
    # (4 tokens) waited. The step after is a plain decode of request 2 and admits request 3
    # (1 + 4 <= 236): an admission in the step just run must stop the fast path's inference.
    from policies.tensorrt_llm import TensorRtLlmConfig
    cfg = TensorRtLlmConfig(max_batch_size=8, max_num_tokens=236, tokens_per_block=16,
                            capacity_scheduler_policy="MAX_UTILIZATION",
                            disable_overlap_scheduler=True)      # the fast path is the synchronous loop's
    specs = _specs([(0.0, 95, 80), (0.03125, 214, 67), (0.0, 229, 6), (0.0, 4, 62)])
    _, got = _run(specs, cfg, 64, fast=True, check=True)      # raised StretchMismatch before
    _, stepped = _run(specs, cfg, 64, fast=False)
    assert got == stepped


def test_the_end_of_a_recompute_is_no_decode_to_stretch() -> None:
    # Found by the property test above: TensorRT-LLM under MAX_UTILIZATION pauses a request, which
    # later recomputes and ends its recompute with one token: a prefill item for the step log
    # (SchedulerState.prefilling), though it looks like a decode (one token, context = known - 1).
    # The fast path planned it as a decode row; it must step it.
    from policies.tensorrt_llm import TensorRtLlmConfig
    cfg = TensorRtLlmConfig(max_batch_size=3, max_num_tokens=16, tokens_per_block=8, enable_chunked_prefill=True,
                            capacity_scheduler_policy="MAX_UTILIZATION", context_chunking_policy="EQUAL_PROGRESS",
                            disable_overlap_scheduler=True)      # the fast path is the synchronous loop's
    specs = _specs([(0.0, 213, 29), (0.0, 230, 29), (0.0, 107, 15)])
    _, got = _run(specs, cfg, 78, fast=True, check=True)      # raised StretchMismatch before
    _, stepped = _run(specs, cfg, 78, fast=False)
    assert got == stepped

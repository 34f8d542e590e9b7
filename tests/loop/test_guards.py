"""The loop's guards against a policy that breaks its contract (``sim.core.policy.PolicyError``).

A run that makes no progress (no token computed, no request admitted, finished
or arrived) is stopped, naming the policy and its last decisions, whether the
policy asks to be woken at once, ever a nanosecond later, or every second
forever; an empty batch and a decision that is neither Batch nor Idle are
refused at once. ``sim run`` prints each as one line and exits 1.
"""

from __future__ import annotations

import time

import pytest
from conftest import linear_profile, simulate

import sim.loop.server
from policies import POLICIES
from policies.vllm import VllmPolicy
from sim.core.batch import Batch, BatchItem, Idle
from sim.core.policy import PolicyContext, PolicyError


class Waking(VllmPolicy):
    """Never schedules while requests wait: asks to be called again ``delay_s`` later, forever
    (after ``honest`` calls that schedule as vllm does)."""

    delay_s = 0.0
    honest = 0

    def schedule(self, state, now_s):
        if self.honest > 0:
            self.honest -= 1
            return super().schedule(state, now_s)
        return Idle(wake_at_s=now_s + self.delay_s)


def waking(delay_s: float, honest: int = 0) -> Waking:
    policy = Waking(POLICIES["vllm"][0](), PolicyContext(512))
    policy.delay_s, policy.honest = delay_s, honest
    return policy


@pytest.mark.parametrize("delay_s", [0.0, 1e-9])
def test_a_policy_that_spins_on_idle_is_stopped_at_once(delay_s: float) -> None:
    # Idle(now) and Idle(now + 1e-9): 100 decisions (SPIN_DECISIONS) within 1 us (SPIN_S) of
    # simulated time with nothing changed. Before the guard, Idle(now + 1e-9) ran for a minute
    # without a line of output until it was killed.
    t0 = time.perf_counter()
    with pytest.raises(PolicyError, match=r"policy Waking made no progress in 100 decisions in a row, from t=0 s "
                                          r"to t=.* \(no token computed.*1 waiting, 0 running\); the last: "
                                          r"Idle\(wake_at_s=.*\) at t="):
        simulate([(0.0, 10, 2)], None, policy=waking(delay_s), profile=linear_profile())
    assert time.perf_counter() - t0 < 5.0


def test_a_policy_that_idles_forever_is_stopped(monkeypatch) -> None:
    # Idle(now + 1 s) for ever: no spin, but MAX_IDLE_DECISIONS decisions in a row without progress
    # (1,000 here, 100,000 in a run) while a request waits.
    monkeypatch.setattr(sim.loop.server, "MAX_IDLE_DECISIONS", 1000)
    with pytest.raises(PolicyError, match=r"made no progress in 1,000 decisions in a row, from t=0 s to t=999 s"):
        simulate([(0.0, 10, 2)], None, policy=waking(1.0), profile=linear_profile())


def test_a_few_wakes_a_moment_apart_are_not_a_stall() -> None:
    # A deadline that float rounding misses comes back once or twice; 99 such wakes in a row
    # (one fewer than SPIN_DECISIONS) followed by work are not stopped.

    class Then(Waking):
        calls = 0

        def schedule(self, state, now_s):
            Then.calls += 1
            return Idle(wake_at_s=now_s + 1e-9) if Then.calls < 100 else VllmPolicy.schedule(self, state, now_s)

    policy = Then(POLICIES["vllm"][0](), PolicyContext(512))
    server, (r,) = simulate([(0.0, 10, 2)], None, policy=policy, profile=linear_profile())
    assert r.num_output_tokens == 2 and Then.calls > 100


class Padding(VllmPolicy):
    """Runs steps that compute nothing: a finished slot's padding token, for ever (stepped: the fast
    path would decode the request on its own)."""

    decode_stretch = False

    def schedule(self, state, now_s):
        if not state.running:
            return super().schedule(state, now_s)        # the prefill admits the request
        r = state.running[0]
        return Batch((BatchItem(r.req_id, 0, r.num_computed_tokens, 1),))


def test_steps_that_compute_nothing_are_no_progress(monkeypatch) -> None:
    monkeypatch.setattr(sim.loop.server, "MAX_IDLE_DECISIONS", 500)
    policy = Padding(POLICIES["vllm"][0](), PolicyContext(512))
    with pytest.raises(PolicyError, match=r"policy Padding made no progress in 500 decisions.*0 waiting, 1 running"):
        simulate([(0.0, 10, 5)], None, policy=policy, profile=linear_profile())


class Empty(VllmPolicy):
    def schedule(self, state, now_s):
        return Batch(())


class Nothing(VllmPolicy):
    def schedule(self, state, now_s):
        return None


@pytest.mark.parametrize("cls, words", [(Empty, r"policy Empty returned an empty Batch at t=0 s \(0 waiting, "
                                                r"0 running\): a Batch holds work; return Idle"),
                                        (Nothing, r"policy Nothing returned None at t=0 s: schedule\(\) returns "
                                                  r"a Batch or an Idle")])
def test_an_empty_batch_or_no_decision_is_refused_with_the_policys_name(cls, words: str) -> None:
    with pytest.raises(PolicyError, match=words):
        simulate([(0.0, 10, 2)], None, policy=cls(POLICIES["vllm"][0](), PolicyContext(512)),
                 profile=linear_profile())


class Never(VllmPolicy):
    """Never schedules anything, and asks to be woken by nothing but an arrival."""

    def schedule(self, state, now_s):
        return Idle()


def test_a_run_left_with_a_request_it_never_ran_names_the_policy_and_the_request() -> None:
    # The one request (prompt 4,000 + max_tokens 95) waits when the arrivals end: the run stops
    # with one line naming the policy, the request, its tokens and the pool (256 x 16 = 4,096).
    import simpy

    from sim.loop.server import SimExecutor
    from sim.run.config import workload_from_dict
    from sim.run.runner import build_profile, drive
    cfg = workload_from_dict({"name": "never", "num_requests": 1, "arrivals": {"kind": "all_at_once"},
                              "lengths": {"kind": "fixed", "prompt_tokens": 4000, "output_tokens": 95},
                              "server": {"num_blocks": 256, "max_model_len": 4096}})
    profile = build_profile(cfg)
    with pytest.raises(PolicyError, match=r"^policy vllm: the run stalled with 1 request\(s\) unfinished, first request "
                                          r"0 \(4,000 prompt \+ 95 max_tokens tokens, waiting, 0 computed, on a pool "
                                          r"of 4,096 tokens\): nothing was left to happen but it never finished$"):
        drive(cfg, profile, 256, 4096, simpy.Environment(), SimExecutor(profile),
              policy=Never(cfg.policy, PolicyContext(4096)))

"""The loop's fast path (sim.loop.stretch) changes nothing but speed.

Every bundled example, under every policy, is simulated twice, stepping one
iteration at a time (``sim.loop.server.FAST_PATH = False``) and with decode-only
stretches computed at once, and the per-request table, the step log, the token
log and the summary must be identical: not close, identical, because a stretch
prices each step with the same floating-point operations in the same order
(``Profile.decode_stretch_s``) and sums the end times sequentially as stepping does.
Cases with preemption cascades, a dry KV pool mid-stretch, replicas and
out-of-range curve lookups cover the stretch's stopping rules.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import pandas as pd
import pytest
from cases import CASES, KINDS

import sim.loop.server
from policies import make_policy
from policies.config import policy_config
from sim.run.config import load_workload, load_yaml_mapping, workload_from_dict
from sim.run.runner import run_workload

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ("azure_conv", "azure_code", "arxiv_long_prompt", "mixed_lengths", "sharegpt_poisson",
            "concurrency_sharegpt", "prefix_repetition")
POLICIES = KINDS                   # every policy (tests/policies/cases.py)


def _both(make_cfg, **kw):
    """(stepped, fast) results of the same workload."""
    out = []
    for fast in (False, True):
        sim.loop.server.FAST_PATH = fast
        try:
            out.append(run_workload(make_cfg(), **kw))
        finally:
            sim.loop.server.FAST_PATH = True
    return out


def _assert_identical(stepped, fast) -> None:
    for name in ("requests", "steps", "tokens"):
        pd.testing.assert_frame_equal(getattr(stepped, name), getattr(fast, name), check_exact=True,
                                      obj=name)
    assert stepped.summary == fast.summary


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("example", EXAMPLES)
def test_fast_path_identical_on_bundled_examples(example: str, policy: str) -> None:
    path = ROOT / "workloads" / f"{example}.yaml"
    data = {**load_yaml_mapping(path), "num_requests": 250, "policy": {"kind": policy}}  # its defaults
    data.pop("duration_s", None)
    stepped, fast = _both(lambda: workload_from_dict(data, str(path), path.parent))
    _assert_identical(stepped, fast)
    assert stepped.summary["completed"] > 0


def _tight(policy: dict, num_tokens: int, **extra) -> dict:
    """Long outputs on a small KV pool of ``num_tokens`` token slots (in blocks of the
    policy's page, else 16 tokens): decodes run the pool dry and preempt."""
    block_size = make_policy(policy_config(policy, "<tight>"), 1024).block_size or 16
    return {"name": "tight", "seed": 3, "num_requests": 120,
            "arrivals": {"kind": "gamma", "rate": 40.0, "cv": 2.0},
            "lengths": {"kind": "uniform", "prompt_min": 16, "prompt_max": 300,
                        "output_min": 20, "output_max": 400},
            "policy": policy, "server": {"num_blocks": num_tokens // block_size, "max_model_len": 1024, **extra},
            "profile": {"model": "llama-2-7b", "gpu": "a100-80gb"}}


@pytest.mark.parametrize("extra", [{}, {"server.num_blocks": 4000, "server.max_model_len": 48000}])
def test_fast_path_identical_on_the_mooncake_trace_with_prefix_caching(extra: dict) -> None:
    # 250 requests of the bundled Mooncake trace (hash ids: 53% of prompt tokens cached over the
    # whole trace), vllm_v1 with prefix caching; with a 4,000-block pool the cache evicts (and
    # prompts beyond its 48,000-token context are rejected).
    path = ROOT / "workloads" / "mooncake_prefix.yaml"
    cfg = load_workload(path, {"num_requests": 250, **extra})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")          # the rejections
        stepped, fast = _both(lambda: cfg)
    _assert_identical(stepped, fast)
    assert fast.summary["prefix_cache_hits"] > 0
    assert (fast.summary["prefix_cache_evicted_blocks"] > 0) == bool(extra)


@pytest.mark.parametrize("kind", KINDS)
def test_fast_path_identical_under_memory_pressure(kind: str) -> None:
    # 1,920 token slots (120 blocks x 16; max_model_len 1,024) for requests of up to 700 tokens: the pool
    # runs dry in the middle of decode stretches, so a stretch must stop at the step whose block
    # allocation would fail and leave the preemption to the stepped path. The case says whether the
    # policy preempts there (those that reserve at admission never do).
    stepped, fast = _both(lambda: workload_from_dict(_tight({"kind": kind, **CASES[kind].tight}, 1920)))
    _assert_identical(stepped, fast)
    assert (stepped.summary["num_preemptions"] > 0) == CASES[kind].preempts, stepped.summary["num_preemptions"]


@pytest.mark.parametrize("router", ["round_robin", "least_tokens"])
@pytest.mark.parametrize("kind", KINDS)
def test_fast_path_identical_with_replicas(kind: str, router: str) -> None:
    # Other replicas' steps are the events that bound a stretch here.
    cfg = lambda: workload_from_dict(_tight({"kind": kind, **CASES[kind].tight}, 6400))   # noqa: E731
    stepped, fast = _both(cfg, num_replicas=3, router=router)
    _assert_identical(stepped, fast)


def test_fast_path_counts_out_of_range_lookups_as_stepping_does() -> None:
    # A tiny measured profile priced far outside its grid: every lookup is counted per step.
    cfg = lambda: load_workload(ROOT / "workloads" / "validate_tiny.yaml",   # noqa: E731
                                {"num_requests": 60, "arrivals.rate": 400.0})
    stepped, fast = _both(cfg)
    _assert_identical(stepped, fast)


def test_fast_path_really_skips_steps(monkeypatch) -> None:
    # Not a test that cannot fail: with the fast path on, most decode steps never reach the
    # policy. Count schedule() calls both ways on the same run.
    from policies.vllm import VllmPolicy
    calls = {"n": 0}
    original = VllmPolicy.schedule

    def counting(self, state, now_s):
        calls["n"] += 1
        return original(self, state, now_s)

    monkeypatch.setattr(VllmPolicy, "schedule", counting)
    counts = []
    for fast in (False, True):
        calls["n"] = 0
        sim.loop.server.FAST_PATH = fast
        try:
            result = run_workload(load_workload(ROOT / "workloads" / "azure_conv.yaml", {"num_requests": 300}))
        finally:
            sim.loop.server.FAST_PATH = True
        counts.append((calls["n"], result.summary["num_steps"]))
    (stepped_calls, steps), (fast_calls, fast_steps) = counts
    assert steps == fast_steps
    assert stepped_calls >= steps                 # one call per step, plus idle checks
    assert fast_calls < 0.5 * stepped_calls, counts


@pytest.mark.parametrize("example,extra", [("azure_conv", {}), ("azure_conv", {"policy.kind": "static"}),
                                           ("azure_conv", {"policy.kind": "sarathi"}),
                                           ("concurrency_sharegpt", {"arrivals.think_time_s": 0.5})])
def test_stretches_run_through_finishes_and_events(monkeypatch, example: str, extra: dict) -> None:
    # The stretch's two ends that stepping would otherwise run (and, for sarathi, its chunked
    # prefills: case (c)): the step that samples a
    # request's last token (committed in the stretch, the request finishes) and the step
    # during which the next event comes (committed after the server yields to it). Both
    # must really happen on these runs (an open loop, static groups, and a closed loop
    # whose clients wait on each finish and think before sending again: their sends are
    # the events), and the results stay those of stepping.
    import sim.core.state
    import sim.loop.stretch
    seen = {"finishing": 0, "crossing": 0, "crossing_finishing": 0, "chunk": 0, "completes": 0}
    commit, apply = sim.core.state.SchedulerState.commit_decode_stretch, sim.loop.stretch._apply

    def counting_commit(self, live, ids, ends, finishing, prefilling=None, prefill_tokens=0, completes=False):
        seen["finishing"] += bool(finishing)
        seen["chunk"] += prefilling is not None
        seen["completes"] += completes
        return commit(self, live, ids, ends, finishing, prefilling, prefill_tokens, completes)

    def counting_apply(server, plan):
        if plan.crossing_s is not None:            # a stretch through the next event
            seen["crossing"] += 1
            seen["crossing_finishing"] += bool(plan.finishing)
        return apply(server, plan)

    monkeypatch.setattr(sim.core.state.SchedulerState, "commit_decode_stretch", counting_commit)
    monkeypatch.setattr(sim.loop.stretch, "_apply", counting_apply)
    path = ROOT / "workloads" / f"{example}.yaml"
    stepped, fast = _both(lambda: load_workload(path, {"num_requests": 300, **extra}))
    _assert_identical(stepped, fast)
    assert seen["finishing"] > 0 and seen["crossing"] > 0 and seen["crossing_finishing"] > 0, seen
    # Case (c): sarathi's chunked prefills of the conversation trace's long prompts run in stretches.
    assert (seen["chunk"] > 0) == (extra.get("policy.kind") == "sarathi"), seen
    assert (seen["completes"] > 0) == (extra.get("policy.kind") == "sarathi"), seen


@pytest.mark.parametrize("policy", POLICIES)
def test_check_mode_on_a_bundled_trace(policy: str) -> None:
    # The conversation trace under each policy's defaults, every stretch planned and then
    # stepped through the policy (``check_stretch``): no step differs, and the result is the fast path's.
    path = ROOT / "workloads" / "azure_conv.yaml"
    data = {**load_yaml_mapping(path), "num_requests": 250, "policy": {"kind": policy}}
    checked = run_workload(workload_from_dict(data, str(path), path.parent), check_stretch=True)
    fast = run_workload(workload_from_dict(data, str(path), path.parent))
    _assert_identical(checked, fast)

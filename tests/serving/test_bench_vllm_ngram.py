"""Pins the server-free parts of benchmarks/bench_vllm_ngram.py: the repetitive prompts, the
acceptance arithmetic from vLLM's spec-decode counters and the speculative re-simulation."""

from __future__ import annotations

import argparse
import sys
import types
from pathlib import Path

import numpy as np
import pytest

from calibrate.serving.content import ReplayPlan
from sim.run.config import workload_from_dict

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
import bench_vllm_ngram as bench  # noqa: E402

PROFILE = ROOT / "calibrate" / "profiles" / "cpu" / "tiny-llama" / "float32.yaml"


def test_each_prompt_repeats_its_own_unit():
    prompts, outputs, contents = bench.repetitive(3, prompt_len=40, unit_len=16, output_len=8)
    assert prompts.tolist() == [40, 40, 40] and outputs.tolist() == [8, 8, 8]
    plan = ReplayPlan.of_requests(contents, prompts, vocab_size=4096, salt=5, avoid=(0, 1, 2))
    ids = [np.array(plan.prompt(i)) for i in range(3)]
    # 40 = 16 + 16 + 8: two whole copies of the unit, then its first 8 tokens
    for p in ids:
        assert len(p) == 40 and (p[:16] == p[16:32]).all() and (p[:8] == p[32:]).all()
    assert not set(ids[0][:16]) & set(ids[1][:16])          # requests share nothing (~1e-50 by chance)


def test_acceptance_from_counter_growth():
    before = {"drafts": 10.0, "draft_tokens": 30.0, "accepted": 20.0, "per_pos": [10.0, 6.0, 4.0]}
    after = {"drafts": 110.0, "draft_tokens": 302.0, "accepted": 290.0, "per_pos": [110.0, 96.0, 84.0]}
    # 100 drafts, 272 draft tokens, 270 accepted (100 + 90 + 80); 376 decode tokens = 106 steps + 270
    acc = bench.acceptance(bench.grown(before, after), num_decode_tokens=376)
    assert acc["num_drafts"] == 100 and acc["num_accepted_tokens"] == 270
    assert acc["accepted_per_pos"] == [100, 90, 80]
    assert acc["rates"] == pytest.approx([1.0, 0.9, 0.8])
    assert acc["acceptance_rate"] == pytest.approx(270 / 272)
    assert acc["mean_acceptance_length"] == pytest.approx(3.7)
    assert acc["decode_steps"] == 106 and acc["drafted_share"] == pytest.approx(100 / 106)
    assert acc["step_rates"] == pytest.approx([100 / 106, 90 / 106, 80 / 106])


def test_resimulation_takes_the_measured_rates():
    args = argparse.Namespace(num_requests=6, prompt_len=64, unit_len=16, output_len=24, seed=0)
    cfg, specs = bench.case(args, None)
    assert cfg.policy.speculative is None and cfg.policy.async_scheduling is False
    sim_cfg = workload_from_dict({**cfg.raw, "profile": {"path": str(PROFILE)}}, cfg.source)
    v = types.SimpleNamespace(sim_cfg=sim_cfg)
    s = bench.simulate(v, specs, {"method": "ngram", "num_speculative_tokens": 3,
                                  "acceptance_rates": [1.0, 1.0, 1.0]}).summary
    # every draft accepted: 4 tokens a verify step, so each request's 23 tokens after the first
    # take 6 verify steps (5 x 4 = 20, then 4 of which 3 are kept); as vLLM, the counters take
    # all 3 drafts of the last step as accepted: 6 x 3 = 18 a request
    assert s["spec_decode_num_drafts"] == 6 * 6
    assert s["spec_decode_num_accepted_tokens"] == 6 * 18
    assert s["completed"] == 6

"""Trace loaders: providers' own formats, rescaling, determinism."""

from __future__ import annotations

import json

import numpy as np
import pytest

from sim.config import ConfigError, workload_from_dict
from workloads.generate import generate
from workloads.traces import load_trace


def test_azure_original_format_with_datetimes(tmp_path):
    p = tmp_path / "AzureLLMInferenceTrace_conv.csv"
    p.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n"
                 "2023-11-16 18:15:46.6813580,374,44\n"
                 "2023-11-16 18:15:50.9959370,396,109\n")
    t = load_trace(p, need_arrivals=True)
    assert t.arrival_s.tolist() == pytest.approx([0.0, 4.314579])
    assert t.prompt_tokens.tolist() == [374, 396]


def test_vidur_and_burstgpt_columns(tmp_path):
    p = tmp_path / "v.csv"
    p.write_text("arrived_at,num_prefill_tokens,num_decode_tokens\n0.5,10,3\n1.5,20,4\n")
    t = load_trace(p, need_arrivals=True)
    assert t.arrival_s.tolist() == [0.0, 1.0]
    b = tmp_path / "burst.csv"
    b.write_text("Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n"
                 "5,ChatGPT,100,20,120,Conversation log\n6,ChatGPT,80,0,80,Conversation log\n"
                 "9,GPT-4,50,10,60,API log\n")
    t = load_trace(b, need_arrivals=True)
    assert t.num_dropped == 1                        # a failed call (0 response tokens)
    assert t.arrival_s.tolist() == [0.0, 4.0]


def test_mooncake_jsonl_in_milliseconds(tmp_path):
    p = tmp_path / "m.jsonl"
    rows = [{"timestamp": 0, "input_length": 9000, "output_length": 5, "hash_ids": [1]},
            {"timestamp": 25000, "input_length": 100, "output_length": 7, "hash_ids": [2]}]
    p.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    t = load_trace(p, need_arrivals=True)
    assert t.arrival_s.tolist() == [0.0, 25.0]


def test_unsorted_trace_is_sorted_stably(tmp_path):
    p = tmp_path / "u.csv"
    p.write_text("arrival_time_s,prompt_tokens,output_tokens\n3,1,1\n1,2,2\n1,3,3\n")
    t = load_trace(p, need_arrivals=True)
    assert t.prompt_tokens.tolist() == [2, 3, 1]


def test_custom_column_names(tmp_path):
    p = tmp_path / "c.csv"
    p.write_text("t,in,out\n0,5,6\n2,7,8\n")
    cfg = workload_from_dict({"name": "c", "arrivals": {"kind": "trace", "path": str(p),
                                                         "columns": {"arrival": "t", "prompt": "in", "output": "out"}},
                              "lengths": {"kind": "trace"}}, str(tmp_path / "w.yaml"), tmp_path)
    specs = generate(cfg)
    assert specs.output_tokens.tolist() == [6, 8]
    bad = workload_from_dict({**cfg.raw, "arrivals": {**cfg.raw["arrivals"], "columns": {"arrival": "x"}}},
                             "w.yaml", tmp_path)
    with pytest.raises(ConfigError, match="column 'x'"):
        generate(bad)


def _conv(**arrivals):
    return workload_from_dict({"name": "a", "arrivals": {"kind": "trace", "path": "azure_llm_2023_conv.csv",
                                                          **arrivals}, "lengths": {"kind": "trace"}})


def test_bundled_trace_rescaling_and_repeat():
    base = generate(_conv())
    assert len(base) == 19366 and base.arrival_s[0] == 0.0
    faster = generate(_conv(rate_scale=2.0))
    assert faster.arrival_s[-1] == pytest.approx(base.arrival_s[-1] / 2)
    rated = generate(_conv(rate=10.0))
    assert (len(rated) - 1) / rated.arrival_s[-1] == pytest.approx(10.0)
    twice = generate(_conv(repeat=2))
    assert len(twice) == 2 * len(base) and np.all(np.diff(twice.arrival_s) >= 0)


def test_synthetic_arrivals_and_lengths_are_deterministic_and_have_the_asked_rate():
    d = {"name": "s", "seed": 3, "num_requests": 20000, "arrivals": {"kind": "gamma", "rate": 8.0, "cv": 3.0},
         "lengths": {"kind": "lognormal", "prompt_mean": 500, "output_mean": 100, "sigma": 0.8}}
    a, b = generate(workload_from_dict(d)), generate(workload_from_dict(d))
    assert np.array_equal(a.arrival_s, b.arrival_s) and np.array_equal(a.prompt_tokens, b.prompt_tokens)
    gaps = np.diff(a.arrival_s)
    assert 1 / gaps.mean() == pytest.approx(8.0, rel=0.05)
    assert gaps.std() / gaps.mean() == pytest.approx(3.0, rel=0.1)
    assert a.prompt_tokens.mean() == pytest.approx(500, rel=0.05)
    # changing the length model leaves the arrival times alone (independent streams)
    c = generate(workload_from_dict({**d, "lengths": {"kind": "fixed", "prompt_tokens": 1, "output_tokens": 1}}))
    assert np.array_equal(a.arrival_s, c.arrival_s)


def test_duration_limits_synthetic_requests():
    specs = generate(workload_from_dict({"name": "d", "duration_s": 100, "arrivals": {"kind": "poisson", "rate": 5},
                                         "lengths": {"kind": "uniform", "prompt_max": 10, "output_max": 5}}))
    assert specs.arrival_s[-1] <= 100 and 400 < len(specs) < 600


def test_per_request_max_tokens_column_caps_output(tmp_path):
    from sim.runner import run_workload
    p = tmp_path / "m.csv"
    p.write_text("arrival_time_s,prompt_tokens,output_tokens,max_tokens\n0,10,50,20\n1,10,5,100\n")
    cfg = workload_from_dict({"name": "m", "arrivals": {"kind": "trace", "path": str(p)},
                              "lengths": {"kind": "trace"}}, "w.yaml", tmp_path)
    r = run_workload(cfg)
    # request 0 stops at its max_tokens (20 < 50); request 1 at its true length (5 < 100)
    assert r.requests["max_tokens"].tolist() == [20, 100]
    assert r.summary["total_output_tokens"] == 20 + 5


def test_trace_rate_applies_to_the_replayed_sample():
    d = {"name": "a", "num_requests": 600,
         "arrivals": {"kind": "trace", "path": "azure_llm_2023_conv.csv", "rate": 20.0},
         "lengths": {"kind": "trace"}}
    specs = generate(workload_from_dict(d))
    assert len(specs) == 600
    assert (len(specs) - 1) / specs.arrival_s[-1] == pytest.approx(20.0)

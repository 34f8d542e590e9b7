"""The analytic presets against the 2025-26 public serving runs (calibrate/profiles/public_serving/).

Pins how benchmarks/public_serving.py reads the published rows (which are
replayed, which are left out and why, how a ShareGPT row's lengths follow from
its totals), that repricing a replay's steps gives the replay's own numbers
(the fit relies on it), that the shipped trust table is what a fresh replay
computes, and that the fit never uses a held-out model.
"""

from __future__ import annotations

import csv
import sys
from pathlib import Path

import numpy as np
import pytest

from sim.cost.efficiency import MATMUL_FLOPS_FIT
from sim.cost.presets import serving_error

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
import public_serving as ps  # noqa: E402


@pytest.fixture(scope="module")
def loaded() -> tuple[list[ps.ServingRow], dict[str, int]]:
    return ps.load_rows()


def test_rows_replayed_and_left_out(loaded) -> None:
    rows, skipped = loaded
    with ps.MEASUREMENTS_CSV.open(newline="") as f:
        num_csv = sum(1 for _ in csv.DictReader(f))
    # 154 published rows: 55 replayable vLLM >= 0.10 rows, the rest counted by reason
    assert num_csv == 154 and len(rows) == 55 and len(rows) + sum(skipped.values()) == 154
    assert skipped["engine sglang (replayed under vllm_v1 only)"] == 38
    assert skipped["vLLM older than 0.10 or version unknown"] == 9
    assert skipped["multi-head latent attention (MLA) is not modelled"] == 3
    assert {r.model for r in rows} == {"gpt-oss-120b", "gpt-oss-20b", "qwen3-8b", "qwen3-14b", "qwen3-32b",
                                       "qwen3-235b-a22b", "mistral-small-24b"}
    assert all(r.engine == "vllm" for r in rows)


def test_a_sharegpt_row_takes_its_mean_lengths_from_the_published_totals(loaded) -> None:
    rows, _ = loaded
    by_index = {r.index: r for r in rows}
    first = by_index[0]           # GPUStack gpt-oss-120b: "total input 215312 / generated 195544", 1,000 prompts
    assert (first.dataset, first.input_len, first.output_len) == ("sharegpt", 215, 196)   # 215.3, 195.5 rounded
    assert first.gpu == "h100-sxm" and first.gpu_assumed                                   # "H100", variant unstated
    assert by_index[3].input_len == 215 and dict(by_index[3].flags) == {"async_scheduling": True}
    mistral = by_index[88]        # vllm#49723: "Mistral-24B", random 300 in / 64 out, --max-concurrency 64
    assert (mistral.model, mistral.model_assumed, mistral.kv_cache_dtype) == ("mistral-small-24b", True, "fp8")
    assert (mistral.input_len, mistral.output_len, mistral.max_concurrency) == (300, 64, 64)
    spec = ps.workload(by_index[0], ps.profile_spec(by_index[0]))
    assert spec["lengths"] == {"kind": "lognormal", "prompt_mean": 215, "output_mean": 196, "sigma": 1.0,
                               "prompt_max": 1024, "output_max": 1024, "output_min": 2}
    assert spec["arrivals"] == {"kind": "all_at_once"} and spec["profile"]["engine"] == "vllm-v1"
    assert ps.profile_spec(by_index[3])["engine"] == "vllm-v1-async"


def test_repricing_a_replay_gives_its_own_numbers(loaded) -> None:
    """Every request arrives at 0 or when its client's previous one returns, at a step's end:
    the steps do not depend on their durations, so repricing them with the same profile
    reproduces the replay (what lets the fit skip the simulator)."""
    rows, _ = loaded
    row = next(r for r in rows if r.index == 16)        # gpt-oss-120b, 100 ShareGPT prompts, 4 clients
    prof = ps.build_profile(row)
    sim, log = ps.replay(row, prof)
    again = ps.repriced(log, lambda bs: np.array([prof.step_time_s(b) for b in bs]))
    assert again == pytest.approx(sim, rel=1e-9)
    half = ps.repriced(log, lambda bs: 0.5 * np.array([prof.step_time_s(b) for b in bs]))
    assert half == pytest.approx({k: v / 2 for k, v in sim.items()}, rel=1e-9)


def test_the_shipped_trust_table_is_a_fresh_replay(loaded) -> None:
    """The a100-80gb fp8 TP 1 group: Qwen3-32B-FP8 (a training model) and Qwen3-14B-FP8 (held
    out), ShareGPT at 1,000 prompts at once, 4 values each."""
    rows, _ = loaded
    group = [r for r in rows if ps.group_of(r) == ("a100-80gb", "fp8", 1)]
    assert sorted(r.model for r in group) == ["qwen3-14b", "qwen3-32b"]
    sims, _ = ps.replay_all(group)
    fresh = {(e["gpu"], e["weight_dtype"], e["tensor_parallel"]): e for e in ps.error_rows(group, sims)}
    shipped = serving_error("a100-80gb", "fp8", 1)
    assert shipped["num_held_out"] == fresh[("a100-80gb", "fp8", 1)]["num_held_out"] == 4
    for key in ("ttft_mae_pct", "tpot_mae_pct", "ttft_mae_pct_all", "tpot_mae_pct_all"):
        assert shipped[key] == fresh[("a100-80gb", "fp8", 1)][key], key
    assert serving_error("h200", "fp8", 1) is None                       # no public run: "unknown"


def test_the_fit_sees_only_training_models(loaded) -> None:
    rows, _ = loaded
    held = {r.model for r in rows} - ps.TRAIN_MODELS
    assert held == {"gpt-oss-20b", "qwen3-14b", "qwen3-8b"}
    # every fitted class has a training row of its (generation, class, kind)
    train_keys = {ps.gemm_key(r) for r in rows if r.model in ps.TRAIN_MODELS and r.index not in ps.NOT_FITTED}
    assert set(MATMUL_FLOPS_FIT) <= train_keys
    assert ("hopper", "fp8", "dense") not in MATMUL_FLOPS_FIT       # no dense FP8 Hopper run: default kept

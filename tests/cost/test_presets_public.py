"""The analytic presets against public vLLM runs (calibrate/profiles/public_vllm/).

Pins the held-out error of benchmarks/bench_presets_public.py: rows held out
by model, mean absolute error of batch latency <= 15% and no (GPU, TP) group
biased by more than 10%; and the shipped error table that preset_error reads.
"""

from __future__ import annotations

import csv
import dataclasses
import math
import sys
from pathlib import Path

import numpy as np
import pytest

from sim.cost.collectives import ENGINES, TpStepCosts, allreduce_s, engine_overhead, gather_s
from sim.cost.presets import GPU_PRESETS, MODEL_PRESETS, preset_error
from sim.cost.roofline import Efficiency, Roofline, preset_profile

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
import bench_presets_public as bench  # noqa: E402


@pytest.fixture(scope="module")
def held_out() -> tuple[list[bench.Row], dict[bench.Row, float]]:
    rows = [r for r in bench.load_rows() if r.held_out]
    pred, _ = bench.simulate(rows)
    return rows, pred


def test_shipped_runs_are_the_documented_subset() -> None:
    rows = bench.load_rows()
    assert len(rows) == 504
    assert {r.gpu for r in rows} == {"a100-40gb", "h100-sxm"} and {r.tp for r in rows} == {1, 2, 4}
    with bench.RUNS_CSV.open(newline="") as f:
        for r in csv.DictReader(f):     # throughput = (input + output) x batch / latency, as copied
            tokens = 2 * int(r["Input Output Length"]) * int(r["Batch Size"])
            assert tokens / float(r["Latency"]) == pytest.approx(float(r["Throughput"]), rel=1e-9)
    readme = (bench.DATA / "README.md").read_text()
    assert "BSD 3-Clause" in readme and "4de4e8723b661851bf01bd2ec16c0a0d1216fa3d" in readme
    assert set(bench.load_baseline()) == set(rows)


def test_held_out_error_meets_the_targets(held_out: tuple[list[bench.Row], dict[bench.Row, float]]) -> None:
    rows, pred = held_out
    table = bench.error_table(rows, pred)
    assert table[("all", 0)]["n"] == 253
    assert table[("all", 0)]["mae"] <= bench.TARGET_MAE_PCT
    for key, t in table.items():
        assert abs(t["bias"]) <= bench.TARGET_BIAS_PCT, (key, t)
    before = bench.error_table(rows, bench.load_baseline())
    assert before[("all", 0)]["mae"] > 2 * table[("all", 0)]["mae"]     # the fit is what closed the gap


def test_preset_error_is_the_shipped_table(held_out: tuple[list[bench.Row], dict[bench.Row, float]]) -> None:
    rows, pred = held_out
    table = bench.error_table(rows, pred)
    for (gpu, tp), t in table.items():
        if gpu == "all":
            continue
        e = preset_error(gpu, tp)
        assert e is not None and e["engine"] == "vllm-v0" and e["num_rows"] == t["n"]
        assert e["mae_pct"] == pytest.approx(t["mae"], abs=0.15)
        assert e["bias_pct"] == pytest.approx(t["bias"], abs=0.15)
    assert preset_error("H100-SXM", 4)["tensor_parallel"] == 4
    assert preset_error("l40s", 1) is None and preset_error("h100-sxm", 8) is None


def test_collective_formulas() -> None:
    assert allreduce_s(1e6, 1, 300e9, 10e-6, 0.5) == 0
    # ring: 2 (t - 1) / t of the buffer through each link, plus the call latency
    assert allreduce_s(1e6, 4, 300e9, 10e-6, 0.5) == pytest.approx(10e-6 + 1.5e6 / 150e9)
    assert gather_s(4e6, 4, 300e9, 10e-6, 0.5) == pytest.approx(10e-6 + 3e6 / 150e9)
    model, gpu = MODEL_PRESETS["llama-2-7b"], GPU_PRESETS["h100-sxm"]
    tp4 = TpStepCosts(model, gpu, 4, 2)
    assert tp4.allreduce_calls == 2 * 32 + 1
    assert tp4.decode_step_message_bytes(64) == 64 * 4096 * 2
    assert tp4.prefill_chunk_message_bytes(2048) == 2048 * 4096 * 2
    assert float(tp4.comm_s(1)) > tp4.allreduce_calls * gpu.interconnect_latency_s
    assert float(TpStepCosts(model, gpu, 1, 2).comm_s(4096)) == 0.0
    # per-step work that does not shrink with TP: the engine's and every layer's floor
    tp1 = TpStepCosts(model, gpu, 1, 2)
    assert tp4.fixed_step_s - tp1.fixed_step_s == pytest.approx(ENGINES["vllm-v0"].tp_step_s)
    assert tp1.fixed_step_s >= 32 * tp1.layer_fixed_s
    with pytest.raises(ValueError, match="unknown engine"):
        engine_overhead("vllm-v9")
    assert ENGINES["vllm-v1-async"].step_s < ENGINES["vllm-v1"].step_s < ENGINES["vllm-v0"].step_s


def test_profile_states_every_term_and_matches_the_formulas() -> None:
    model, gpu = MODEL_PRESETS["llama-2-7b"], GPU_PRESETS["a100-40gb"]
    prof = preset_profile("llama-2-7b", "a100-40gb", 2, "fp16")
    rf = Roofline(model, gpu, 2, "fp16")
    for key in ("engine", "overhead_s", "tp_overhead_s", "per_seq_s", "layer_fixed_s", "interconnect",
                "attn_decode_flops", "matmul_flops", "mem_bw", "justification"):
        assert key in prof.efficiency, key
    assert prof.overhead_s == pytest.approx(ENGINES["vllm-v0"].step_s + ENGINES["vllm-v0"].tp_step_s)
    assert rf.tp_costs.allreduce_calls == 65
    # collectives and the layer floor ride on linear(); the engine's per-sequence work on attention
    silent = dataclasses.replace(gpu, interconnect_bytes_s=math.inf, interconnect_latency_s=0.0)
    bare = Roofline(model, silent, 2, "fp16", Efficiency(layer_fixed_s=0.0, per_seq_s=0.0))
    extra = float(rf.linear_s(64) - bare.linear_s(64))
    assert extra == pytest.approx(float(rf.tp_costs.comm_s(64)) + 32 * rf.eff.layer_fixed_s, rel=1e-9)
    assert float(rf.attn_decode_s(8, 800) - bare.attn_decode_s(8, 800)) == pytest.approx(8 * rf.eff.per_seq_s)
    v1 = preset_profile("llama-2-7b", "a100-40gb", 2, "fp16", engine="vllm-v1-async")
    assert v1.overhead_s < prof.overhead_s and v1.efficiency["engine"] == "vllm-v1-async"
    with pytest.raises(ValueError, match="unknown engine"):
        preset_profile("llama-2-7b", "a100-40gb", engine="sglang")
    assert np.all(np.diff(prof.linear.ys) >= 0)

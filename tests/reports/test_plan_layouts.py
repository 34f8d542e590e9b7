"""sim plan's layouts search (reports.experiments.planspec): every tensor x data x expert
parallel layout of a replica's GPUs, priced as that many GPUs, and the layouts that cannot run
kept with the line that says why."""

from __future__ import annotations

from pathlib import Path

import yaml

from reports.experiments.planspec import layout_grid, parse_plan

ROOT = Path(__file__).resolve().parents[2]


def test_the_layouts_of_eight_gpus() -> None:
    # t divides 8 (8, 4, 2, 1) with d = 8 / t, each with and without expert parallelism: 8 layouts
    assert layout_grid(8) == [(8, 1, False), (8, 1, True), (4, 2, False), (4, 2, True), (2, 4, False),
                              (2, 4, True), (1, 8, False), (1, 8, True)]
    assert layout_grid(1) == [(1, 1, False), (1, 1, True)]


def test_a_plan_over_layouts_names_prices_and_refuses_them(tmp_path: Path) -> None:
    doc = yaml.safe_load((ROOT / "workloads" / "plan_deepseek_r1_layouts.yaml").read_text())
    doc["base"] = str(ROOT / "workloads" / doc["base"])
    doc["candidates"].append({"name": "dense", "profile": {"model": "llama-3.1-8b", "gpu": "h100-sxm"},
                              "layouts": {"gpus": 2}})
    path = tmp_path / "plan.yaml"
    path.write_text(yaml.safe_dump(doc))
    spec = parse_plan(path, tmp_path / "out")
    by_name = {c.name: c for c in spec.candidates}
    h200 = [c for c in spec.candidates if c.name.startswith("H200")]
    assert [c.hardware for c in h200] == ["H200 x8 TP8", "H200 x8 TP8 EP", "H200 x8 TP4 DP2", "H200 x8 TP4 DP2 EP",
                                          "H200 x8 TP2 DP4", "H200 x8 TP2 DP4 EP", "H200 x8 TP1 DP8",
                                          "H200 x8 TP1 DP8 EP"]
    assert all(c.gpus_per_replica == 8 and c.refused is None for c in h200)      # 8 GPUs a replica, each layout
    dp = by_name["H200 x8 TP1 DP8 EP / vllm_v1"].raw["profile"]
    assert (dp["tensor_parallel"], dp["data_parallel_size"], dp["enable_expert_parallel"]) == (1, 8, True)
    # H100: 80 GB a GPU hold less than the FP8 weights each layout puts on a GPU: all 8 refused, by memory
    h100 = [c for c in spec.candidates if c.name.startswith("H100")]
    assert len(h100) == 8 and all(c.refused and "the model's weights do not fit" in c.refused for c in h100)
    assert "1 x 79.6 GiB x 0.9 - weights 93.9 GiB" in by_name["H100 x8 TP1 DP8 / vllm_v1"].refused
    # a dense model has no expert-parallel layouts: TP 2 and TP 1 x DP 2 only
    assert [c.hardware for c in spec.candidates if c.name.startswith("dense")] == ["dense TP2", "dense TP1 DP2"]

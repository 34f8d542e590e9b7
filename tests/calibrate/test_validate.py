"""Live validation on the CPU: the tiny model run live and simulated, side by side.

Tolerances (err = (sim - live) / live, checked on |err|):
- request throughput within 45%: at light load it equals the offered rate in
  both runs, at saturation it is the cost model's total (a x3 profile gives
  -67%, a x1/3 one +200%); 45% leaves room for a neighbour on the shared
  caches of a 2-core machine, which slows a live run without taking its core
  (seen: +20%; in one CI run at saturation +40.7%, then +35.1% after a fresh
  calibration, the policy's decisions identical: a 1-second live run).
- p50 TTFT and p50 ITL within 60%: medians over hundreds of tokens are stable
  on one machine (here: light-load ITL +17% for vllm, -5% for sarathi), but the
  1-2 ms steps of light load depend on the CPU's caches: on the CI machine the
  live light-load steps ran a third faster than the same calibration predicts
  (p50 ITL +47% and +49%). A x3 profile gives +200% or more, a x1/3 one -67%.
- median per-step |predicted - measured| / measured within 75%: the cost
  curves themselves, batch by batch; 5-25% on this machine, 52-55% in that CI
  run (x3 gives ~200%).
These catch a broken cost model (the negative test), not a 10% fit error.

Timing needs the cores: every live run records the process CPU seconds per
forward-pass second (1.0 with one thread and the core to itself). When other
processes take the cores (share < MIN_CPU_SHARE, during calibration or the
live run) the live run is slower for reasons no cost model can see: the run is
retried, and if the machine stays oversubscribed a tolerance miss is a skip
that says so, never a pass. A miss with the core to itself is measured again:
a fresh calibration and a fresh live run, and only their miss fails (a
neighbour on the shared caches can slow every step by a third without taking
the core). Structural checks (completion, report files,
the twin driver equals ``run_workload``, replay identity) always run.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest

torch = pytest.importorskip("torch")

from sim.run.live import run_sim  # noqa: E402
from calibrate.model import MODEL_PRESETS  # noqa: E402
from calibrate.runner import calibrate  # noqa: E402
from calibrate.validate import Validation, calibration_grid, main, validate  # noqa: E402
from reports.presentation import validation as rv  # noqa: E402
from reports.presentation.render import to_markdown  # noqa: E402
from sim.run.config import ConfigError, workload_from_dict  # noqa: E402
from sim.cost.curves import Curve1D, Curve2D  # noqa: E402
from sim.results.folder import read_run  # noqa: E402
from sim.cost.profile import Profile  # noqa: E402
from sim.run.runner import run_workload  # noqa: E402
from sim.results.result import RunResult  # noqa: E402

MODEL = "tiny-llama"
THREADS = 1
MIN_CPU_SHARE = 0.85
TOLERANCES_PCT = {"request_throughput": 45.0, "p50_ttft_ms": 60.0, "p50_itl_ms": 60.0}
STEP_TOLERANCE_PCT = 75.0     # median |predicted - measured| / measured over the live steps
BASE = {
    "name": "test-validate", "seed": 3, "num_requests": 40,
    "arrivals": {"kind": "poisson", "rate": 10.0},
    "lengths": {"kind": "uniform", "prompt_min": 16, "prompt_max": 192, "output_min": 4, "output_max": 32},
    "server": {"block_size": 16, "num_blocks": 160, "max_model_len": 256},
    "policy": {"kind": "vllm", "max_num_seqs": 16, "max_num_batched_tokens": 512},
}
# light: ~10 req/s is well under the tiny model's CPU capacity; saturating: all 40 at t = 0.
LOADS = {"light": {"kind": "poisson", "rate": 10.0}, "saturating": {"kind": "all_at_once"}}


def workload(policy: str, load: str):
    data = copy.deepcopy(BASE)
    data["policy"]["kind"] = policy
    data["arrivals"] = LOADS[load]
    data["name"] = f"test-{policy}-{load}"
    return workload_from_dict(data)


def _cpu_share(fn):
    c0, t0 = time.process_time(), time.perf_counter()
    out = fn()
    return out, (time.process_time() - c0) / max(time.perf_counter() - t0, 1e-9) / THREADS


def calibrate_now() -> tuple[Profile, float]:
    """A quick calibration of the tiny model on a grid sized to BASE (one thread),
    redone once if other processes held the cores; (profile, CPU share)."""
    cfg = workload("vllm", "light")
    grid = calibration_grid(cfg, MODEL_PRESETS[MODEL], torch.device("cpu"))
    for _ in range(2):
        cal, share = _cpu_share(lambda: calibrate(MODEL, "cpu", "float32", 10.0, None, False, 0,
                                                  grid=grid, num_threads=THREADS))
        if share >= MIN_CPU_SHARE:
            break
    return cal.profile, share


@pytest.fixture(scope="module")
def calibrated() -> tuple[Profile, float]:
    return calibrate_now()


_RUNS: dict[tuple[str, str], Validation] = {}


def tolerance_misses(v: Validation) -> list[str]:
    """The metrics (and the per-step cost error) of a validation outside the tolerances."""
    misses = rv.check(rv.error_table(v.live.summary, v.sim.summary), TOLERANCES_PCT)
    step_err = v.comparison["steps"]["all"]["median_abs_pct"]
    if not step_err <= STEP_TOLERANCE_PCT:
        misses.append(f"median per-step |error| {step_err:.1f}% (limit {STEP_TOLERANCE_PCT:g}%)")
    return misses


def validated(calibrated: tuple[Profile, float], policy: str, load: str) -> Validation:
    """The validation of (policy, load), cached for the module; run once more if the cores were
    shared (pointless if they were shared during calibration: the profile itself is off then).

    A run that misses the tolerances with the core to itself is measured again, calibration
    included: a neighbour on the shared caches or memory bus slows a live run without taking
    its core, so the machine may not be the one the profile was measured on minutes ago (seen
    in CI: every step +25-33% against the profile, the policy's decisions identical). The
    fresh pair is kept, with the first one's misses in ``notes``; a broken cost model misses
    with any calibration (test_broken_profile_fails_tolerances)."""
    if (policy, load) not in _RUNS:
        for _ in range(2 if calibrated[1] >= MIN_CPU_SHARE else 1):
            v = validate(workload(policy, load), calibrated[0], model=MODEL, num_threads=THREADS)
            share = v.comparison["steps"]["cpu_per_forward_s"] / THREADS
            if share >= MIN_CPU_SHARE:
                break
        first = tolerance_misses(v)
        if first and min(calibrated[1], share) >= MIN_CPU_SHARE:
            fresh, fresh_share = calibrate_now()
            v = validate(workload(policy, load), fresh, model=MODEL, num_threads=THREADS)
            v.notes.append(f"measured again after missing with the first calibration: {', '.join(first)}")
            v.comparison["calibration_share"] = fresh_share
        _RUNS[policy, load] = v
    return _RUNS[policy, load]


def scaled(profile: Profile, factor: float) -> Profile:
    """A deliberately broken profile: every cost term multiplied by ``factor``."""
    def c1(c: Curve1D) -> Curve1D:
        return Curve1D(c.xs, [y * factor for y in c.ys], name=c.name)

    def c2(c: Curve2D) -> Curve2D:
        return Curve2D(c.xs, c.ys, [[z * factor for z in row] for row in c.zs], name=c.name)
    return dataclasses.replace(profile, overhead_s=profile.overhead_s * factor, linear=c1(profile.linear),
                               attn_prefill=c2(profile.attn_prefill), attn_decode=c2(profile.attn_decode))


@pytest.mark.parametrize("load", list(LOADS))
@pytest.mark.parametrize("policy", ["vllm", "sarathi"])
def test_validation_within_tolerances(calibrated, policy: str, load: str) -> None:
    v = validated(calibrated, policy, load)
    n = BASE["num_requests"]
    assert v.live.summary["completed"] == v.sim.summary["completed"] == n
    assert len(v.live.tokens) == len(v.sim.tokens) == int(v.live.requests["output_tokens"].sum())
    assert v.live.steps["batch"].str.len().min() > 0 and v.live.steps["forward_s"].gt(0).all()
    verdict = rv.verdict(pd.DataFrame(v.comparison["table"]), rv.parse_targets(None))
    body = {**v.comparison, "notes": v.notes, "verdict": verdict.to_dict("records"),
            "passed": bool(verdict["met"].all())}
    report = to_markdown(rv.live_report(body, "t"), Path("."))
    assert "| p50_itl_ms (ms) |" in report and "**cost-curve %** = (replay - live) / live" in report
    assert "First divergence" in report or "identical decisions" in report
    misses = tolerance_misses(v)
    share = min(v.comparison.get("calibration_share", calibrated[1]),
                v.comparison["steps"]["cpu_per_forward_s"] / THREADS)
    if misses and share < MIN_CPU_SHARE:
        pytest.skip(f"machine oversubscribed (CPU share {share:.2f} < {MIN_CPU_SHARE}): {misses}")
    assert not misses, f"{policy} {load}: {misses} {v.notes}\n{rv.format_table(v.comparison['table'])}"


@pytest.mark.parametrize("load", list(LOADS))
def test_broken_profile_fails_tolerances(calibrated, load: str) -> None:
    """The same live run against a simulation with every cost x3 must fail."""
    v = validated(calibrated, "vllm", load)
    cfg = workload("vllm", load)
    broken = run_sim(cfg, scaled(v.profile, 3.0), v.live.meta["num_blocks"], v.live.meta["max_model_len"])
    misses = rv.check(rv.error_table(v.live.summary, broken.summary), TOLERANCES_PCT)
    share = min(v.comparison.get("calibration_share", calibrated[1]),
                v.comparison["steps"]["cpu_per_forward_s"] / THREADS)
    if not any(m.startswith("p50_itl_ms") for m in misses) and share < MIN_CPU_SHARE:
        # the live run itself slowed down by others' load: no check of the simulation's costs
        pytest.skip(f"machine oversubscribed (CPU share {share:.2f} < {MIN_CPU_SHARE}): {misses}")
    assert any(m.startswith("p50_itl_ms") for m in misses), misses
    if load == "saturating":
        assert any(m.startswith("request_throughput") for m in misses), misses
    steps = v.live.steps.assign(predicted_s=3.0 * v.live.steps["predicted_s"])
    assert rv.step_error_stats(steps)["all"]["median_abs_pct"] > STEP_TOLERANCE_PCT


@pytest.mark.parametrize("load", list(LOADS))
def test_optimistic_profile_fails_tolerances(calibrated, load: str) -> None:
    """The other side: every cost x1/3 (a profile three times too fast) must fail too."""
    v = validated(calibrated, "vllm", load)
    fast = run_sim(workload("vllm", load), scaled(v.profile, 1 / 3), v.live.meta["num_blocks"],
                   v.live.meta["max_model_len"])
    misses = rv.check(rv.error_table(v.live.summary, fast.summary), TOLERANCES_PCT)
    # Light load: TTFT and ITL ~ step costs, so about -67% each against a 60% limit (which of
    # the two misses depends on how fast the live steps ran that day); saturated: throughput
    # about x3 (+200%).
    light = ("p50_itl_ms", "p50_ttft_ms")
    assert any(m.startswith(light if load == "light" else "request_throughput") for m in misses), misses


def test_sim_twin_equals_run_workload(calibrated, tmp_path: Path) -> None:
    """The simulated side of validation is exactly ``sim run`` on the same workload."""
    profile = calibrated[0]
    path = tmp_path / "profile.json"
    profile.save(path)
    for policy in ("vllm", "sarathi"):
        cfg = workload(policy, "saturating")
        twin = run_sim(cfg, profile, 160, 256)
        ref = run_workload(dataclasses.replace(cfg, profile=dataclasses.replace(cfg.profile, path=str(path))))
        drop = ("num_out_of_range_lookups", "profile_source")
        assert {k: v for k, v in twin.summary.items() if k not in drop} == \
               {k: v for k, v in ref.summary.items() if k not in drop}
        assert twin.tokens["t_s"].tolist() == ref.tokens["t_s"].tolist()


def test_replay_with_measured_times_is_identity(calibrated) -> None:
    """Replaying the live schedule with its own measured durations gives the live metrics back;
    a run compared with itself has identical decisions."""
    v = validated(calibrated, "sarathi", "light")
    steps = v.live.steps.assign(predicted_s=v.live.steps["duration_s"])
    same = rv.replay(RunResult(v.live.requests, steps, v.live.tokens, v.live.summary))
    for key, _ in rv.metric_keys():
        assert same[key] == pytest.approx(v.live.summary[key], rel=1e-6, abs=1e-6), key
    diff = rv.decision_diff(v.live.steps, v.live.steps)
    assert diff["identical_fraction"] == 1.0 and diff["first_divergence"] is None
    cross = rv.decision_diff(v.live.steps, v.sim.steps)
    assert 0.0 <= cross["identical_fraction"] <= 1.0


def _args(workload_path: Path, out: Path, **kw) -> argparse.Namespace:
    base = dict(workload=str(workload_path), device="cpu", model=MODEL, dtype=None, profile=None,
                out=str(out), set=None, budget_s=10.0, threads=THREADS)
    base.update(kw)
    return argparse.Namespace(**base)


def test_main_writes_report(calibrated, tmp_path: Path, capsys) -> None:
    import yaml
    wl = tmp_path / "wl.yaml"
    wl.write_text(yaml.safe_dump({**BASE, "num_requests": 12, "arrivals": LOADS["saturating"]}))
    prof = tmp_path / "p.json"
    calibrated[0].save(prof)
    out = tmp_path / "report"
    assert main(_args(wl, out, profile=str(prof), set=["policy.kind=sarathi"])) == 0     # no --check: 0
    printed = capsys.readouterr().out
    assert "p50_ttft_ms" in printed and "err %" in printed and "verdict: " in printed
    for name in ("report.md", "report.html", "report.json", "cdf.png", "step_error.png", "live/summary.json",
                 "sim/summary.json", "live/steps.csv"):
        assert (out / name).is_file(), name
    body = json.loads((out / "report.json").read_text())
    assert body["policy"]["kind"] == "sarathi" and body["calibrated_here"] is False
    assert [r["target"] for r in body["verdict"]] == list(rv.TARGETS)
    assert body["passed"] == all(r["met"] for r in body["verdict"])
    assert ("verdict: PASS" in printed) == body["passed"]
    html = (out / "report.html").read_text()
    assert "data:image/png;base64," in html and "cost-curve %" in html
    # --check with a target no run can meet (0% on throughput) exits 1; the folder is not reused
    assert main(_args(wl, out, profile=str(prof), targets="throughput=0,ttft_p50=0", check=True)) == 1
    assert "verdict: FAIL" in capsys.readouterr().out and (tmp_path / "report-2" / "report.json").is_file()
    assert {r["metric"] for r in body["table"]} >= set(TOLERANCES_PCT)
    again = rv.compare(read_run(out / "live"), read_run(out / "sim"))     # from the run dirs alone
    assert again["decisions"] == body["decisions"]


def test_bad_input_is_a_config_error(calibrated, tmp_path: Path) -> None:
    wl = tmp_path / "wl.yaml"
    wl.write_text(json.dumps(BASE))
    other = dataclasses.replace(calibrated[0], model=dataclasses.replace(calibrated[0].model, name="llama-2-7b"))
    prof = tmp_path / "other.json"
    other.save(prof)
    with pytest.raises(ConfigError, match="model.name"):
        main(_args(wl, tmp_path / "o", profile=str(prof)))
    with pytest.raises(ConfigError, match="--model"):
        main(_args(wl, tmp_path / "o", model="no-such-model"))
    with pytest.raises(ConfigError, match="dtype"):
        main(_args(wl, tmp_path / "o", dtype="float16", profile=str(prof), model="llama-2-7b"))


def test_reports_validation_is_torch_free() -> None:
    code = ("import sys, reports.presentation.validation, sim.run.live; "
            "assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).resolve().parents[2])

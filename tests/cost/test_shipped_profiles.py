"""The profiles shipped in calibrate/profiles load, carry provenance, and run."""

from __future__ import annotations

from pathlib import Path

from sim.run.config import workload_from_dict
from sim.cost.profile import load_profile
from sim.run.runner import run_workload

ROOT = Path(__file__).resolve().parents[2]
SHIPPED = sorted((ROOT / "calibrate" / "profiles").rglob("*.yaml"))


def test_there_is_a_shipped_profile():
    assert SHIPPED


def test_shipped_profiles_load_with_provenance_and_fit_error():
    for path in SHIPPED:
        p = load_profile(path)
        assert p.provenance.get("source") and p.provenance.get("date_utc")
        assert p.fit_error["holdout_mape_pct"] < 10
        assert path.with_suffix(".csv").is_file(), "raw measurements ship beside the profile"


def test_sim_run_finds_a_shipped_profile_by_its_repository_path(tmp_path):
    cfg = workload_from_dict({
        "name": "p", "num_requests": 30, "arrivals": {"kind": "poisson", "rate": 10.0},
        "lengths": {"kind": "uniform", "prompt_max": 256, "output_max": 32},
        "server": {"max_model_len": 512, "num_blocks": 256},
        "profile": {"path": "calibrate/profiles/cpu/tiny-llama/float32.yaml"},
    }, str(tmp_path / "w.yaml"), tmp_path)
    r = run_workload(cfg)
    assert r.summary["completed"] == 30
    assert r.summary["profile_source"] == "batchsim-calibrate"
    assert len(r.meta["profile_file"]["sha256"]) == 64 and r.meta["profile_file"]["format_version"] == 1

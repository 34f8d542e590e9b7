"""Policies are pure: no SimPy, no torch, no clock, no files (STYLE lesson 1)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_sim_and_policies_do_not_import_torch():
    code = ("import sys, policies, sim.cli, sim.run.runner, sim.loop.server, sim.cost.roofline, workloads.generate;"
            "from sim.run.config import load_workload; from sim.run.runner import run_workload;"
            f"cfg = load_workload(r'{ROOT / 'workloads' / 'mixed_lengths.yaml'}', {{'num_requests': 20}});"
            "run_workload(cfg);"
            "assert 'torch' not in sys.modules, 'torch imported';"
            "print('ok')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().endswith("ok")


def test_policies_import_no_simpy_torch_clock_or_files():
    forbidden = re.compile(r"^\s*(import|from)\s+(simpy|torch|time|datetime|os|pathlib|io|random)\b"
                           r"|\bopen\(|perf_counter|time\.time", re.M)
    for path in (ROOT / "policies").glob("*.py"):
        text = path.read_text()
        assert not forbidden.search(text), f"{path.name} reaches outside pure scheduling"


def test_policies_never_read_true_output_length_except_oracle():
    for path in (ROOT / "policies").glob("*.py"):
        text = path.read_text()
        for m in re.finditer(r"oracle_output_tokens", text):
            window = text[max(0, m.start() - 200):m.start()]
            assert "oracle" in window.replace("oracle_output_tokens", ""), \
                f"{path.name} reads the true output length outside an oracle option"
        assert "_true_output" not in text, f"{path.name} reaches into the state's private true lengths"

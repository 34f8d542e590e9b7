"""Policies are pure: no SimPy, no torch, no clock, no files (STYLE lesson 1)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


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


def true_length_reads(text: str) -> list[str]:
    """Where ``text`` reads the true output lengths outside an oracle option: the
    state's ``oracle_output_tokens`` without "oracle" nearby, or its true lengths
    private (``_true_output``) or public (``true_output_tokens``, which the loop's
    fast path reads)."""
    found = []
    for m in re.finditer(r"oracle_output_tokens", text):
        window = text[max(0, m.start() - 200):m.start()]
        if "oracle" not in window.replace("oracle_output_tokens", ""):
            found.append("oracle_output_tokens outside an oracle option")
    found += [name for name in ("_true_output", "true_output_tokens") if re.search(rf"\.{name}\b", text)]
    return found


def test_policies_never_read_true_output_length_except_oracle():
    for path in (ROOT / "policies").glob("*.py"):
        assert true_length_reads(path.read_text()) == [], path.name


def test_the_purity_check_sees_every_way_to_the_true_lengths():
    # Each of these would let a policy schedule on what it cannot know.
    assert true_length_reads("n = state.true_output_tokens[r.req_id]") == ["true_output_tokens"]
    assert true_length_reads("n = state._true_output[r.req_id]") == ["_true_output"]
    assert true_length_reads("n = state.oracle_output_tokens(r)") == ["oracle_output_tokens outside an oracle option"]
    assert true_length_reads("if reserve == 'oracle':\n    n = state.oracle_output_tokens(r)") == []
    assert true_length_reads("def reserve(true_output_tokens: int): ...") == []     # a parameter, not the state

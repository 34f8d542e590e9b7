"""``sim run --check`` (and the workload key ``check_fast_path``): the fast-path check for any
policy, a user's own included, from the command line; a policy that breaks its contract ends
the run with one line and exit status 1, never a traceback."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import pytest

import policies
from policies.base import knob
from policies.vllm import VllmPolicy
from policies.vllm_v1 import VllmV1Config, VllmV1Policy
from sim.cli import main
from sim.core.batch import Idle

WORKLOAD = """
name: own
seed: 1
num_requests: 60
arrivals: {kind: poisson, rate: 40}
lengths: {kind: uniform, prompt_min: 20, prompt_max: 200, output_min: 20, output_max: 200}
server: {num_blocks: 2000, max_model_len: 1024}
profile: {model: llama-3.1-8b, gpu: h100-sxm}
"""


@dataclass(frozen=True, slots=True)
class HeldConfig:
    kind: Literal["held"] = "held"
    tick_s: float = knob(0.05, "admissions open only in even ticks of this length")


class Held(VllmV1Policy):
    """A user's own policy: vLLM v1 that admits only in even ticks of ``tick_s``, a rule of the
    clock, yet it keeps ``decode_stretch = True`` from its parent. The fast path skips the tick
    where admission opens (nothing is scheduled there), so its numbers are wrong unchecked."""

    def __init__(self, config: HeldConfig, context) -> None:
        super().__init__(VllmV1Config(enable_prefix_caching=False, async_scheduling=False), context)
        self.held = config

    def knobs(self):
        return {"kind": "held", "tick_s": self.held.tick_s}

    def schedule(self, state, now_s):
        tick = int(now_s / self.held.tick_s)
        if tick % 2 == 0 or not state.waiting:
            return super().schedule(state, now_s)
        waiting, state.waiting = state.waiting, type(state.waiting)()      # hold admissions this tick
        try:
            decision = super().schedule(state, now_s)
        finally:
            waiting.extendleft(reversed(state.waiting))
            state.waiting = waiting
        return Idle(wake_at_s=(tick + 1) * self.held.tick_s) if isinstance(decision, Idle) else decision


@dataclass(frozen=True, slots=True)
class SpinConfig:
    kind: Literal["spin"] = "spin"


class Spin(VllmPolicy):
    """A user's own policy that asks to be woken a nanosecond later, for ever."""

    def __init__(self, config: SpinConfig, context) -> None:
        super().__init__(policies.POLICIES["vllm"][0](), context)
        self.spin = config

    def knobs(self):
        return {"kind": "spin"}

    def schedule(self, state, now_s):
        return Idle(wake_at_s=now_s + 1e-9)


@pytest.fixture
def own_policies(monkeypatch):
    monkeypatch.setitem(policies.POLICIES, "held", (HeldConfig, Held))
    monkeypatch.setitem(policies.POLICIES, "spin", (SpinConfig, Spin))


def run(tmp_path: Path, capsys, kind: str, *extra: str, text: str = WORKLOAD, out: str = "out"):
    (tmp_path / "w.yaml").write_text(text + f"policy: {{kind: {kind}}}\n")
    rc = main(["run", str(tmp_path / "w.yaml"), "--out", str(tmp_path / out), "--quiet", *extra])
    captured = capsys.readouterr()
    return rc, captured.out, captured.err


def mean_ttft_ms(tmp_path: Path, out: str) -> float:
    return json.loads((tmp_path / out / "summary.json").read_text())["mean_ttft_ms"]


def test_a_wrong_claim_of_a_users_policy_is_caught_by_check(tmp_path: Path, capsys, own_policies) -> None:
    rc, _, err = run(tmp_path, capsys, "held", out="fast")
    assert rc == 0, err
    import sim.loop.server
    sim.loop.server.FAST_PATH = False                # what the policy really does: every step stepped
    try:
        rc, _, err = run(tmp_path, capsys, "held", out="stepped")
    finally:
        sim.loop.server.FAST_PATH = True
    assert rc == 0, err
    # The claim changes the numbers silently: why it must be checked.
    assert mean_ttft_ms(tmp_path, "fast") != mean_ttft_ms(tmp_path, "stepped")
    for extra, text in ((("--check",), WORKLOAD), ((), WORKLOAD + "check_fast_path: true\n")):
        rc, out, err = run(tmp_path, capsys, "held", *extra, text=text, out="checked")
        assert rc == 1 and out == ""
        assert err.startswith("error: policy Held at t=") and err.count("\n") == 1 and "Traceback" not in err, err
        assert not (tmp_path / "checked").exists()


def test_check_on_a_policy_that_keeps_its_claims_changes_nothing(tmp_path: Path, capsys) -> None:
    rc, out, err = run(tmp_path, capsys, "sarathi", out="plain")
    assert rc == 0 and "check " not in out, err
    rc, out, err = run(tmp_path, capsys, "sarathi", "--check", out="checked")
    assert rc == 0, err
    line = next(l for l in out.splitlines() if l.startswith("check "))
    checked, steps = (int(w.replace(",", "")) for w in line.split() if w.replace(",", "").isdigit())
    assert 0 < checked < steps and line.endswith("steps were the fast path's, each stepped and found as planned")
    for name in ("summary.json", "requests.csv", "steps.csv"):
        assert (tmp_path / "plain" / name).read_bytes() == (tmp_path / "checked" / name).read_bytes(), name
    meta = json.loads((tmp_path / "checked" / "meta.json").read_text())
    assert meta["fast_path_steps_checked"] == checked


def test_a_users_policy_that_spins_ends_with_one_line(tmp_path: Path, capsys, own_policies) -> None:
    rc, out, err = run(tmp_path, capsys, "spin")
    assert rc == 1 and out == ""
    assert err.startswith("error: policy Spin made no progress in 100 decisions in a row, from t=0 s")
    assert err.count("\n") == 1 and "Traceback" not in err

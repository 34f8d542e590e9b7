"""The JSON Schema of workload files (sim schema): generated from the loader's dataclasses."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest
import yaml

from policies import POLICIES
from sim.cli import main
from sim.run.schema import workload_schema

ROOT = Path(__file__).resolve().parents[2]
WORKLOADS = sorted(p for p in (ROOT / "workloads").glob("*.yaml")
                   if not p.name.startswith(("sweep_", "plan_")))        # sweep and plan files are not workloads


def _errors(data) -> list[str]:
    return [e.message for e in jsonschema.Draft202012Validator(workload_schema()).iter_errors(data)]


@pytest.mark.parametrize("path", WORKLOADS, ids=lambda p: p.name)
def test_every_bundled_workload_meets_the_schema(path: Path) -> None:
    assert _errors(yaml.safe_load(path.read_text())) == []


@pytest.mark.parametrize("edit, words", [
    ({"arrivals": {"kind": "poisson", "rat": 2.0}}, "'rat' was unexpected"),
    ({"arrivals": {"kind": "weibull"}}, "weibull"),
    ({"policy": {"kind": "fcfs"}}, "fcfs"),
    ({"policy": {"kind": "vllm", "max_num_seqs": "many"}}, "many"),
    ({"slo": {"ttft_ms": 500, "itl_ms": 50}}, "'itl_ms' was unexpected"),     # a plan's target, not goodput's
    ({"seeed": 1}, "'seeed' was unexpected"),
])
def test_mistakes_break_the_schema(edit: dict, words: str) -> None:
    data = {**yaml.safe_load((ROOT / "workloads" / "azure_conv.yaml").read_text()), **edit}
    errors = _errors(data)
    assert errors and any(words in e for e in errors), errors


def test_policy_kinds_and_knobs_come_from_the_registry() -> None:
    policy = next(o for o in workload_schema()["properties"]["policy"]["anyOf"] if o.get("type") == "object")
    assert policy["properties"]["kind"]["enum"] == list(POLICIES)
    assert policy["properties"]["max_num_batched_tokens"]["description"]      # the knob's doc


def test_shipped_schema_file_is_current(tmp_path: Path, capsys) -> None:
    # workloads/workload.schema.json is what `sim schema` prints today (regenerate it with
    # `sim schema --out workloads/workload.schema.json` after changing a config dataclass).
    assert main(["schema", "--out", str(tmp_path / "s.json")]) == 0
    assert json.loads((tmp_path / "s.json").read_text()) == json.loads(
        (ROOT / "workloads" / "workload.schema.json").read_text()), \
        "workloads/workload.schema.json is stale: sim schema --out workloads/workload.schema.json"

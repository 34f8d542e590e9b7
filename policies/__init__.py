"""Scheduling policies. Adding one = its file + one entry in POLICIES + one entry
in ``tests/policies/cases.py`` (the table every policy-wide test reads), and
its own test file; the workload schema is regenerated from them (``sim schema
--out workloads/workload.schema.json``; a test says when it is stale) and the
docs' policy table is built from them.

Every policy is built the same way, ``PolicyClass(config, context)``, one
object per replica, and declares what others need to know
(``sim.core.policy.Policy``), only where it differs from the safe defaults
of ``policies.base.PolicyBase``; each config field carries a one-line doc
(``knob_docs``).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from policies.dynamic import DynamicConfig, DynamicPolicy
from policies.lmdeploy import LmdeployConfig, LmdeployPolicy
from policies.orca import OrcaConfig, OrcaPolicy
from policies.sarathi import SarathiConfig, SarathiPolicy
from policies.sglang import SglangConfig, SglangPolicy
from policies.static import StaticConfig, StaticPolicy
from policies.tensorrt_llm import TensorRtLlmConfig, TensorRtLlmPolicy
from policies.tgi import TgiConfig, TgiPolicy
from policies.vllm import VllmConfig, VllmPolicy
from policies.vllm_v1 import VllmV1Config, VllmV1Policy
from sim.core.policy import Policy, PolicyContext

# kind -> (config dataclass, policy class)
POLICIES: dict[str, tuple[type, type]] = {
    "static": (StaticConfig, StaticPolicy),
    "dynamic": (DynamicConfig, DynamicPolicy),
    "orca": (OrcaConfig, OrcaPolicy),
    "vllm": (VllmConfig, VllmPolicy),
    "sarathi": (SarathiConfig, SarathiPolicy),
    "vllm_v1": (VllmV1Config, VllmV1Policy),
    "tensorrt_llm": (TensorRtLlmConfig, TensorRtLlmPolicy),
    "tgi": (TgiConfig, TgiPolicy),
    "lmdeploy": (LmdeployConfig, LmdeployPolicy),
    "sglang": (SglangConfig, SglangPolicy),
}


def make_policy(config: Any, context: PolicyContext | int) -> Policy:
    """Build the policy object for a validated policy config. ``context``
    supplies the model's context length and the device (and the measured
    server's knobs) that engine defaults depend on (``sim.run.runner.
    policy_context`` makes it from a profile); a bare max_model_len means the
    device is unknown (``PolicyContext``). Raises ValueError for a config the
    engine would refuse."""
    if isinstance(context, int):
        context = PolicyContext(context)
    return POLICIES[config.kind][1](config, context)


def knob_docs(kind: str) -> list[tuple[str, Any, str]]:
    """(name, default, doc) of every knob of policy ``kind`` (its config
    fields but ``kind``), in declaration order, for ``sim run --help``."""
    return [(f.name, f.default, f.metadata["doc"]) for f in dataclasses.fields(POLICIES[kind][0])
            if f.name != "kind"]

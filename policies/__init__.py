"""Scheduling policies. Adding one = one file + one entry in POLICIES + one test file."""

from __future__ import annotations

from policies.dynamic import DynamicConfig, DynamicPolicy
from policies.orca import OrcaConfig, OrcaPolicy
from policies.sarathi import SarathiConfig, SarathiPolicy
from policies.static import StaticConfig, StaticPolicy
from policies.vllm import VllmConfig, VllmPolicy

# kind -> (config dataclass, policy class)
POLICIES: dict[str, tuple[type, type]] = {
    "static": (StaticConfig, StaticPolicy),
    "dynamic": (DynamicConfig, DynamicPolicy),
    "orca": (OrcaConfig, OrcaPolicy),
    "vllm": (VllmConfig, VllmPolicy),
    "sarathi": (SarathiConfig, SarathiPolicy),
}


def make_policy(config: object, max_model_len: int):  # -> Policy
    """Build the policy object for a validated policy config."""
    kind = getattr(config, "kind")
    _, cls = POLICIES[kind]
    if cls is VllmPolicy:
        return VllmPolicy(config, max_model_len)  # type: ignore[arg-type]
    return cls(config)

"""Scheduling policies. Adding one = one file + one entry in POLICIES + one test file.

Every policy is built the same way, ``PolicyClass(config, context)``, and
declares what others need to know (``policies.base.Policy``); each config
field carries a one-line doc (``knob_docs``).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from policies.base import Policy, PolicyContext
from policies.dynamic import DynamicConfig, DynamicPolicy
from policies.orca import OrcaConfig, OrcaPolicy
from policies.sarathi import SarathiConfig, SarathiPolicy
from policies.static import StaticConfig, StaticPolicy
from policies.vllm import VllmConfig, VllmPolicy
from policies.vllm_v1 import VllmV1Config, VllmV1Policy

if TYPE_CHECKING:
    from sim.profile import Profile

# kind -> (config dataclass, policy class)
POLICIES: dict[str, tuple[type, type]] = {
    "static": (StaticConfig, StaticPolicy),
    "dynamic": (DynamicConfig, DynamicPolicy),
    "orca": (OrcaConfig, OrcaPolicy),
    "vllm": (VllmConfig, VllmPolicy),
    "sarathi": (SarathiConfig, SarathiPolicy),
    "vllm_v1": (VllmV1Config, VllmV1Policy),
}


def make_policy(config: Any, max_model_len: int, profile: Profile | None = None) -> Policy:
    """Build the policy object for a validated policy config. ``profile``
    supplies the device (and the measured server's knobs) that engine
    defaults depend on; without it the device is unknown (``PolicyContext``).
    Raises ValueError for a config the engine would refuse."""
    if profile is None:
        context = PolicyContext(max_model_len)
    else:
        context = PolicyContext(max_model_len, profile.device, profile.memory_bytes_per_gpu,
                                profile.tensor_parallel, profile.engine)
    return POLICIES[config.kind][1](config, context)


def knob_docs(kind: str) -> list[tuple[str, Any, str]]:
    """(name, default, doc) of every knob of policy ``kind`` (its config
    fields but ``kind``), in declaration order, for ``sim run --help``."""
    return [(f.name, f.default, f.metadata["doc"]) for f in dataclasses.fields(POLICIES[kind][0])
            if f.name != "kind"]

"""Scheduling policies. Adding one = one file + one entry in POLICIES + one test file."""

from __future__ import annotations

from typing import TYPE_CHECKING

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


def make_policy(config: object, max_model_len: int, profile: Profile | None = None):  # -> Policy
    """Build the policy object for a validated policy config. ``profile``
    supplies the device (and the measured server's knobs) that engine
    defaults depend on; without it vllm_v1 takes vLLM's defaults for GPUs
    under 70 GiB."""
    kind = getattr(config, "kind")
    _, cls = POLICIES[kind]
    if cls is VllmPolicy:
        return VllmPolicy(config, max_model_len)  # type: ignore[arg-type]
    if cls is VllmV1Policy:
        if profile is None:
            return VllmV1Policy(config, max_model_len)  # type: ignore[arg-type]
        return VllmV1Policy.from_engine(config, max_model_len, profile.device,  # type: ignore[arg-type]
                                        profile.memory_bytes_per_gpu, profile.tensor_parallel,
                                        profile.engine)
    return cls(config)

"""Shared test helpers: hand-built states, simple profiles, direct simulation."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Sequence

import pytest
import simpy

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
# tests/policies/cases.py: the one table of policies that every policy-wide test reads.
sys.path.insert(0, str(Path(__file__).resolve().parent / "policies"))

from policies import make_policy  # noqa: E402
from sim.cost.curves import Curve1D, Curve2D  # noqa: E402
from sim.loop.server import Server, SimExecutor  # noqa: E402
from sim.loop.feed import feed  # noqa: E402
from sim.core.kv import BlockManager  # noqa: E402
from sim.cost.profile import ModelShape, Profile  # noqa: E402
from sim.core.request import Request  # noqa: E402
from sim.core.state import SchedulerState  # noqa: E402

WORKLOADS = ROOT / "workloads"

# Fixtures that build the tiny model and start a real vLLM server (skipped without vllm).
pytest_plugins = ["conftest_vllm"]


def linear_profile(per_token_s: float = 1e-4, overhead_s: float = 1e-3,
                   decode_per_ctx_s: float = 1e-7, prefill_per_ctx_s: float = 1e-8) -> Profile:
    """A profile with exactly linear curves, so expected times are easy arithmetic."""
    big = 1 << 20
    model = ModelShape("toy", 256, 2, 4, 4, 512, 1000, 1 << 16)
    return Profile(
        name="linear", model=model, device="test", dtype="fp32", tensor_parallel=1,
        memory_bytes_per_gpu=1 << 34, weight_bytes=1 << 20, activation_bytes_per_gpu=0,
        kv_bytes_per_token=1024, overhead_s=overhead_s,
        linear=Curve1D([0, big], [0.0, per_token_s * big]),
        # bilinear with one non-zero corner: attn_prefill(c, p) = k * c * p exactly
        attn_prefill=Curve2D([0, big], [0, big], [[0.0, 0.0], [0.0, prefill_per_ctx_s * big * big]]),
        attn_decode=Curve2D([0, big], [0, big], [[0.0, decode_per_ctx_s * big], [0.0, decode_per_ctx_s * big]]),
        provenance={"source": "test"},
    )


def make_state(num_blocks: int = 1000, block_size: int = 16, max_model_len: int = 1 << 16,
               watermark: float = 0.0, max_prompt_tokens: int | None = None,
               refuse_by_prompt: bool = False) -> SchedulerState:
    return SchedulerState(BlockManager(num_blocks, block_size, watermark), max_model_len, max_prompt_tokens,
                          refuse_by_prompt=refuse_by_prompt)


def add(state: SchedulerState, req_id: int, prompt: int, output: int, arrival_s: float = 0.0,
        max_tokens: int | None = None) -> Request:
    r = Request(req_id, arrival_s, prompt, max_tokens if max_tokens is not None else output)
    assert state.add_arrival(r, output, arrival_s)
    return r


def policy_state(policy, num_blocks: int, block_size: int, max_model_len: int,
                 watermark: float = 0.0) -> SchedulerState:
    """The state a run gives ``policy`` (``sim.run.runner.drive``): its own pool class, its
    arrival rules, ``num_blocks`` of ``block_size`` tokens."""
    return SchedulerState(policy.kv_pool_class(num_blocks, block_size, watermark), max_model_len,
                          policy.max_prompt_tokens, refuse_by_prompt=policy.refuses_by_prompt,
                          clamp_max_tokens=policy.clamps_max_tokens)


def simulate(specs: Sequence[tuple[float, int, int]], policy_cfg, profile: Profile | None = None,
             num_blocks: int = 4096, block_size: int = 16, max_model_len: int = 1 << 16,
             watermark: float = 0.0, on_step=None, policy=None, check_stretch: bool = False,
             contents: Sequence[tuple[int, ...] | None] | None = None):
    """Run (arrival_s, prompt, output) specs through one SimPy server; return
    (server, requests). ``policy``: a policy object to run instead of
    ``policy_cfg``'s; ``check_stretch``: see ``sim.loop.server.Server``;
    ``contents``: each request's ``Request.content`` (prefix caching). The
    pool is the policy's (``kv_pool_class``), as a run builds it."""
    profile = profile or linear_profile()
    env = simpy.Environment()
    policy = policy or make_policy(policy_cfg, max_model_len)
    server = Server(env, policy, policy_state(policy, num_blocks, block_size, max_model_len, watermark),
                    SimExecutor(profile), on_step=on_step, check_stretch=check_stretch)
    reqs = [Request(i, a, p, o, content=contents[i] if contents else None) for i, (a, p, o) in enumerate(specs)]
    env.process(feed(env, [server], reqs, [o for _, _, o in specs]))
    env.run()
    return server, reqs


def step_rows(server) -> list[tuple[float, int, int, int]]:
    """(start ms, batch size, prefill tokens, decode tokens) of every step a server logged."""
    rows = []
    for t, _, _, ints in server.log.chunks():
        for j, start in enumerate(t):
            row = ints.reshape(-1, 8)[j]
            rows.append((round(start * 1000, 6), int(row[0]), int(row[1]), int(row[2])))
    return rows


@pytest.fixture
def profile() -> Profile:
    return linear_profile()


# A small Mooncake-style trace, 512 tokens per id (the default hash_block_tokens):
MOONCAKE_ROWS = [
    {"timestamp": 0, "input_length": 1100, "output_length": 2, "hash_ids": [1, 2, 3]},
    {"timestamp": 1000, "input_length": 700, "output_length": 2, "hash_ids": [1, 5]},
    {"timestamp": 2000, "input_length": 1050, "output_length": 2, "hash_ids": [1, 2, 3]},
    {"timestamp": 3000, "input_length": 532, "output_length": 2, "hash_ids": [1, 9]},
    {"timestamp": 4000, "input_length": 600, "output_length": 2, "hash_ids": [1, 9, 10]},
    {"timestamp": 5000, "input_length": 1200, "output_length": 2, "hash_ids": [1]},
]

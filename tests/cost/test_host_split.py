"""The host part of a step (``Profile.host_s``): which engine terms are host work that a
pipelined loop hides behind the forward pass (sim.loop.server.pipelined_start_s), and which
stay on the device's path, by hand."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from conftest import linear_profile, make_state  # noqa: E402

from sim.core.batch import Batch, BatchItem  # noqa: E402
from sim.cost.collectives import ENGINES  # noqa: E402
from sim.cost.curves import Curve1D  # noqa: E402
from sim.cost.kernels import HOST_TERMS, HostTerms, with_host  # noqa: E402
from sim.cost.profile import ProfileError, profile_from_dict  # noqa: E402
from sim.cost.presets import GPU_PRESETS  # noqa: E402
from sim.cost.roofline import Efficiency, preset_profile  # noqa: E402
from sim.loop.server import SimExecutor  # noqa: E402

# One prompt chunk of 500 tokens and ten decodes at 1,000 tokens of context: 11 sequences.
BATCH = Batch((BatchItem(0, 500, 0), *(BatchItem(1 + i, 1, 1000) for i in range(10))))


def test_host_s_is_per_step_plus_per_sequence() -> None:
    p = dataclasses.replace(linear_profile(overhead_s=2e-3), host_step_s=1.5e-3, host_per_seq_s=4e-5)
    assert p.host_s(BATCH) == pytest.approx(1.5e-3 + 11 * 4e-5)     # 1.5 ms + 11 x 40 us = 1.94 ms
    t = p.step_time_s(BATCH)
    # The executor: the whole step, and the device's part of it (the rest).
    assert SimExecutor(p).execute(BATCH, make_state()) == (t, t, pytest.approx(t - 1.94e-3))
    plain = linear_profile(overhead_s=2e-3)
    assert plain.host_s(BATCH) == 0.0 and SimExecutor(plain).execute(BATCH, make_state()) == (t, t, None)


def test_the_host_part_is_saved_and_read_back() -> None:
    p = dataclasses.replace(linear_profile(overhead_s=2e-3), host_step_s=1.5e-3, host_per_seq_s=4e-5)
    back = profile_from_dict(p.to_dict())
    assert (back.host_step_s, back.host_per_seq_s) == (1.5e-3, 4e-5)
    assert "host_step_s" not in linear_profile().to_dict()["curves"]        # absent: 0, as older files
    bad = p.to_dict()
    bad["curves"]["host_step_s"] = 3e-3
    with pytest.raises(ProfileError, match="host_step_s .* cannot exceed"):
        profile_from_dict(bad)


@pytest.mark.parametrize("engine", ["vllm-v0", "vllm-v1"])
def test_a_synchronous_engines_terms_are_the_presets_host_part(engine: str) -> None:
    # llama-3.1-8b at TP 2: the per-step term with its TP extra, and the per-sequence one.
    e = ENGINES[engine]
    p = preset_profile("llama-3.1-8b", "h100-sxm", tensor_parallel=2, engine=engine)
    assert p.host_step_s == pytest.approx(e.step_s + e.tp_step_s) == pytest.approx(p.overhead_s)
    assert p.host_per_seq_s == e.per_seq_s
    # The step less its host part is the step of the same preset with no engine terms (to the
    # curves' interpolation tolerance): the device's part.
    eff = Efficiency.for_gpu(GPU_PRESETS["h100-sxm"], Efficiency.for_engine(engine))
    none = dataclasses.replace(eff, engine="none", overhead_s=0.0, tp_overhead_s=0.0, per_seq_s=0.0)
    q = preset_profile("llama-3.1-8b", "h100-sxm", tensor_parallel=2, efficiency=none)
    assert p.host_s(BATCH) > 0.05 * p.step_time_s(BATCH)
    assert p.step_time_s(BATCH) - p.host_s(BATCH) == pytest.approx(q.step_time_s(BATCH), rel=1e-3)


def test_an_async_engines_terms_stay_on_the_devices_path() -> None:
    # vllm-v1-async's terms are the gap vLLM's overlap left between two forward passes: hiding
    # them again would count the overlap twice.
    assert ENGINES["vllm-v1-async"].overlapped and not ENGINES["vllm-v1"].overlapped
    p = preset_profile("llama-3.1-8b", "h100-sxm", engine="vllm-v1-async")
    assert (p.host_step_s, p.host_per_seq_s) == (0.0, 0.0) and p.overhead_s > 0


def _tables():
    # kernel time only, as sim.cost.kernels.build_tables leaves it (no wheel needed for the host terms)
    return dataclasses.replace(linear_profile(overhead_s=0.0), lm_head=Curve1D([0, 1 << 20], [0.0, 1.0]),
                               tensor_parallel=2)


def test_kernel_profiles_synchronous_host_terms_are_their_host_part() -> None:
    host = HostTerms("test", step_s=1e-3, tp_step_s=2e-4, per_seq_s=3e-5, request_s=0.05, source="by hand")
    bare, p = _tables(), with_host(_tables(), host)
    # 1 ms + 0.2 ms at TP 2 + 30 us x 11 sequences = 1.53 ms: on top of the kernels, and all host work
    assert p.step_time_s(BATCH) - bare.step_time_s(BATCH) == pytest.approx(1.53e-3, rel=1e-9)
    assert p.host_s(BATCH) == pytest.approx(1.53e-3, rel=1e-12)
    assert (p.host_step_s, p.host_per_seq_s) == (pytest.approx(1.2e-3), 3e-5)


def test_kernel_profiles_async_host_terms_stay_on_the_devices_path() -> None:
    # vLLM's async terms were fitted additively on async runs (step = kernels + terms): what the
    # overlap of those runs left unhidden, charged as before, with no host part to hide again.
    a = HOST_TERMS["vllm-async"]
    assert a.overlapped and not HOST_TERMS["vllm"].overlapped
    p = with_host(_tables(), a)
    assert p.step_time_s(BATCH) - _tables().step_time_s(BATCH) == pytest.approx(a.tp_step_s + 11 * a.per_seq_s)
    assert p.host_s(BATCH) == 0.0

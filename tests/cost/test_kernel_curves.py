"""The profile mechanics kernel profiles add, by hand and without the wheel: an LM head curve
by sampled sequences, one attention launch shared by a step's prefill chunks, decode
attention by the decodes' mean context, and curves that know where they were measured (a
lookup past that counts as extrapolated); the file round trip, the loader's refusals, and
the fast path priced the same float for float."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest
from conftest import linear_profile, simulate

from policies.vllm_v1 import VllmV1Config
from sim.core.batch import Batch, BatchItem
from sim.cost.curves import Curve1D, Curve2D, MeasuredRange
from sim.cost.profile import ProfileError, load_profile, profile_from_dict

BIG = 1 << 20


def kernel_like():
    """linear_profile's exact curves, plus: lm_head(n) = 1e-5 n + 2e-4 s, a shared launch of
    3e-4 s, and decode attention by mean context: attn_decode(n, c) = 1e-6 n + 1e-8 n c
    (bilinear with corners 0 at (0, 0), 1e-6 BIG at (BIG, 0) and (1e-6 + 1e-8 BIG) BIG at
    (BIG, BIG)), measured up to 256 decodes at a mean context of 4096."""
    base = linear_profile()
    return dataclasses.replace(
        base,
        lm_head=Curve1D([0, BIG], [2e-4, 2e-4 + 1e-5 * BIG], name="curves.lm_head", measured_max=2048),
        prefill_shared_s=3e-4,
        attn_decode=Curve2D([0, BIG], [0, BIG], [[0.0, 0.0], [1e-6 * BIG, (1e-6 + 1e-8 * BIG) * BIG]],
                            name="curves.attn_decode", measured=MeasuredRange(256, 4096)),
        decode_per_seq=True)


def test_step_time_by_hand() -> None:
    p = kernel_like()
    # Two prompts of 100 and 50 tokens (contexts 0 and 200) and 4 decodes over 1,000 context
    # tokens in all (a mean of 250):
    batch = Batch((BatchItem(0, 100, 0), BatchItem(1, 50, 200),
                   *(BatchItem(2 + i, 1, 250) for i in range(4))))
    overhead = 1e-3
    linear = 1e-4 * 154                        # 100 + 50 + 4 tokens
    lm_head = 2e-4 + 1e-5 * 6                  # 6 sequences sampled
    prefill = 1e-8 * (100 * 0 + 50 * 200)      # k c p per chunk (linear_profile)
    shared = -(2 - 1) * 3e-4                   # the second chunk does not pay the launch again
    decode = 1e-6 * 4 + 1e-8 * 4 * 250         # by the mean context, 1,000 / 4
    assert p.step_time_s(batch) == pytest.approx(overhead + linear + lm_head + prefill + shared + decode, rel=1e-12)
    # one chunk alone pays the launch: nothing is taken off
    one = Batch((BatchItem(0, 100, 0),))
    assert p.step_time_s(one) == pytest.approx(1e-3 + 1e-4 * 100 + 2e-4 + 1e-5, rel=1e-12)
    assert p.num_out_of_range == 0


def test_lookups_past_the_measured_range_are_counted() -> None:
    p = kernel_like()
    # 300 decodes exceed the 256 measured: one decode lookup counted, though the grid holds it
    p.step_time_s(Batch(tuple(BatchItem(i, 1, 100) for i in range(300))))
    assert p.attn_decode.num_out_of_range == 1 and p.lm_head.num_out_of_range == 0
    # a mean context of 5,000 > 4,096 measured: counted again
    p.step_time_s(Batch(tuple(BatchItem(i, 1, 5000) for i in range(2))))
    assert p.attn_decode.num_out_of_range == 2
    # 3,000 sequences sampled > 2,048 measured rows of the LM head (and > 256 decodes)
    p.step_time_s(Batch(tuple(BatchItem(i, 1, 10) for i in range(3000))))
    assert p.lm_head.num_out_of_range == 1 and p.num_out_of_range == 1 + 3 + 0
    p.reset_counters()
    assert p.num_out_of_range == 0


def test_measured_range_forms() -> None:
    # a table measured while chunk + context <= 16384: (16384, 16384, -1)
    pre = MeasuredRange(16384, 16384, -1.0)
    assert pre.holds(8192, 8192) and not pre.holds(8192, 8193) and not pre.holds(16385, 0)
    # per sequence, 64 decodes each measured up to 1,000: the summed context <= 1,000 x
    per = MeasuredRange(64, 0.0, 1000.0)
    assert per.holds(64, 64000) and not per.holds(64, 64001) and not per.holds(65, 0)
    c = Curve2D([0, 100], [0, 100], [[0.0, 1.0], [1.0, 2.0]], measured=MeasuredRange(50, 80))
    assert c.column(60)[2] is True and c.column(40)[2] is False     # x past 50
    assert c.column(40)[3] == 80                                    # y counted in range up to 80
    c(40, 90)                                                       # inside the grid, past 80
    assert c.num_out_of_range == 1


def test_file_round_trip_keeps_every_new_field(tmp_path: Path) -> None:
    p = kernel_like()
    path = tmp_path / "k.json"
    p.save(path)
    data = json.loads(path.read_text())
    assert data["curves"]["attn_decode"]["per_seq"] is True
    assert data["curves"]["attn_decode"]["measured"] == {"x_max": 256, "y_max": 4096, "y_per_x": 0.0}
    assert data["curves"]["lm_head"]["measured_max"] == 2048 and data["curves"]["prefill_shared_s"] == 3e-4
    q = load_profile(path)
    assert (q.lm_head.xs, q.lm_head.ys, q.lm_head.measured_max) == (p.lm_head.xs, p.lm_head.ys, 2048)
    assert q.attn_decode.measured == p.attn_decode.measured and q.decode_per_seq and q.prefill_shared_s == 3e-4
    batch = Batch((BatchItem(0, 100, 0), BatchItem(1, 50, 200), *(BatchItem(2 + i, 1, 250) for i in range(4))))
    assert q.step_time_s(batch) == p.step_time_s(batch)
    # a profile without them writes none of them (analytic and measured files unchanged)
    plain = linear_profile().to_dict()["curves"]
    assert set(plain) == {"overhead_s", "linear", "attn_prefill", "attn_decode"}
    assert "measured" not in plain["attn_decode"] and "per_seq" not in plain["attn_decode"]


@pytest.mark.parametrize("edit, message", [
    (lambda d: d["curves"]["attn_decode"].update(per_seq="yes"), "'curves.attn_decode.per_seq' must be true or false"),
    (lambda d: d["curves"]["attn_decode"].update(measured=[1, 2]), "'curves.attn_decode.measured' must be a mapping"),
    (lambda d: d["curves"]["lm_head"].update(measured_max=-1), "'curves.lm_head.measured_max' must be a finite number >= 0"),
    (lambda d: d["curves"].update(prefill_shared_s="x"), "'curves.prefill_shared_s' must be a number"),
    (lambda d: d["curves"]["lm_head"].update(seconds=[1.0, 0.5]), "'curves.lm_head.seconds' decreases along 'seqs'"),
])
def test_loader_refuses_bad_new_fields(edit, message) -> None:
    data = kernel_like().to_dict()
    edit(data)
    with pytest.raises(ProfileError, match=message.replace("(", r"\(").replace(")", r"\)")):
        profile_from_dict(data, "k.json")


@pytest.mark.parametrize("policy", [VllmV1Config(), VllmV1Config(max_num_batched_tokens=64)])
def test_fast_path_prices_kernel_profiles_as_stepping(policy) -> None:
    # Decode stretches (and, with a 64-token budget, chunked prefills beside decodes) priced by
    # the fast path must equal stepping float for float: check_stretch steps every iteration
    # and raises on the first difference; the lookups counted are the same too.
    specs = [(0.01 * i, 40 + 37 * (i % 5), 30 + 11 * (i % 7)) for i in range(24)]
    checked, _ = simulate(specs, policy, profile=kernel_like(), check_stretch=True)
    fast, _ = simulate(specs, policy, profile=kernel_like())
    def steps(server) -> list[list]:
        return [[a.tolist() for a in chunk] for chunk in server.log.chunks()]
    assert steps(checked) == steps(fast) and len(fast.log) > 100
    assert checked.executor.profile.num_out_of_range == fast.executor.profile.num_out_of_range
    assert all(math.isfinite(d) for chunk in fast.log.chunks() for d in chunk[1])


def test_the_sampler_warm_up_competes_with_the_activations_for_the_pool() -> None:
    # vLLM's rule: KV = memory x fraction - weights - max(activations, sampler warm-up); the
    # warm-up is per sequence, so max_num_seqs decides it. 80 GiB x 0.9 = 72 GiB, weights 60 GiB,
    # activations 1 GiB at any budget, 2 MiB a sequence (a 131,072-token vocabulary x 16 B).
    gib, mib = 2**30, 2**20
    p = dataclasses.replace(linear_profile(), memory_bytes_per_gpu=80 * gib, weight_bytes=60 * gib,
                            activation_bytes_per_gpu=gib, kv_bytes_per_token=64 * 1024,
                            sampler_bytes_per_seq=131072 * 16)
    # 256 sequences: 512 MiB < 1 GiB of activations, so the pool is 72 - 60 - 1 = 11 GiB
    assert p.kv_capacity_tokens(0.9, 8192, "total", 256) == 11 * gib // (64 * 1024)
    # 1,024 sequences: 2 GiB of sampler warm-up > 1 GiB: 72 - 60 - 2 = 10 GiB
    assert p.kv_capacity_tokens(0.9, 8192, "total", 1024) == 10 * gib // (64 * 1024)
    assert "sampler warm-up 1 x 2.00 GiB (1024 sequences" in p.memory_report(0.9, 8192, "total", 1024)
    # SGLang's static share and TensorRT-LLM's free share hold no such warm-up
    assert p.kv_capacity_tokens(0.9, 8192, "static", 1024) == 12 * gib // (64 * 1024)
    # and it survives the file
    assert profile_from_dict(p.to_dict()).sampler_bytes_per_seq == 131072 * 16
    assert mib * 2 == 131072 * 16

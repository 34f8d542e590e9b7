"""Black-box calibration of a serving engine (``sim calibrate --server``).

Pure tests build token timelines by hand or from a simulated vLLM v1 server
whose steps cost exactly a known profile (``probes.SimTransport``), and check
that step grouping, the equations and the fit recover what made them. One
end-to-end test calibrates a real vLLM server (skipped without vllm).
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from calibrate.fit import CurveGrid, fit_curves
from calibrate.schema import Shape
from calibrate.serving.calibrate_server import calibrate_server, main, traffic
from calibrate.serving.client import ServerInfo
from calibrate.serving.probes import HttpTransport, Knobs, Sent, SimTransport, align, analyse, combine, tag_length
from sim.core.batch import Batch, BatchItem
from sim.run.config import ConfigError, workload_from_dict
from sim.cost.profile import load_profile
from sim.run.runner import run_workload

ROOT = Path(__file__).resolve().parents[2]
TRUE_PROFILE = ROOT / "calibrate" / "profiles" / "cpu" / "tiny-llama" / "float32.yaml"
MS = 1e-3


# ---- step grouping -----------------------------------------------------------------------------
def test_align_merges_a_burst_fragment_into_its_step():
    # Three requests decoding in lockstep, steps ending at 10, 12 and 14 ms. Request 2's
    # token of the second step reaches the client 0.6 ms late (> TAU_S), so the greedy
    # pass makes it a cluster of its own; as request 2 cannot skip a step, that cluster
    # is a fragment of the step between its tokens and is merged back.
    times = [[10.00 * MS, 12.00 * MS, 14.00 * MS],
             [10.05 * MS, 12.05 * MS, 14.05 * MS],
             [10.10 * MS, 12.60 * MS, 14.10 * MS]]
    tl = align(times)
    assert [sorted(r for r, _ in m) for m in tl.members] == [[0, 1, 2]] * 3
    assert tl.step_of == [[0, 1, 2]] * 3
    assert tl.times[1] == pytest.approx(12.05 * MS)     # the median arrival of the step's tokens


def test_align_marks_coalesced_tokens():
    # Steps end at about 1, 3, 4 and 5 ms. Request 0's tokens 1 and 2 came in one event at
    # 4 ms (its stream lagged): token 1 belongs to the step before token 2's, and the
    # times of both steps are marked unreliable.
    times = [[1 * MS, 4 * MS, 4 * MS, 5 * MS], [1.01 * MS, 3.01 * MS, 4.01 * MS, 5.01 * MS]]
    tl = align(times)
    assert tl.step_of[0] == [0, 1, 2, 3] and tl.step_of[1] == [0, 1, 2, 3]
    assert {1, 2} <= tl.bad


# ---- equations -----------------------------------------------------------------------------------
def test_analyse_hand_checked_example():
    # Budget 512. Request 0 (prompt 100, 14 tokens) is sent alone at 0 ms: its first token
    # at 5 ms is a TTFT equation, request overhead + one step of a 100-token chunk. It then
    # decodes every 2 ms: token j at 5 + 2 j ms, j = 0..9 (last at 23 ms). Request 1
    # (prompt 1000, max_tokens 1) is sent at 20.5 ms, after the step ending at 21 ms was
    # scheduled, before the one ending at 23 ms was: it is admitted in the next step. vLLM
    # gives the decode (context 100 + 10 - 1 = 109) its token first and the prompt the
    # other 511 tokens of the budget: that step ends at 53 ms (gap 30 ms). Then the decode
    # at context 110 and the last 489 tokens (context 511): request 1's only token and
    # request 0's token 11 at 85 ms (gap 32 ms). Request 0 ends with tokens at 87, 89 ms.
    r0 = [5 * MS + 2 * MS * j for j in range(10)] + [53 * MS, 85 * MS, 87 * MS, 89 * MS]
    r1 = [85.01 * MS]
    sents = [Sent(0.0, 100, 14, "bg"), Sent(20.5 * MS, 1000, 1, "long")]
    eqs, bounds = analyse(sents, [100, 1000], [r0, r1], [0.0, 20.5 * MS], 512)
    mixed = sorted((e for e in eqs if e.kind == "mixed"), key=lambda e: e.y)
    assert [(e.shapes[0].prefills, e.shapes[0].decode_contexts) for e in mixed] == [
        (((511, 0),), (109,)), (((489, 511),), (110,))]
    assert [e.y for e in mixed] == pytest.approx([30 * MS, 32 * MS], abs=0.01 * MS)
    ttft = [e for e in eqs if e.kind == "ttft"]
    assert len(ttft) == 1 and ttft[0].ro == 1.0 and ttft[0].y == pytest.approx(5 * MS)
    assert ttft[0].shapes == (Shape(((100, 0),)),)
    # the join bounds request overhead (send -> queue + output -> client) to (21 - 20.5, 23 - 20.5] ms
    assert bounds == [pytest.approx((0.5 * MS, 2.5 * MS))]
    decode = [e for e in eqs if e.kind == "decode"]
    assert decode and all(e.y == pytest.approx(2 * MS) for e in decode)
    assert all(e.shapes[0].decode_contexts[0] >= 100 for e in decode)


def test_joins_replayed_through_the_budget_rules_match_the_simulated_server():
    prof = load_profile(TRUE_PROFILE)
    # four decoders, then a 3000-token prompt alone, a long + short pair sent together, and
    # three 100-token prompts together
    sents = ([Sent(0.0, 64, 900, "bg")] * 4 + [Sent(0.1, 3000, 1, "inj")]
             + [Sent(0.9, 700, 1, "pairL"), Sent(0.9, 40, 1, "pairS")]
             + [Sent(1.3, 100, 1, f"q{i}") for i in range(3)])
    tr = SimTransport(prof, max_num_seqs=32, max_num_batched_tokens=512, max_model_len=4096)
    ses = tr(sents)
    eqs, bounds = analyse(sents, ses.prompts, ses.token_times, ses.send_s, 512, max_num_seqs=32)
    mixed = [e for e in eqs if e.kind == "mixed"]
    chunks = sorted(c for e in mixed for c in e.shapes[0].prefills)
    # 3000 = 5 x 508 + 460 beside 4 decodes; the pair: 508 of the long one, then its
    # last 192 beside the whole short one; the three 100s fit together
    assert chunks == sorted([(508, k) for k in range(0, 2540, 508)] + [(460, 2540), (508, 0), (192, 508),
                                                                       (40, 0)] + [(100, 0)] * 3)
    for e in eqs:                                       # a noise-free server: every equation exact
        pred = sum(prof.step_time_s(s.to_batch()) for s in e.shapes) + e.ro * (tr.in_s + tr.out_s)
        assert pred == pytest.approx(e.y, rel=1e-3, abs=5e-5), e
    assert bounds and all(lo < tr.in_s + tr.out_s <= hi for lo, hi in bounds)


def test_combine_takes_the_median_of_repeats():
    eqs, _ = analyse([Sent(0.0, 10, 3, "A")], [10], [[5 * MS, 7 * MS, 9 * MS]], [0.0], 512)
    more, _ = analyse([Sent(0.0, 10, 3, "A")], [10], [[7 * MS, 9 * MS, 11 * MS]], [0.0], 512)
    third, _ = analyse([Sent(0.0, 10, 3, "A")], [10], [[6 * MS, 8 * MS, 10 * MS]], [0.0], 512)
    out = {e.kind: e for e in combine(eqs + more + third)}
    assert out["ttft"].y == pytest.approx(6 * MS)
    assert out["decode"].y == pytest.approx(2 * MS)


# ---- the fit --------------------------------------------------------------------------------------
def test_fit_curves_multi_step_rows_and_an_extra_unknown():
    # Exactly linear costs (representable on the grid): step = 1 ms + 10 us/token.
    # Single steps pin the curves; "TTFT" rows are 2-3 steps plus an unknown 4 ms.
    grid = CurveGrid((1, 64, 512), (2, 64, 512), (0, 512, 1024), (1, 8), (0, 1024))

    def step(s: Shape) -> float:
        return 1e-3 + 1e-5 * s.num_tokens

    singles = [Shape(((c, k),)) for c in (2, 64, 256, 512) for k in (0, 512)] + \
              [Shape((), (100,) * n) for n in (1, 4, 8)]
    multi = [tuple(Shape(((c, k),)) for c, k in plan) for plan in
             ([(512, 0), (100, 512)], [(512, 0), (512, 512), (30, 1024)], [(300, 0)])]
    shapes = singles + multi
    times = [step(s) for s in singles] + [sum(step(x) for x in m) + 4e-3 for m in multi]
    extra = [[0.0]] * len(singles) + [[1.0]] * len(multi)
    f = fit_curves(shapes, times, grid, extra_columns=extra)
    assert f.extra_s[0] == pytest.approx(4e-3, rel=0.03)
    plain = fit_curves(singles, times[:len(singles)], grid)
    assert plain.extra_s == () and plain.overhead_s == pytest.approx(f.overhead_s, rel=0.05, abs=1e-5)
    with pytest.raises(ValueError):
        fit_curves(shapes, times, grid, extra_columns=[[1.0]])


def _info(knobs_known: bool, L: int = 2048) -> ServerInfo:
    return ServerInfo("tiny", L, 512, 128, False, 16 if knobs_known else None, 256 if knobs_known else None,
                      raw={"models": {"data": [{"root": str(Path(__file__).parent / "no-such-model-folder")}]}})


def test_calibration_recovers_the_profile_of_a_simulated_server():
    """A simulated server (max_num_seqs 16, budget 256, 2048 positions) with the shipped
    CPU profile's step costs and 3% lognormal step noise: the knobs are inferred, the
    request overhead (2 ms in + 1 ms out) and the step costs of a realistic workload
    are recovered within a few %."""
    true = load_profile(TRUE_PROFILE)
    tr = SimTransport(true, max_num_seqs=16, max_num_batched_tokens=256, max_model_len=2048,
                      in_s=0.002, out_s=0.001, noise=0.03, seed=1)
    lines: list[str] = []
    cal = calibrate_server("http://simulated", budget_s=60, transport=tr, info=_info(False),
                           progress=lines.append)
    prof = cal.profile
    eng = prof.engine
    assert (eng["max_num_seqs"], eng["max_num_batched_tokens"]) == (16, 256)
    assert eng["knob_source"] == {"max_num_batched_tokens": "inferred", "max_num_seqs": "inferred"}
    assert eng["request_overhead_s"] == pytest.approx(0.003, rel=0.1)
    assert prof.fit_error["fit_mape_pct"] < 5
    # step costs of the batches a realistic workload forms (time-weighted)
    knobs = Knobs(16, 256, 2048, 512, 128, False, 4096)
    rng = np.random.default_rng(5)
    batches = _batches(true, traffic(200, 10.0, knobs, rng), knobs)
    t = np.array([true.step_time_s(b) for b in batches])
    p = np.array([prof.step_time_s(b) for b in batches])
    assert abs(p.sum() - t.sum()) / t.sum() < 0.02
    assert np.mean(np.abs(p - t) / t) < 0.04
    for load in (50, 80):
        for key in ("throughput", "ttft_p50", "ttft_p99", "itl_p50", "itl_p99"):
            assert math.isfinite(prof.fit_error[f"selfcheck_load{load}_{key}_err_pct"])
    assert prof.fit_error["selfcheck_load50_throughput_err_pct"] == pytest.approx(0, abs=5)
    assert any("self-check at 80% load" in line for line in lines)


def _batches(profile, sents, knobs):
    """The batches vLLM v1's policy forms for ``sents`` on a server with ``profile``."""
    import simpy

    from sim.core.policy import PolicyContext
    from policies.vllm_v1 import VllmV1Config, VllmV1Policy
    from sim.core.batch import StepResult
    from sim.loop.server import Server
    from sim.loop.feed import feed
    from sim.core.kv import BlockManager
    from sim.core.request import Request
    from sim.core.state import SchedulerState

    seen = []

    class Recorder:
        def execute(self, batch, state):
            seen.append(batch)
            t = profile.step_time_s(batch)
            return StepResult(t, t)

    env = simpy.Environment()
    policy = VllmV1Policy(VllmV1Config(max_num_seqs=knobs.max_num_seqs,
                                       max_num_batched_tokens=knobs.max_num_batched_tokens,
                                       async_scheduling=False),      # the simulated server is synchronous
                          PolicyContext(knobs.max_model_len))
    server = Server(env, policy, SchedulerState(BlockManager(1 << 14, 16), knobs.max_model_len), Recorder())
    reqs = [Request(i, s.offset_s, s.prompt_tokens, s.max_tokens) for i, s in enumerate(sents)]
    env.process(feed(env, [server], reqs, [s.max_tokens for s in sents]))
    env.run()
    return seen


def test_knob_flags_override_and_are_recorded():
    true = load_profile(TRUE_PROFILE)
    tr = SimTransport(true, max_num_seqs=16, max_num_batched_tokens=256, max_model_len=2048, seed=2)
    cal = calibrate_server("http://simulated", budget_s=8, transport=tr, info=_info(False),
                           max_num_seqs=16, max_num_batched_tokens=256)
    assert cal.profile.engine["knob_source"] == {"max_num_batched_tokens": "flag", "max_num_seqs": "flag"}
    assert cal.profile.fit_error["fit_num_points"] > 0


# ---- probes never hit a prefix cache ------------------------------------------------------------
def test_probe_tags_spell_nonce_and_serial_in_leading_tokens():
    # vocab 13: 10 digits (ids 3..12); 2^48 needs 15 of them (10^14 < 2^48 = 2.8e14 <= 10^15)
    assert tag_length(13) == 15 and tag_length(4096) == 5 and tag_length(4099) == 4
    tr = HttpTransport("http://x", "m", 13, seed=0, nonce=1)
    # serial 0, 1 with nonce 1: the numbers 1 << 24 = 16777216 and 16777217; base-10 digits, lowest
    # first, each + 3: 16777216 -> 6,1,2,7,7,7,6,1,0,... -> 9,4,5,10,10,10,9,4,3,...
    first, second = tr.prompts([Sent(0.0, 20, 1), Sent(0.0, 20, 1)])
    assert first[:15] == [9, 4, 5, 10, 10, 10, 9, 4, 3, 3, 3, 3, 3, 3, 3]
    assert second[:15] == [10] + first[1:15]                                # 16777217: lowest digit 7 -> 10
    assert len(first) == 20 and min(first + second) >= 3                    # no special id 0-2
    assert tr.prompts([Sent(0.0, 3, 1)]) == [[11, 4, 5]]                     # 16777218, shorter than its tag
    with pytest.raises(ValueError, match="at least 2 ids"):
        HttpTransport("http://x", "m", 4)


def test_prefix_cache_record_is_the_counters_growth():
    from calibrate.serving.calibrate_server import PREFIX_COUNTERS, prefix_cache_record

    queries, hits = PREFIX_COUNTERS
    # 1200 -> 5200 tokens queried, 256 hit before and after: 4000 queried during the calibration, none hit
    rec = prefix_cache_record(True, {queries: 1200.0, hits: 256.0}, {queries: 5200.0, hits: 256.0})
    assert (rec["enabled"], rec["queries"], rec["hits"]) == (True, 4000, 0)
    rec = prefix_cache_record(None, {queries: None, hits: None}, {queries: 5.0, hits: 0.0})   # unreadable before
    assert (rec["enabled"], rec["queries"], rec["hits"]) == (None, None, None)


class _RecordingTransport(SimTransport):
    """A simulated server that also makes, for every probe, the prompt a real server would get."""

    def __init__(self, *args, vocab_size: int, **kw) -> None:
        super().__init__(*args, **kw)
        self.http = HttpTransport("http://x", "m", vocab_size, seed=0)
        self.prompts: list[list[int]] = []

    def __call__(self, sents):
        self.prompts += self.http.prompts(sents)
        return super().__call__(sents)


def test_no_two_probes_of_a_calibration_share_a_first_block():
    """Every probe of a calibration (knob inference, designs, traffic, self-check): with the
    tiny model's 4,096 ids the tags take 5 tokens, so the first 16 tokens (vLLM's smallest
    usual block) of any two prompts at least 5 long differ, repeated designs included
    (B: sends k identical Sents)."""
    tr = _RecordingTransport(load_profile(TRUE_PROFILE), max_num_seqs=16, max_num_batched_tokens=256,
                             max_model_len=2048, seed=3, vocab_size=4096)
    calibrate_server("http://simulated", budget_s=25, transport=tr, info=_info(False))
    heads = [tuple(p[:16]) for p in tr.prompts if len(p) >= 16]
    assert len(tr.prompts) > 300 and len(heads) > 200
    assert len(set(heads)) == len(heads)
    tags = [tuple(p[:5]) for p in tr.prompts if len(p) >= 5]
    assert len(set(tags)) == len(tags)


# ---- the simulator takes the measured server's facts -----------------------------------------------
def _engine_profile(tmp_path: Path, overhead_s: float) -> Path:
    prof = load_profile(TRUE_PROFILE)
    prof.engine = {"kind": "vllm", "max_num_seqs": 4, "max_num_batched_tokens": 256, "num_gpu_blocks": 100,
                   "block_size": 128, "max_model_len": 2048, "request_overhead_s": overhead_s}
    path = tmp_path / f"p{overhead_s}.yaml"
    prof.save(path)
    return path


def test_run_takes_kv_pool_and_request_overhead_from_the_profile_engine(tmp_path):
    def run(overhead_s: float, server: dict | None = None):
        data = {"name": "t", "num_requests": 3, "arrivals": {"kind": "constant", "rate": 1.0},
                "lengths": {"kind": "fixed", "prompt_tokens": 300, "output_tokens": 5},
                "policy": "vllm_v1", "profile": {"path": str(_engine_profile(tmp_path, overhead_s))}}
        if server:
            data["server"] = server
        return run_workload(workload_from_dict(data, str(tmp_path / "w.yaml"), tmp_path))

    base, late = run(0.0), run(0.05)
    assert (base.meta["num_blocks"], base.meta["kv_block_size"], base.meta["max_model_len"]) == (100, 128, 2048)
    # requests 1 s apart: each waits nothing, so TTFT grows by exactly the overhead, ITL not at all
    assert (late.requests["ttft_s"] - base.requests["ttft_s"]).to_numpy() == pytest.approx([0.05] * 3)
    assert late.requests["arrival_s"].tolist() == base.requests["arrival_s"].tolist()
    assert late.summary["p50_itl_ms"] == pytest.approx(base.summary["p50_itl_ms"])
    own = run(0.0, {"num_blocks": 500, "max_model_len": 1024})            # the workload's own win
    assert (own.meta["num_blocks"], own.meta["max_model_len"]) == (500, 1024)


# ---- command line and purity ----------------------------------------------------------------------
def _args(**kw) -> argparse.Namespace:
    base = dict(server="http://127.0.0.1:9", out="p.yaml", budget_s=5.0, quiet=True, seed=0)
    base.update(kw)
    return argparse.Namespace(**base)


@pytest.mark.parametrize("kw, words", [
    (dict(server="localhost:8000"), "expected http://host:port"),
    (dict(server="http://127.0.0.1:9"), "cannot reach"),
    (dict(out="profile.txt"), ".yaml, .yml or .json"),
    (dict(budget_s=-1.0), "must be > 0"),
])
def test_bad_input_is_one_config_error_line(kw, words, tmp_path):
    kw.setdefault("out", str(tmp_path / "p.yaml"))
    with pytest.raises(ConfigError) as exc:
        main(_args(**kw))
    assert words in str(exc.value) and "\n" not in str(exc.value)


def test_server_calibration_never_imports_torch():
    code = ("import sys; sys.modules['torch'] = None\n"
            "import calibrate.serving.calibrate_server, calibrate.serving.probes\n"
            "from calibrate.serving.probes import SimTransport\n"
            "from calibrate.serving.calibrate_server import calibrate_server\n"
            "from calibrate.serving.client import ServerInfo\n"
            "from sim.cost.profile import load_profile\n"
            f"tr = SimTransport(load_profile({str(TRUE_PROFILE)!r}), max_num_seqs=8, max_num_batched_tokens=128,"
            " max_model_len=1024)\n"
            "calibrate_server('http://x', budget_s=5, transport=tr, info=ServerInfo('m', 1024, 64, 128, False, 8,"
            " 128))\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]


# ---- a real vLLM server ---------------------------------------------------------------------------
if Path(__file__).resolve().parents[1].joinpath("conftest_vllm.py").is_file():
    pytest_plugins = ["conftest_vllm"]        # the shared session server (tiny-llama, 8 seqs, 256 tokens)
else:                                         # not there: start our own
    @pytest.fixture(scope="session")
    def vllm_server(tmp_path_factory):
        pytest.importorskip("vllm")
        from calibrate.serving.launch import VllmServer
        from calibrate.serving.tiny_model import write_preset
        folder = write_preset(tmp_path_factory.mktemp("model") / "tiny-llama")
        with VllmServer(folder, max_num_seqs=8, max_num_batched_tokens=256, max_model_len=1024,
                        enforce_eager=True, prefix_caching=True) as server:
            yield server


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed")
def test_calibrate_a_real_vllm_server(vllm_server, tmp_path):
    from calibrate.serving.client import server_info

    out = tmp_path / "server.yaml"
    assert main(_args(server=vllm_server.url, out=str(out), budget_s=75.0)) == 0
    prof = load_profile(out)
    info = server_info(vllm_server.url)
    eng = prof.engine
    assert eng["kind"] == "vllm" and eng["num_gpu_blocks"] == info.num_gpu_blocks
    assert eng["block_size"] == info.block_size and eng["max_model_len"] == info.max_model_len
    if info.max_num_seqs:
        assert eng["max_num_seqs"] == info.max_num_seqs
    if info.max_num_batched_tokens:
        assert eng["max_num_batched_tokens"] == info.max_num_batched_tokens
    assert eng["request_overhead_s"] > 0
    fe = prof.fit_error
    assert math.isfinite(fe["fit_mape_pct"]) and "self-check" in fe["selfcheck_summary"]
    errs = [v for k, v in fe.items() if k.startswith("selfcheck_load") and k.endswith("_err_pct")]
    assert errs and all(math.isfinite(v) for v in errs)
    assert fe["elapsed_s"] < 75 * 1.3
    assert prof.provenance["url"] == vllm_server.url and prof.provenance["vllm_version"]
    # the server caches prefixes, but no probe hit it (their prompts differ from the first tokens on)
    cache = prof.provenance["prefix_cache"]
    assert cache["enabled"] is info.enable_prefix_caching is True
    assert cache["queries"] > 10_000 and cache["hits"] == 0
    assert (out.with_suffix(".csv")).is_file()
    # the profile drives the simulator with the server's knobs
    batch = Batch((BatchItem(0, 100, 0), BatchItem(1, 1, 50)))
    assert 0 < prof.step_time_s(batch) < 1

"""Runs larger than memory: chunked logs, streamed summaries and outputs, O(1) block pools.

A run's token and step logs spill to disk in chunks (``sim.core.logs``); the
summary is computed from the chunks (``sim.results.metrics``) and the outputs are
written from them (``sim.results.folder``). With tiny chunks every array, summary and
file must equal the unchunked run's, and the exact percentile selection must
equal numpy's on the same values.
"""

from __future__ import annotations

import gc
import io
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest
from conftest import ROOT, linear_profile

import sim.core.logs
import sim.results.metrics
from sim.run.config import workload_from_dict
from sim.loop.server import SimExecutor
from sim.results.folder import write_run
from sim.core.kv import BlockManager
from sim.core.logs import SpillError, StepLog, TokenLog
from sim.results.metrics import SpilledValues, distribution, inter_token_latencies, itl_values, stats_ms
from sim.core.request import Request, RequestRecords
from sim.run.runner import ProgressLines, progress_line, run_workload


@pytest.fixture
def spill_dir(tmp_path, monkeypatch) -> Path:
    """Spill folders go under a folder of this test's own."""
    folder = tmp_path / "spill"
    folder.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(folder))
    return folder


def tiny_chunks(monkeypatch) -> None:
    monkeypatch.setattr(sim.core.logs, "TOKEN_CHUNK", 7)
    monkeypatch.setattr(sim.core.logs, "STEP_CHUNK", 5)
    monkeypatch.setattr(RequestRecords, "CHUNK", 3)         # the done requests' columns too


def log_steps(log: TokenLog, steps: list[tuple[float, list[int]]]) -> None:
    """Log tokens as SchedulerState.commit does: append ids, then end the step."""
    for end_s, ids in steps:
        for i in ids:
            log.ids.append(i)
        log.end_step(end_s, len(ids))


# ---- TokenLog and StepLog ------------------------------------------------------------------------
STEPS = [(0.5, [3, 1]), (0.75, [1]), (1.0, [2, 3, 1]), (1.5, [2]), (2.0, [3, 2, 1, 0]), (2.25, [0])]
# 2 + 1 + 3 + 1 + 4 + 1 = 12 tokens
IDS = [3, 1, 1, 2, 3, 1, 2, 3, 2, 1, 0, 0]
TIMES = [0.5, 0.5, 0.75, 1.0, 1.0, 1.0, 1.5, 2.0, 2.0, 2.0, 2.0, 2.25]


def test_token_log_by_hand(spill_dir, monkeypatch) -> None:
    whole = TokenLog()
    log_steps(whole, STEPS)
    monkeypatch.setattr(sim.core.logs, "TOKEN_CHUNK", 3)
    chunked = TokenLog()
    log_steps(chunked, STEPS)
    # Spills once a step ends with >= 3 tokens held: after steps 1-2 (3), 3 (3), 4-5 (5); step 6 stays.
    assert [len(ids) for ids, _ in chunked.chunks()] == [3, 3, 5, 1]
    for log in (whole, chunked):
        ids, times = log.arrays()
        assert ids.tolist() == IDS and times.tolist() == TIMES and len(log) == 12
        assert ids.dtype == np.int64 and times.dtype == np.float64
    assert len(list(spill_dir.iterdir())) == 1               # the chunked log's folder


def test_add_stretch_equals_steps_one_by_one(spill_dir, monkeypatch) -> None:
    monkeypatch.setattr(sim.core.logs, "TOKEN_CHUNK", 5)
    ends = np.array([1.0, 1.5, 2.5, 4.0])
    ids = np.array([7, 2, 9])
    one_by_one, stretched = TokenLog(), TokenLog()
    log_steps(one_by_one, [(0.5, [4])])
    log_steps(one_by_one, [(float(t), ids.tolist()) for t in ends])
    log_steps(stretched, [(0.5, [4])])
    stretched.add_stretch(ends, ids)
    stretched.add_stretch(np.empty(0), ids)                  # no steps, no tokens
    # 1 + 4 x 3 = 13 tokens: 4, then 7 2 9 at 1.0, 1.5, 2.5 and 4.0
    for log in (one_by_one, stretched):
        got_ids, got_t = log.arrays()
        assert got_ids.tolist() == [4] + [7, 2, 9] * 4
        assert got_t.tolist() == [0.5] + [1.0] * 3 + [1.5] * 3 + [2.5] * 3 + [4.0] * 3


def test_step_log_chunks_equal_unchunked(spill_dir, monkeypatch) -> None:
    rng = np.random.default_rng(1)
    t = np.cumsum(rng.random(23))
    ints = rng.integers(0, 3000, (23, 8))
    ints[4, 7] = 2 ** 40                                        # too big for int32: that chunk stays int64
    logs = []
    for chunk in (10 ** 6, 4):
        monkeypatch.setattr(sim.core.logs, "STEP_CHUNK", chunk)
        log = StepLog()
        log.record_stretch(t[:9], t[:9] / 10, t[:9] / 9, ints[:9].ravel())
        log.record_stretch(t[9:], t[9:] / 10, t[9:] / 9, ints[9:].ravel())
        logs.append(log)
    (whole,), chunks = list(logs[0].chunks()), list(logs[1].chunks())
    assert len(chunks) == 2 and len(logs[1]) == 23                # spilled after 9 rows, 14 in memory
    for k, column in enumerate(whole):
        assert np.array_equal(np.concatenate([c[k] for c in chunks]), column)
    assert np.array_equal(whole[3], ints) and whole[3].dtype == np.int64


# ---- whole runs: chunked equals unchunked --------------------------------------------------------
def small_workload(tmp: Path, **top):
    linear_profile().save(tmp / "p.yaml")
    return workload_from_dict({
        "name": "streaming", "seed": 3, "num_requests": 40, "arrivals": {"kind": "poisson", "rate": 50.0},
        "lengths": {"kind": "uniform", "prompt_min": 5, "prompt_max": 60, "output_min": 1, "output_max": 30},
        "policy": {"kind": "vllm"}, "server": {"num_blocks": 128, "max_model_len": 256},
        "profile": {"path": str(tmp / "p.yaml")}, "slo": {"ttft_ms": 50}, **top})


def run_files(tmp: Path, name: str, cfg, replicas: int) -> dict[str, bytes]:
    result = run_workload(cfg, num_replicas=replicas, router="least_requests")
    out = write_run(result, tmp / name)
    files = {f: (out / f).read_bytes() for f in ("summary.json", "requests.csv", "steps.csv", "tokens.npz")}
    files["tables"] = (result.steps.to_csv(index=False) + result.tokens.to_csv(index=False)).encode()
    return files


@pytest.mark.parametrize("replicas", [1, 3])
def test_tiny_chunks_give_the_same_run(tmp_path, spill_dir, monkeypatch, replicas) -> None:
    cfg = small_workload(tmp_path)
    whole = run_files(tmp_path, "whole", cfg, replicas)
    tiny_chunks(monkeypatch)
    chunked = run_files(tmp_path, "chunked", cfg, replicas)
    assert chunked == whole
    summary = json.loads(whole["summary.json"])
    assert summary["count_itl"] == summary["total_output_tokens"] - summary["completed"] > 7   # several chunks
    with np.load(io.BytesIO(whole["tokens.npz"])) as z:
        assert z["req_id"].dtype == np.int64 and len(z["t_s"]) == summary["total_output_tokens"]


def test_spilled_summary_equals_in_memory(tmp_path, spill_dir, monkeypatch) -> None:
    cfg = small_workload(tmp_path)
    exact = run_workload(cfg, num_replicas=2).summary
    monkeypatch.setattr(sim.results.metrics, "MAX_IN_MEMORY_VALUES", 5)
    monkeypatch.setattr(sim.results.metrics, "MAX_IN_MEMORY_STEPS", 3)
    monkeypatch.setattr(sim.results.metrics, "MAX_GATHER", 4)
    streamed = run_workload(cfg, num_replicas=2).summary
    summed = ("mean_itl_ms", "std_itl_ms", "busy_fraction", "mean_kv_utilization")   # in another order
    for got, want in [(streamed, exact), *zip(streamed["replicas"], exact["replicas"])]:
        assert got.keys() == want.keys() and want["count_itl"] > 5 and want["num_steps"] > 3
        for key, value in want.items():
            if key in summed:
                assert got[key] == pytest.approx(value, rel=1e-12), key
            elif key != "replicas":
                assert got[key] == value, key                   # counts and order statistics: exact


# ---- ITL and exact percentiles -------------------------------------------------------------------
@pytest.mark.parametrize("piece", [1, 2, 262_144])
def test_itl_carries_last_token_across_chunks(spill_dir, monkeypatch, piece) -> None:
    # request 0: 0.0 -> 0.1 -> 0.4 (gaps 0.1, 0.3); request 1: 0.5 -> 0.7 (gap 0.2); the chunk
    # boundary falls between request 0's 0.1 and 0.4, so 0.3 needs 0.1 carried over. Chunks cut
    # into pieces of 1 or 2 tokens (the gaps of a large chunk are computed piece by piece) too.
    monkeypatch.setattr(sim.results.metrics, "GAP_PIECE", piece)
    chunks = [(np.array([0, 0]), np.array([0.0, 0.1])), (np.array([1, 0, 1]), np.array([0.5, 0.4, 0.7]))]
    gaps = itl_values(chunks, 5)
    assert np.round(gaps, 9).tolist() == [0.1, 0.3, 0.2]        # by request, then time
    ids = np.concatenate([c[0] for c in chunks])
    times = np.concatenate([c[1] for c in chunks])
    assert np.array_equal(inter_token_latencies(ids, times), gaps)
    monkeypatch.setattr(sim.results.metrics, "MAX_IN_MEMORY_VALUES", 4)     # 5 tokens: spilled
    spilled = itl_values(chunks, 5)
    assert isinstance(spilled, SpilledValues) and sorted(np.round(np.concatenate(list(spilled.chunks())), 9)) == \
        [0.1, 0.2, 0.3]


SAMPLES = {
    "lognormal": lambda rng: rng.lognormal(-4.0, 1.0, 2001),
    "many ties": lambda rng: rng.integers(0, 4, 3000) * 0.01,
    "constant": lambda rng: np.full(1000, 0.0125),
    "signed": lambda rng: rng.normal(0.0, 1.0, 999),
    "one value": lambda rng: np.array([0.25]),
    "two values": lambda rng: np.array([0.3, 0.1]),
    # p90 of [361, 641, 703, 860] ms sits at rank 2.7: numpy weighs from the upper value when the
    # weight is >= 0.5, 860 - 157 x 0.3 = 812.9, where 703 + 157 x 0.7 rounds to 812.9000000000001
    "upper-weight rounding": lambda rng: np.array([0.361, 0.703, 0.86, 0.641]),
}


@pytest.mark.parametrize("name", SAMPLES)
def test_exact_percentiles_match_numpy(name, spill_dir, monkeypatch) -> None:
    monkeypatch.setattr(sim.results.metrics, "MAX_GATHER", 8)       # refine to 64 bits whenever 9+ values tie
    values_s = SAMPLES[name](np.random.default_rng(7))
    spilled = SpilledValues()
    for part in np.array_split(values_s, 5):
        spilled.add(part)
    percentiles = (0, 1, 50, 90, 95, 99, 99.9, 100)
    mean, median, std, got = stats_ms(spilled, percentiles)
    v = values_s * 1e3
    assert got == np.percentile(v, percentiles).tolist()
    assert median == np.median(v)
    assert mean == pytest.approx(v.mean(), rel=1e-12, abs=1e-12)
    assert std == pytest.approx(v.std(), rel=1e-9, abs=1e-12)
    assert distribution("x", spilled)["count_x"] == len(values_s)
    # Asked again (vllm_bench.json after the summary), the sample is not read again for what is
    # known; new percentiles select only their own ranks, and the answers are the same.
    calls: list[set] = []
    select = sim.results.metrics.order_statistics
    monkeypatch.setattr(sim.results.metrics, "order_statistics", lambda chunks, ranks: calls.append(set(ranks)) or
                        select(chunks, ranks))
    assert stats_ms(spilled, percentiles) == (mean, median, std, got) and calls == []
    known_before = set(spilled.known["at"])
    again = stats_ms(spilled, (25, 99))
    assert again[3] == np.percentile(v, (25, 99)).tolist() and again[:3] == (mean, median, std)
    # p25's virtual rank (n - 1) / 4 needs its floor and the rank above it (below the top);
    # only those not known from the first call are selected
    n = len(values_s)
    low = (n - 1) // 4
    wanted = ({low, low + 1} if low + 1 < n else {low}) - known_before
    assert calls == ([wanted] if wanted else [])
    spilled.add(np.array([1.0]))                              # a new sample: nothing is known of it
    assert spilled.known == {} and stats_ms(spilled, (100,))[3] == [max(v.max(), 1e3)]
    spilled.close()
    assert list(spill_dir.iterdir()) == []


# ---- progress without a terminal -----------------------------------------------------------------
def test_progress_line_format() -> None:
    # 12,345 requests in 10 s of wall time: 1,234.5 per wall second
    assert progress_line(1234.54, 12345, 100000, 10.0) == (
        "simulated 1,234.5 s: 12,345/100,000 requests done, 1,234.5 requests per wall second")
    out = io.StringIO()
    lines = ProgressLines(100000, out, every_wall_s=0.0)
    lines.update(2.0, 10)
    lines.update(7.0, 40)
    text = out.getvalue()
    assert "\r" not in text and len(text.splitlines()) == 2
    assert text.splitlines()[1].startswith("simulated 7.0 s: 40/100,000 requests done, ")
    quiet = io.StringIO()
    ProgressLines(5, quiet).update(1.0, 5)                   # within the first 10 s: nothing
    assert quiet.getvalue() == ""


def test_progress_off_a_terminal_draws_no_bar(tmp_path, capsys) -> None:
    cfg = small_workload(tmp_path)
    assert run_workload(cfg, progress=True).summary == run_workload(cfg).summary
    err = capsys.readouterr().err                            # pytest's stderr is not a terminal
    assert "\r" not in err and "it/s" not in err and "req/s" not in err


# ---- the block pool ------------------------------------------------------------------------------
class ListPool:
    """The former BlockManager: every free id in a list, popped from the end."""

    def __init__(self, num_blocks: int) -> None:
        self.free_ids = list(range(num_blocks - 1, -1, -1))

    def allocate(self, req: Request, num_blocks: int) -> None:
        req.block_ids.extend(self.free_ids.pop() for _ in range(num_blocks - len(req.block_ids)))

    def free(self, req: Request) -> None:
        self.free_ids.extend(reversed(req.block_ids))
        req.block_ids = []


def test_block_ids_by_hand() -> None:
    kv = BlockManager(6, 4)
    a, b = Request(0, 0.0, 8, 1), Request(1, 0.0, 4, 1)
    kv.allocate(a, 8)                                        # 8 / 4 = 2 blocks: 0, 1
    kv.allocate(b, 12)                                       # 3 blocks: 2, 3, 4
    kv.free(a)                                               # 0 and 1 back, 0 on top of the stack
    assert kv.append_block(b) and b.block_ids == [2, 3, 4, 0]
    assert (kv.num_free_blocks, kv.num_used_blocks) == (2, 4)   # 1 and 5 free
    kv.allocate(a, 8)
    assert a.block_ids == [1, 5] and not kv.append_block(a) and not kv.can_allocate(a, 9)


def test_block_ids_equal_the_list_pool() -> None:
    rng = np.random.default_rng(11)
    num_blocks = 50
    new, old = BlockManager(num_blocks, 1), ListPool(num_blocks)
    held: dict[int, tuple[Request, Request]] = {}
    for step in range(3000):
        pick = list(held)[int(rng.integers(len(held)))] if held else None
        if pick is not None and (rng.random() < 0.3 or new.num_free_blocks == 0):
            r_new, r_old = held.pop(pick)
            new.free(r_new)
            old.free(r_old)
        else:
            grown = pick is not None and rng.random() < 0.5
            r_new, r_old = held[pick] if grown else (Request(step, 0.0, 1, 1), Request(step, 0.0, 1, 1))
            grow = int(rng.integers(1, 1 + min(6, new.num_free_blocks)))
            if rng.random() < 0.5:
                new.allocate(r_new, len(r_new.block_ids) + grow)
                old.allocate(r_old, len(r_old.block_ids) + grow)
            else:
                assert new.append_block(r_new)
                old.allocate(r_old, len(r_old.block_ids) + 1)
            held[r_new.req_id] = (r_new, r_old)
        assert [r[0].block_ids for r in held.values()] == [r[1].block_ids for r in held.values()]
        assert new.num_free_blocks == len(old.free_ids)


def test_pool_construction_is_constant_time() -> None:
    kv = BlockManager(10 ** 12, 16)                          # a list of ids would not fit in memory
    r = Request(0, 0.0, 40, 1)
    kv.allocate(r, 40)
    assert r.block_ids == [0, 1, 2] and kv.num_free_blocks == 10 ** 12 - 3


# ---- spill folders do not outlive the run --------------------------------------------------------
def test_spill_folder_removed_on_close_and_collection(spill_dir, monkeypatch) -> None:
    tiny_chunks(monkeypatch)
    closed, dropped = TokenLog(), StepLog()
    log_steps(closed, STEPS)
    dropped.record_stretch(np.arange(9.0), np.ones(9), np.ones(9), [1] * 72)
    assert len(list(spill_dir.iterdir())) == 2
    closed.close()
    del dropped
    gc.collect()
    assert list(spill_dir.iterdir()) == []


def test_spill_folder_removed_when_a_run_fails(tmp_path, spill_dir, monkeypatch) -> None:
    tiny_chunks(monkeypatch)
    calls = []
    execute = SimExecutor.execute

    def failing(self, batch, state):
        calls.append(1)
        if len(calls) > 30:                                  # well after the first spills
            raise RuntimeError("executor failed")
        return execute(self, batch, state)
    monkeypatch.setattr(SimExecutor, "execute", failing)
    with pytest.raises(RuntimeError, match="executor failed"):
        run_workload(small_workload(tmp_path))
    gc.collect()
    assert list(spill_dir.iterdir()) == []


def test_full_spill_disk_is_one_line(tmp_path, monkeypatch) -> None:
    def no_space(*args, **kwargs):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(tempfile, "mkdtemp", no_space)
    tiny_chunks(monkeypatch)
    with pytest.raises(SpillError, match=r"cannot spill the run's logs to disk \(No space left on device\); free "
                                          r"space there or set TMPDIR to a larger disk"):
        run_workload(small_workload(tmp_path))


@pytest.mark.parametrize("ending", ["return", "raise"])
def test_spill_folder_removed_at_exit(tmp_path, ending) -> None:
    script = ("import sys, numpy as np, sim.core.logs as L\n"
              "L.TOKEN_CHUNK = 2\n"
              "log = L.TokenLog()\n"
              "log.add_stretch(np.arange(3.0), np.arange(4))\n"
              "print(log._spill.path, flush=True)\n"
              + ("raise SystemExit(0)\n" if ending == "return" else "raise RuntimeError('boom')\n"))
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT, timeout=60)
    folder = Path(done.stdout.strip())
    assert folder.name.startswith("batchsim-spill-") and not folder.exists()
    assert (done.returncode == 0) == (ending == "return")


# ---- Requests in flight only; done requests as compact records -----------------------------------
def test_done_requests_leave_the_state_as_records(tmp_path) -> None:
    """A run holds Request objects only for the requests in flight: each one
    that finishes or is rejected moves into the state's RequestRecords, and
    the requests table is built from those records, which it empties."""
    from sim.loop.server import Server
    from sim.loop.feed import feed
    import simpy
    from sim.core.policy import PolicyContext
    from policies.vllm import VllmConfig, VllmPolicy
    from sim.core.state import SchedulerState

    env = simpy.Environment()
    # 4 blocks x 16 tokens, max_model_len 64: request 2 (prompt 60 + max_tokens 10 = 70 > 64) is rejected.
    state = SchedulerState(BlockManager(4, 16), 64)
    server = Server(env, VllmPolicy(VllmConfig(max_num_seqs=2, max_num_batched_tokens=64),
                                    PolicyContext(64)), state, SimExecutor(linear_profile()))
    reqs = [Request(0, 0.0, 10, 3), Request(1, 0.0, 10, 3), Request(2, 0.5, 60, 10), Request(3, 0.5, 10, 2)]
    in_flight = []
    server.on_step = lambda start_s, batch, result: in_flight.append(len(state.requests))
    env.process(feed(env, [server], reqs, [3, 3, 10, 2]))
    env.run()
    assert not state.requests and not state._true_output           # nothing held after the run
    assert max(in_flight) <= 3                                      # never more than were in flight
    assert len(state.records) == 4 and state.num_rejected == 1
    from sim.run.runner import request_table
    table = request_table([server], 4).frame()
    assert table["req_id"].tolist() == [0, 1, 2, 3]                 # id order, whatever the finish order
    assert table["status"].tolist() == ["finished", "finished", "rejected", "finished"]
    assert table["reject_reason"].tolist() == ["", "", "context", ""]
    # true output min(10, max_tokens 10) = 10 for the rejected one; the others their own
    assert table["output_tokens"].tolist() == [3, 3, 10, 2]
    assert table["finished_s"][2] == 0.5 and np.isnan(table["ttft_s"][2])
    assert len(state.records) == 0                                  # handed over to the table
    # ... and let go of: add()'s bound appends hold the new, empty columns, not the handed-over
    # ones (which stayed alive beside the table: 66 MB at a million requests)
    assert [len(append.__self__) for append in state.records._appends] == [0] * len(state.records.COLUMNS)
    with pytest.raises(RuntimeError, match="not each of 0..3 once"):
        request_table([server], 4)                                  # taken once


def test_requests_table_scatters_replicas_records_into_id_order(tmp_path) -> None:
    cfg = small_workload(tmp_path)
    one = run_workload(cfg).requests
    three = run_workload(cfg, num_replicas=3, router="round_robin").requests
    assert three["req_id"].tolist() == list(range(40))
    assert three["replica"].tolist() == [i % 3 for i in range(40)]   # round robin: request i on replica i mod 3
    assert three["arrival_s"].tolist() == one["arrival_s"].tolist()


# ---- CSV text: to_csv's bytes, faster --------------------------------------------------------------
def test_csv_text_is_to_csv_byte_for_byte() -> None:
    import pandas as pd
    from sim.results.folder import csv_text, write_csv
    rng = np.random.default_rng(0)
    n = 3000
    f = rng.standard_normal(n) * 10.0 ** rng.integers(-20, 20, n)
    f[::7] = np.nan
    f[3], f[4], f[5], f[6], f[8], f[9] = np.inf, -np.inf, -0.0, 1.0, 1e16, 1e-5
    frame = pd.DataFrame({"a": f, "b": f.copy(), "big": rng.integers(-5, 10**12, n), "small": rng.integers(0, 30, n),
                          "status": rng.choice(["finished", "rejected", ""], n), "flag": rng.random(n) < .5,
                          "c": f * 3})
    for part in (frame, frame[["status"]], frame[["a"]], frame.iloc[:0], frame[["small", "status"]]):
        for header in (True, False):
            want = part.to_csv(index=False, header=header)
            assert csv_text(part, header=header) == want
            buf = io.StringIO()
            write_csv(buf, part, header=header, rows=777)               # in row chunks
            assert buf.getvalue() == want
    # what it cannot write as pandas does, it leaves to pandas
    assert csv_text(pd.DataFrame({"x": ["a,b"]})) is None              # would need quoting
    assert csv_text(pd.DataFrame({"x": [None, "a"]})) is None          # not a plain string
    assert csv_text(pd.DataFrame({"x": np.float32([1.5])})) is None    # float32 prints differently
    buf = io.StringIO()
    write_csv(buf, pd.DataFrame({"x": ["a,b", 'say "hi"'], "y": [1.5, np.nan]}))
    assert buf.getvalue() == 'x,y\n"a,b",1.5\n"say ""hi""",\n'


# ---- The compact requests table -----------------------------------------------------------------
def test_request_table_chunks_and_columns_equal_the_whole_table(tmp_path) -> None:
    """A run's RequestTable gives, chunk by chunk and column by column, exactly
    what its whole DataFrame holds; the summaries and files of a run never
    build that DataFrame."""
    from sim.results.folder import write_run
    from sim.results.table import RequestTable
    from sim.results.vllm_bench import bench_result
    cfg = small_workload(tmp_path, server={"num_blocks": 128, "max_model_len": 64})   # some rejected
    with pytest.warns(UserWarning, match="9 of 40 requests were rejected"):
        result = run_workload(cfg, num_replicas=2)
    table = result.table
    assert isinstance(table, RequestTable)
    write_run(result, tmp_path / "out", bench=bench_result(result, [50, 99]))
    assert result._requests is None                           # written and summarised from the table
    whole = result.requests                                   # built on first use
    assert whole["status"].tolist().count("rejected") == result.summary["failed"] > 0
    assert (tmp_path / "out" / "requests.csv").read_text() == whole.to_csv(index=False)
    import pandas as pd
    pd.testing.assert_frame_equal(pd.concat(list(table.frames(rows=7)), ignore_index=True), whole)
    names = ["req_id", "status", "prompt_tokens", "ttft_s", "tpot_s", "arrival_s"]
    for finished_only in (False, True):
        rows = whole[whole["status"] == "finished"] if finished_only else whole
        got = table.columns_of(names, finished_only=finished_only)
        for name in names:
            want = rows[name].to_numpy()
            assert got[name].dtype == want.dtype, name
            assert np.array_equal(got[name], want, equal_nan=want.dtype.kind == "f"), name
    one = whole[whole["replica"] == 1]
    sub = table.take(np.flatnonzero(table.cols["replica"] == 1))
    pd.testing.assert_frame_equal(sub.frame().reset_index(drop=True), one.reset_index(drop=True))
    assert np.array_equal(sub.columns_of(["req_id"], finished_only=True)["req_id"],
                          one.loc[one["status"] == "finished", "req_id"].to_numpy())
    reasons = whole.loc[whole["status"] == "rejected", "reject_reason"].value_counts()
    assert table.failed_by_reason() == {k: int(v) for k, v in reasons.items()} == result.summary["failed_by_reason"]

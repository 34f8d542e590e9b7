"""Two of vLLM's own rules that batchsim had otherwise.

steps.csv counts a one-token prefill chunk as prefill, as vLLM counts it:
``Batch`` sees items, not requests: an item computing one token is priced as a
decode (it is one query row, as the engines' attention kernels treat it), but
when it belongs to a prompt or a recompute in progress (the last token of a
step's budget, the end of a recompute) the step log counts it among the
prefill tokens and prefill sequences, not the decodes.

A max_tokens that the context cannot hold is cut to what it leaves, as vLLM
0.32's OpenAI server cuts it, under vllm_v1 (``clamps_max_tokens``).
"""

from __future__ import annotations

import numpy as np

from conftest import add, make_state, simulate
from policies.vllm_v1 import VllmV1Config
from sim.core.batch import Batch, BatchItem


def _rows(server) -> np.ndarray:
    """The step log's integer columns (StepLog.COLUMNS[3:]), one row per step."""
    parts = [ints.reshape(-1, 8) for _, _, _, ints in server.log.chunks()]
    return np.concatenate(parts)


def test_the_last_token_of_a_budget_is_a_prefill_chunk() -> None:
    # vllm_v1, budget 8 tokens, one request: prompt 9, 2 outputs.
    # step 1: 8 prompt tokens (a chunk), step 2: the 9th prompt token alone, a one-token
    # item of a prompt in progress: a prefill (it samples the first output), step 3: a decode
    # of the second output. Columns: batch, prefill tok, decode tok, pad, prefill seqs.
    server, _ = simulate([(0.0, 9, 2)], VllmV1Config(max_num_seqs=4, max_num_batched_tokens=8,
                                                     enable_prefix_caching=False))
    rows = _rows(server)[:, :5]
    assert rows.tolist() == [[1, 8, 0, 0, 1], [1, 1, 0, 0, 1], [1, 0, 1, 0, 0]]


def test_a_one_token_prefill_beside_decodes() -> None:
    # Budget 8: r0 (prompt 4, 4 outputs) and r1 (prompt 12, 1 output) arrive at t=0.
    # step 1: r0's prompt (4) + r1's first 4 prompt tokens (8 - 4 left of the budget);
    # step 2: r0 decodes (1) + r1's next 7 (8 - 1): 11 of its 12;
    # step 3: r0 decodes, and r1's last prompt token is a one-token prefill chunk (it samples
    # r1's only output): prefill 1, decode 1, prefill seqs 1 (the old count said decode 2);
    # step 4: r0 decodes alone (its outputs: 1 at step 1, 2, 3, then 4).
    server, _ = simulate([(0.0, 4, 4), (0.0, 12, 1)],
                         VllmV1Config(max_num_seqs=4, max_num_batched_tokens=8, enable_prefix_caching=False))
    rows = _rows(server)[:, :5]
    assert rows.tolist() == [[2, 8, 0, 0, 2], [2, 7, 1, 0, 1], [2, 1, 1, 0, 1], [1, 0, 1, 0, 0]]


def test_the_end_of_a_recompute_is_a_prefill_chunk() -> None:
    # A request (prompt 5) samples 2 outputs, is preempted and readmitted: it recomputes its 7
    # known tokens. A 6-token chunk leaves it one short; the 7th token, at context 6 (past its
    # prompt: the count by context alone would call it a decode) is the recompute's end, a
    # prefill; the step after, a plain decode.
    state = make_state(num_blocks=100, block_size=4)
    r = add(state, 0, 5, 4)
    state.admit(r, 0.0)

    def step(n: int, context: int) -> int:
        batch = Batch((BatchItem(0, n, context),))
        short = state.prefill_items(batch)
        state.commit(batch, 1.0)
        return short

    assert step(5, 0) == 0 and r.num_output_tokens == 1      # the prompt: not a one-token item
    assert step(1, 5) == 0 and r.num_output_tokens == 2      # a decode
    state.preempt(r)
    state.admit(r, 2.0)
    assert step(6, 0) == 0 and r.num_output_tokens == 2      # recompute, 6 of 7
    assert step(1, 6) == 1 and r.num_output_tokens == 3      # its end: one token, a prefill
    assert step(1, 7) == 0 and r.num_output_tokens == 4      # a decode again


def test_max_tokens_past_the_context_is_cut_as_vllms_server_cuts_it() -> None:
    # vLLM 0.32's OpenAI server (get_max_tokens): max_model_len 100, prompt 90, max_tokens 30
    # -> cut to 100 - 90 = 10, the reply ends there; prompt 100 (no room for one token) and
    # max_tokens 101 (> max_model_len) are refused. The other rule (vLLM v0, the default of
    # PolicyBase) refuses prompt + max_tokens > max_model_len: 90 + 30 = 120 > 100.
    from sim.core.kv import BlockManager
    from sim.core.request import Request
    from sim.core.state import SchedulerState
    state = SchedulerState(BlockManager(100, 4), 100, clamp_max_tokens=True)
    cut, full, long_max, no_room = (Request(0, 0.0, 90, 30), Request(1, 0.0, 50, 50), Request(2, 0.0, 5, 101),
                                    Request(3, 0.0, 100, 1))
    assert state.add_arrival(cut, 30, 0.0) and cut.max_output_tokens == 10
    assert state.oracle_output_tokens(cut) == 10              # the true output, cut with it
    assert state.add_arrival(full, 50, 0.0) and full.max_output_tokens == 50   # 50 + 50 fits exactly
    assert not state.add_arrival(long_max, 3, 0.0) and long_max.reject_reason == "model_len"
    assert not state.add_arrival(no_room, 1, 0.0) and no_room.reject_reason == "model_len"
    assert state.num_clamped == 1
    v0 = SchedulerState(BlockManager(100, 4), 100)
    r = Request(0, 0.0, 90, 30)
    assert not v0.add_arrival(r, 30, 0.0) and r.reject_reason == "context"


def test_vllm_v1_runs_a_cut_request_to_the_context() -> None:
    # max_model_len 64, prompt 60, max_tokens 10 (true output 10): vllm_v1 cuts it to 4 tokens.
    server, reqs = simulate([(0.0, 60, 10)], VllmV1Config(max_num_seqs=4, max_num_batched_tokens=64,
                                                          enable_prefix_caching=False), max_model_len=64)
    records = server.state.records
    assert server.state.num_clamped == 1 and server.state.num_rejected == 0
    assert reqs[0].max_output_tokens == 4 and reqs[0].num_output_tokens == 4
    assert len(records) == 1


def test_the_replay_asks_for_what_the_simulation_serves() -> None:
    # max_model_len 512, max_tokens 600 ("max_tokens: 600"), outputs 600 each: under vllm_v1 (it cuts
    # max_tokens as vLLM's server does) prompt 10 + max_tokens 600 is refused by both (600 > 512),
    # so the replay sends it as it is (600: the server refuses it); under the cut max_tokens 100
    # with prompt 450: 450 + 100 > 512 -> cut to 62; prompt 512 leaves no room: both refuse, sent
    # as it is (100). Under sarathi (the refusal rule) nothing is cut: min(output, max_tokens).
    from calibrate.serving.validate_server import replay_tokens
    from sim.run.config import workload_from_dict
    from workloads.generate import RequestSpecs

    def cfg(kind: str, max_tokens: int):
        return workload_from_dict({"name": "r", "num_requests": 3, "arrivals": {"kind": "poisson", "rate": 1.0},
                                   "lengths": {"kind": "fixed", "prompt_tokens": 10, "output_tokens": 600},
                                   "max_tokens": max_tokens, "policy": {"kind": kind},
                                   "server": {"max_model_len": 512}})

    specs = RequestSpecs(np.array([0.0, 1.0, 2.0]), np.array([10, 450, 512]), np.array([600, 600, 600]))
    assert replay_tokens(cfg("vllm_v1", 600), specs, 512).tolist() == [600, 600, 600]
    assert replay_tokens(cfg("vllm_v1", 100), specs, 512).tolist() == [100, 62, 100]
    assert replay_tokens(cfg("sarathi", 100), specs, 512).tolist() == [100, 100, 100]


def test_a_cpu_measured_profile_schedules_synchronously() -> None:
    # calibrate/profiles/cpu/tiny-llama/float32.yaml names its device by the CPU model ("AMD
    # EPYC"), provenance.device "cpu": vLLM's CPU platform runs synchronously, and so does vllm_v1
    # on it (unset async_scheduling); an H100 preset's device is a GPU: async.
    from sim.cost.profile import load_profile
    from sim.run.config import workload_from_dict
    from sim.run.runner import build_policy
    from conftest import ROOT

    cpu = load_profile(ROOT / "calibrate" / "profiles" / "cpu" / "tiny-llama" / "float32.yaml")
    cfg = workload_from_dict({"name": "c", "num_requests": 2, "arrivals": {"kind": "poisson", "rate": 1.0},
                              "lengths": {"kind": "fixed", "prompt_tokens": 16, "output_tokens": 4},
                              "policy": {"kind": "vllm_v1"}, "server": {"max_model_len": 512}})
    assert cpu.device == "AMD EPYC"
    assert not build_policy(cfg, 512, cpu).async_scheduling
    from sim.run.runner import build_profile
    gpu_cfg = workload_from_dict({**cfg.raw, "profile": {"model": "llama-3.1-8b", "gpu": "h100-sxm"}})
    assert build_policy(gpu_cfg, 512, build_profile(gpu_cfg)).async_scheduling

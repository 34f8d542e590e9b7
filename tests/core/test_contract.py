"""The core's contract pieces that the loop and the results read by name."""

from __future__ import annotations

from conftest import add, make_state

from sim.core.batch import Batch, BatchItem, StepResult
from sim.core.logs import StepLog


def test_step_log_columns_are_named_by_their_index() -> None:
    names = StepLog.COLUMNS[3:]
    assert len(names) == StepLog.NUM_INTS == 8
    assert names[StepLog.BATCH_SIZE] == "batch_size"
    assert names[StepLog.PREFILL_TOKENS] == "num_prefill_tokens"
    assert names[StepLog.DECODE_TOKENS] == "num_decode_tokens"
    assert names[StepLog.PAD_TOKENS] == "num_pad_tokens"
    assert names[StepLog.PREFILL_SEQS] == "num_prefill_seqs"
    assert names[StepLog.WAITING] == "num_waiting"
    assert names[StepLog.RUNNING] == "num_running"
    assert names[StepLog.KV_USED_BLOCKS] == "kv_used_blocks"


def test_step_log_records_the_counts_it_is_given() -> None:
    # A chunk of 100 prompt tokens of request 0 (3 padded) beside two decodes:
    # batch_size 3, 100 prefill tokens, 2 decode tokens, 3 pad, 1 prefill seq.
    log = StepLog()
    batch = Batch((BatchItem(0, 100, 0, 3), BatchItem(1, 1, 40), BatchItem(2, 1, 17)))
    log.record(0.5, batch, StepResult(duration_s=0.25, predicted_s=0.2), 7, 3, 11)
    ((t_s, duration_s, predicted_s, ints),) = list(log.chunks())
    assert (t_s.tolist(), duration_s.tolist(), predicted_s.tolist()) == ([0.5], [0.25], [0.2])
    assert ints.tolist() == [[3, 100, 2, 3, 1, 7, 3, 11]]


def test_fingerprint_changes_with_what_a_decision_reads() -> None:
    state = make_state(num_blocks=10, block_size=16)
    before = state.fingerprint()
    assert state.fingerprint() == before                  # nothing changed: equal (a stall, if Idle twice)
    r = add(state, 0, prompt=20, output=4)
    arrived = state.fingerprint()
    assert arrived != before                               # one more waiting
    state.kv.allocate(r, 20)                               # 20 tokens: 2 blocks of 16
    assert state.fingerprint() != arrived                  # two fewer free blocks
    state.all_arrived = True
    assert state.fingerprint()[5] is True

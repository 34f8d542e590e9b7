"""Prefix caching of a hybrid model's KV pool: vLLM 0.32's ``mamba_cache_mode`` "align".

A hybrid model (``sim.cost.hybrid``) has one attention group and ``state_groups`` linear-attention
(Mamba) groups in one block pool. With prefix caching off each linear group holds one state block
a request (``sim.core.kv.StateBlockPool``). With it on, vLLM sets ``mamba_cache_mode`` "align"
(``vllm/model_executor/models/config.py``, ``MambaModelConfig.verify_and_update_config``) and a
linear group's block size to the attention block size (``vllm/platforms/interface.py``,
``_align_hybrid_block_size``), and ``AlignStatePool`` keeps its blocks as vLLM 0.32's
``MambaManager`` does in that mode (``vllm/v1/core/single_type_kv_cache_manager.py``), the
attention group as ``sim.core.prefix.PrefixCachePool`` (the same free queue, the same hashes):

1. Block table (``MambaManager.allocate_new_blocks``, align branch): a linear group's table is
   indexed by position like an attention table, but holds a real block only where a state is
   kept; the others are vLLM's null block (``None`` here). A step that takes a request to
   ``num_tokens`` tokens needs ceil(num_tokens / block_size) entries: if the table is shorter, it
   is padded with nulls up to one short of that and one new block is taken, the one that will
   hold the state at the step's end. So a group takes at most one block a step.
2. Freeing (``MambaManager.remove_skipped_blocks`` and ``_remove_blocks_in_range``; run by
   ``KVCacheManager.allocate_slots`` before it counts the blocks a step needs): with ``c`` tokens
   computed, every block before index (c - 1) // block_size is given back (last index first) and
   nulled: a request keeps the block holding its latest state and, until its next step, the one
   holding the state before it (the kernel copies from it).
3. Caching (``MambaManager.cache_blocks`` over ``SingleTypeKVCacheManager.cache_blocks`` and
   ``BlockPool.cache_full_blocks``, which skips nulls): when a step's tokens fill block ``i``, the
   group's block at ``i`` (if not null) is registered under block ``i``'s hash (the attention
   block's, with the group's id): it holds the state after exactly (i + 1) x block_size tokens.
   The scheduler's split (``policies.vllm_v1``, rule 10) makes prefill chunks end on block
   boundaries so that these states exist.
4. Lookup (``HybridKVCacheCoordinator.find_longest_cache_hit`` with one attention group and the
   linear groups: ``is_simple_hybrid``): the attention group's hit (``PrefixCachePool.lookup``),
   then the linear groups' (``MambaManager.find_longest_cache_hit``): the longest prefix of at
   most that many blocks whose last block's state is cached in every linear group, searched from
   the right; the attention hit is cut to it. A hit of ``k`` blocks gives a linear group ``k - 1``
   nulls and the cached state block (``add_local_computed_blocks`` with
   ``get_num_skipped_tokens`` = computed - 1), which the request then shares.
5. Admission (``MambaManager.get_num_blocks_to_allocate``, align branch): a waiting request needs
   one new block a linear group (the full-sequence check too), plus its hit state block where no
   one holds it (it leaves the free queue); a hit whose state block was registered by another
   request in this same step is refused (vLLM returns more blocks than the pool has:
   ``cached_blocks_this_step``, cleared by ``new_step_starts`` at each ``schedule``).
6. Frees (``KVCacheCoordinator.free``): group by group, the attention group first, each table
   last block first (``BlockPool.free_blocks``: unhashed blocks to the free queue's front, hashed
   ones to its end), nulls skipped.

Only vLLM's default path of align mode: no partial (sub-block) hash hits
(``enable_partial_hash_hits``: the hash block is the block), no prefill checkpoint blocks
(``MambaSpec.num_prefill_checkpoint_blocks`` 0, as vLLM's Gated DeltaNet layers declare: only
Mamba2 and KDA layers set one), no shared-prefix checkpoint
(``enable_mamba_shared_prefix_checkpoint`` off), no speculative decoding's state blocks, and the
synchronous scheduler (``sim.run.runner`` refuses the rest).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from sim.core.prefix import PrefixCachePool, extend_hashes

if TYPE_CHECKING:
    from sim.core.request import Request


class AlignStatePool(PrefixCachePool):
    """A hybrid model's prefix-caching pool (the module doc): the attention group's blocks are
    ``req.block_ids`` (``PrefixCachePool``'s), each of ``state_groups`` linear groups has a table
    of block ids and ``None`` (vLLM's null block) per request. Made per layout by
    ``align_state_pool``."""

    __slots__ = ("_tables", "_state_cached", "_hits", "_cached_this_step", "_junctions")

    def __init__(self, num_blocks: int, block_size: int, watermark: float = 0.0) -> None:
        super().__init__(num_blocks, block_size, watermark)
        self._tables: dict[int, list[list[int | None]]] = {}    # request -> a table a linear group
        self._state_cached: dict[int, int] = {}                  # request -> its table entries registered
        self._hits: dict[int, tuple[int, list[int]]] = {}       # request -> (hit blocks, a state block a group)
        self._cached_this_step: set[int] = set()                 # hashes a linear group registered this step
        self._junctions: dict[int, int] = {}                     # request -> shared_prefix_boundary

    def new_step_starts(self) -> None:
        """A new ``schedule`` call (rule 5: ``MambaManager.new_step_starts``)."""
        self._cached_this_step.clear()

    # ---- rule 4: lookup ---------------------------------------------------------------------
    def lookup(self, req: Request) -> list[int]:
        hit = super().lookup(req)
        self._hits.pop(req.req_id, None)
        self._junctions.pop(req.req_id, None)
        if not hit:
            return hit
        hashes = req.block_hashes
        cached = self._cached
        for i in range(len(hit) - 1, -1, -1):
            h = hashes[i]
            states = [cached.get((h, g)) for g in range(self.state_blocks)]
            if None not in states:
                self._hits[req.req_id] = (i + 1, states)    # type: ignore[assignment]
                if i + 1 < len(hit):
                    self._junctions[req.req_id] = len(hit) * self.block_size
                return hit[:i + 1]
        self._junctions[req.req_id] = len(hit) * self.block_size
        return []

    def shared_prefix_boundary(self, req: Request) -> int:
        """vLLM's ``request.shared_prefix_boundary`` (``KVCacheManager.get_computed_blocks``): the
        attention group's hit where the linear groups' was shorter at ``req``'s last lookup
        (the prefix others computed whose state is not cached), else 0."""
        return self._junctions.get(req.req_id, 0)

    def cached_prefix_blocks(self, req: Request) -> int:
        """A router's view (whole prompt blocks): the longest prefix whose last block's state is
        cached in every linear group, within the attention group's hit."""
        n = super().cached_prefix_blocks(req)
        hashes, cached = req.block_hashes, self._cached
        for i in range(n - 1, -1, -1):
            if all((hashes[i], g) in cached for g in range(self.state_blocks)):
                return i + 1
        return 0

    def state_admission_blocks(self, req: Request) -> int:
        """Rule 5: the blocks ``req`` (waiting, just looked up) takes in its linear groups: one
        new a group, plus its hit's state blocks no one holds; more than the pool if a state
        block of its hit was registered this step."""
        got = self._hits.get(req.req_id)
        if got is None:
            return self.state_blocks
        k, states = got
        if req.block_hashes[k - 1] in self._cached_this_step:
            return self.num_blocks + 1
        lru = self._lru
        return self.state_blocks + sum(1 for b in states if b in lru)

    def touch(self, req: Request, blocks: list[int]) -> None:
        super().touch(req, blocks)
        got = self._hits.pop(req.req_id, None)
        if got is None or got[0] != len(blocks):
            raise RuntimeError(f"request {req.req_id}: touched a hit its lookup did not give")
        k, states = got
        lru, shared = self._lru, self._shared
        tables = []
        for b in states:
            if b in lru:
                del lru[b]
            else:
                shared[b] = shared.get(b, 0) + 1
            tables.append([None] * (k - 1) + [b])
        self._tables[req.req_id] = tables
        self._state_cached[req.req_id] = k

    # ---- rules 1-3: a step's allocation -----------------------------------------------------
    def _retire(self, req: Request) -> None:
        """Rule 2 for ``req`` with its computed tokens."""
        tables = self._tables.get(req.req_id)
        c = req.num_computed_tokens
        if not tables or c <= 0:
            return
        upto = (c - 1) // self.block_size
        for table in tables:
            freed = []
            for i in range(min(upto, len(table)) - 1, -1, -1):
                b = table[i]
                if b is not None:
                    freed.append(b)
                    table[i] = None
            if freed:
                self._release(freed)

    def _state_missing(self, req: Request, num_tokens: int) -> int:
        tables = self._tables.get(req.req_id)
        have = len(tables[0]) if tables else 0
        return self.state_blocks if -(-num_tokens // self.block_size) > have else 0

    def can_allocate(self, req: Request, num_tokens: int, *, use_watermark: bool = False) -> bool:
        """As vLLM's ``allocate_slots`` checks a running request: its old states are given back
        first (rule 2), then its attention blocks and a block a linear group (rule 1) must fit."""
        self._retire(req)
        missing = max(0, -(-num_tokens // self.block_size) - len(req.block_ids)) + self._state_missing(req, num_tokens)
        reserve = self.watermark_blocks if use_watermark else 0
        return missing <= self.num_free_blocks - reserve

    def allocate(self, req: Request, num_tokens: int, lookahead: int = 0) -> None:
        if lookahead:
            raise RuntimeError("align-mode state blocks with speculative lookahead are not modelled")
        self._retire(req)
        need = max(0, -(-num_tokens // self.block_size) - len(req.block_ids)) + self._state_missing(req, num_tokens)
        if need > self.num_free_blocks:
            raise RuntimeError(f"KV pool exhausted: request {req.req_id} needs {need} blocks (its states' "
                               f"included), {self.num_free_blocks} free (policy must call can_allocate first)")
        self._grow(req, num_tokens)
        required = -(-num_tokens // self.block_size)
        tables = self._tables.get(req.req_id)
        if tables is None:
            tables = self._tables[req.req_id] = [[] for _ in range(self.state_blocks)]
        for table in tables:
            if required > len(table):
                table.extend([None] * (required - 1 - len(table)))
                self._take(1, table)                    # type: ignore[arg-type]
        known = req.num_prompt_tokens + req.num_output_tokens
        self.cache(req, min(num_tokens, known))

    def cache(self, req: Request, num_tokens: int) -> None:
        """Rule 3 beside the attention group's registration (``PrefixCachePool.cache``)."""
        super().cache(req, num_tokens)
        tables = self._tables.get(req.req_id)
        if not tables:
            return
        size = self.block_size
        full = num_tokens // size
        done = self._state_cached.get(req.req_id, 0)
        # The prompt's last state boundary (get_mamba_prefill_checkpoint_position): while the step's
        # cacheable tokens, cut to whole blocks (HybridKVCacheCoordinator.get_num_cacheable_tokens),
        # end there and the state block there is still held, MambaManager._cache_partial_tail_block
        # registers it again and counts it as cached this step.
        boundary = (req.num_prompt_tokens - 1) // size
        if full and full == boundary and tables[0][full - 1] is not None:
            self._cached_this_step.add(extend_hashes(req, full * size, size)[full - 1])
        if full <= done:
            return
        hashes = extend_hashes(req, full * size, size)
        cached, hash_of = self._cached, self._hash_of
        for g, table in enumerate(tables):
            for i in range(done, min(full, len(table))):
                b = table[i]
                if b is None:
                    continue
                key = (hashes[i], g)
                hash_of[b] = key                         # type: ignore[assignment]
                if key in cached:
                    self._dups.setdefault(key, []).append(b)    # type: ignore[arg-type]
                else:
                    cached[key] = b                      # type: ignore[index]
                if g == 0:
                    self._cached_this_step.add(hashes[i])
        self._state_cached[req.req_id] = full

    # ---- rule 6: frees ----------------------------------------------------------------------
    def _release(self, blocks: list[int]) -> None:
        """vLLM's ``BlockPool.free_blocks`` of ``blocks`` in eviction order: each loses a holder;
        those left with none go to the free queue, unhashed ones to its front (the first
        frontmost), hashed ones to its end."""
        shared, hash_of = self._shared, self._hash_of
        first, last = [], []
        for b in blocks:
            left = shared.get(b)
            if left is None:
                (last if b in hash_of else first).append(b)
            elif left == 1:
                del shared[b]
            else:
                shared[b] = left - 1
        if first:
            self._front.extend(reversed(first))
        for b in last:
            self._lru[b] = None

    def free(self, req: Request) -> None:
        super().free(req)
        self._state_cached.pop(req.req_id, None)
        self._hits.pop(req.req_id, None)
        self._junctions.pop(req.req_id, None)     # a preempted request looks up again first
        for table in self._tables.pop(req.req_id, ()):
            self._release([b for b in reversed(table) if b is not None])

    def free_tail(self, req: Request, num_blocks: int) -> None:
        raise RuntimeError("a KV rewind is not modelled with align-mode state blocks")

    def reserve(self, req: Request, num_tokens: int) -> None:
        raise RuntimeError("a KV transfer's blocks are not modelled with align-mode state blocks")

    def append_block(self, req: Request) -> bool:
        raise RuntimeError("align-mode state blocks grow through allocate only")


def align_state_pool(state_groups: int) -> type[AlignStatePool]:
    """An ``AlignStatePool`` class with ``state_groups`` linear-attention groups."""
    if state_groups < 1:
        raise ValueError(f"state_groups must be >= 1, got {state_groups}")
    return type(f"AlignStatePool{state_groups}", (AlignStatePool,),
                {"__slots__": (), "state_blocks": state_groups})

"""KV blocks with identity: vLLM's automatic prefix caching.

``PrefixCachePool`` is a drop-in for the counting ``sim.core.kv.BlockManager``
(same counts, same ``can_allocate`` / ``allocate`` / ``append_block`` /
``free``) whose blocks also carry the hash of the tokens they hold, as vLLM
0.32's v1 KV manager keeps them (``vllm/v1/core/block_pool.py``,
``kv_cache_manager.py``, ``single_type_kv_cache_manager.py``'s
``FullAttentionManager``, ``kv_cache_utils.py``'s ``FreeKVCacheBlockQueue``),
rule for rule:

- Only full blocks are hashed, each hash chained to its parent block's.
  Generated tokens complete blocks too, and those are cached as well.
- ``lookup`` (vLLM's ``get_computed_blocks``, run by the scheduler only for
  a request with no computed tokens: new or preempted) walks the request's
  block hashes from the first and stops at the first miss. The hit is capped
  at ``num_tokens - 1`` tokens and is block-granular, so a fully cached,
  block-aligned prompt recomputes its whole last block.
- A hit block with no other user (ref count 0) sits in the free queue: it
  counts against the free pool when admission checks its blocks
  (``num_evictable``), and is taken out of the queue when the request takes
  it (``touch``), before any new block is popped.
- New full blocks are registered when the request is *scheduled*
  (``allocate`` caches up to the tokens scheduled, as ``allocate_slots``
  calls ``cache_blocks``), so a later request of the same step can hit them.
- Freeing goes tail-first. A freed block with a hash goes to the end of the
  free queue (evicted last: LRU), one without to its front (reused first).
  A free block keeps its hash until it is popped for reuse, which evicts it.
- Two blocks may hold the same hash (two requests computed the same block
  before either could hit the other's); a lookup takes the first registered,
  and when that one is evicted the next takes its place.

The free queue is vLLM's one doubly linked list, kept here in its three
parts, which never mix: unhashed blocks put at the front (a stack), the
never-used ids in order, and the hashed blocks in LRU order (an
OrderedDict). Pops take the front first, exactly as vLLM's ``popleft_n``.

Content without token ids: a request's ``content`` (``Request.content``) is
``(output_key, key_0, len_0, key_1, len_1, ...)``: its prompt is the runs of
tokens ``(key_i, 0 .. len_i - 1)``, and output token ``j`` is
``(output_key, j)``. Two tokens are equal when their (key, offset) pairs
are. A block's hash chains its parent's with the (key, start, stop) runs it
covers (Python's hash of a tuple of ints: deterministic, 64-bit). A request
without content has a prompt and output no other request shares. The hashes
of a request in flight live on its ``Request`` (``block_hashes``), a list of
ints that goes with it: memory stays bounded by the requests in flight and
the pool, whatever the run's length.

A hybrid model's linear-attention groups (vLLM's ``mamba_cache_mode`` "align")
share this pool in ``sim.core.mamba_align.AlignStatePool``.

Not modelled: sliding-window KV groups, partial-block
hits (vLLM's fine-grained mode), KV connectors and offloading, cache salts,
LoRA and multimodal extra keys.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import TYPE_CHECKING

from sim.core.kv import CachingPool

if TYPE_CHECKING:
    from sim.core.request import Request

# Key spaces for requests that carry no content of their own: their prompt and
# output tokens are theirs alone (request ids are unique within a run).
_OWN_PROMPT = 1 << 62
_OWN_OUTPUT = 3 << 61
_ROOT = 0x5EED          # the parent hash of a request's first block


def own_content(req_id: int, num_prompt_tokens: int) -> tuple[int, ...]:
    """The content of a request that shares nothing: one run of prompt tokens of its own."""
    return (_OWN_OUTPUT + req_id, _OWN_PROMPT + req_id, num_prompt_tokens)


def extend_hashes(req: Request, num_tokens: int, block_size: int) -> list[int]:
    """``req.block_hashes`` (made if missing) extended to the full blocks of its
    first ``num_tokens`` tokens (prompt, then outputs)."""
    hashes = req.block_hashes
    if hashes is None:
        hashes = req.block_hashes = []
    want = num_tokens // block_size
    k = len(hashes)
    if k >= want:
        return hashes
    content = req.content
    if content is None:
        content = req.content = own_content(req.req_id, req.num_prompt_tokens)
    out_key = content[0]
    prompt = req.num_prompt_tokens
    parent = hashes[-1] if hashes else _ROOT
    append = hashes.append
    pos = k * block_size
    # Blocks wholly in the outputs: one run each (the common case: decodes).
    if pos >= prompt:
        off = pos - prompt
        for _ in range(want - k):
            parent = hash((parent, out_key, off, off + block_size))
            append(parent)
            off += block_size
        return hashes
    # Walk the prompt's runs from the one holding ``pos``.
    runs = content
    i, run_start = 1, 0
    while i < len(runs) and run_start + runs[i + 1] <= pos:
        run_start += runs[i + 1]
        i += 2
    while k < want:
        stop = pos + block_size
        if i < len(runs) and pos >= run_start and stop <= run_start + runs[i + 1]:
            # inside one run: the same tuple the general case builds, (parent, key, start, stop)
            key, off = runs[i], pos - run_start
            parent = hash((parent, key, off, off + block_size))
            append(parent)
            if stop == run_start + runs[i + 1]:
                run_start = stop
                i += 2
            pos = stop
            k += 1
            continue
        pieces: list[int] = [parent]
        p = pos
        while p < stop:
            if i < len(runs):
                key, length = runs[i], runs[i + 1]
                if length <= 0:
                    i += 2
                    continue
                take = min(stop, run_start + length)
                pieces += (key, p - run_start, take - run_start)
                if take == run_start + length:
                    run_start += length
                    i += 2
                p = take
            else:                          # past the prompt's runs: the outputs
                off = p - prompt
                pieces += (out_key, off, off + stop - p)
                p = stop
        parent = hash(tuple(pieces))
        append(parent)
        pos = stop
        k += 1
    return hashes


class PrefixCachePool(CachingPool):
    """``num_blocks`` KV blocks of ``block_size`` tokens whose full blocks are
    cached by content (the module doc gives vLLM's rules). ``watermark`` as
    ``BlockManager``'s."""

    __slots__ = ("_front", "_next_fresh", "_lru", "_shared", "_hash_of", "_cached", "_dups")

    def __init__(self, num_blocks: int, block_size: int, watermark: float = 0.0) -> None:
        super().__init__(num_blocks, block_size, watermark)
        self._front: list[int] = []                 # unhashed free blocks; the end is the queue's front
        self._next_fresh = 0                        # never-used ids _next_fresh .. num_blocks - 1 come next
        self._lru: OrderedDict[int, None] = OrderedDict()   # hashed free blocks, evicted first to last
        # Ref counts, kept only where they exceed one: a block in use has one holder unless a hit
        # shared it (block -> holders beyond the first); a hashed block with none is in ``_lru``.
        self._shared: dict[int, int] = {}
        self._hash_of: dict[int, int] = {}         # block -> its hash (cached blocks only)
        self._cached: dict[int, int] = {}          # hash -> the first block registered with it
        self._dups: dict[int, list[int]] = {}      # hash -> the later ones, in order (rare)

    # ---- counts (BlockManager's) -----------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self._front) + self.num_blocks - self._next_fresh + len(self._lru)

    @property
    def num_used_blocks(self) -> int:
        return self._next_fresh - len(self._front) - len(self._lru)

    @property
    def num_cached_free_blocks(self) -> int:
        """Free blocks that still hold a cached prefix (evicted when reused)."""
        return len(self._lru)

    @property
    def num_cached_blocks(self) -> int:
        """Blocks with a hash, in use or free."""
        return len(self._hash_of)

    # ---- the free queue ---------------------------------------------------------------------------
    def _take(self, n: int, ids: list[int]) -> None:
        """Append the ``n`` blocks at the free queue's front to ``ids``, evicting
        their hashes (each then has one holder). The caller checked that ``n`` are free."""
        front = self._front
        if front:
            k = min(n, len(front))
            ids.extend(front[:-k - 1:-1])          # popped from the end, the queue's front
            del front[-k:]
            n -= k
        if n and self._next_fresh < self.num_blocks:
            lo = self._next_fresh
            hi = min(lo + n, self.num_blocks)
            self._next_fresh = hi
            ids.extend(range(lo, hi))
            n -= hi - lo
        if n:
            popitem, hash_of, cached, dups = self._lru.popitem, self._hash_of, self._cached, self._dups
            self.evictions += n
            for _ in range(n):
                b = popitem(False)[0]
                h = hash_of.pop(b)
                if not dups or h not in dups:
                    del cached[h]
                else:
                    self._forget_dup(h, b)
                ids.append(b)

    def _forget_dup(self, h: int, b: int) -> None:
        """Drop block ``b`` of hash ``h``, which has more than one block."""
        later = self._dups[h]
        if self._cached[h] == b:
            self._cached[h] = later.pop(0)
        else:
            later.remove(b)
        if not later:
            del self._dups[h]

    def allocate(self, req: Request, num_tokens: int, lookahead: int = 0) -> None:
        """Grow ``req``'s blocks to hold ``num_tokens`` tokens, plus ``lookahead`` slots for
        speculative drafts, and register the full blocks among the first ``num_tokens`` that
        it knows (vLLM's ``allocate_slots`` then ``cache_blocks``). Raises RuntimeError if the
        pool is short."""
        self._grow(req, num_tokens + lookahead)
        known = req.num_prompt_tokens + req.num_output_tokens
        if (num_tokens if num_tokens < known else known) // self.block_size > req.num_hashed_blocks:
            self.cache(req, min(num_tokens, known))

    def reserve(self, req: Request, num_tokens: int) -> None:
        """Grow ``req``'s blocks to hold ``num_tokens`` tokens, registering none: blocks a KV
        transfer will fill (vLLM's ``allocate_slots`` with ``delay_cache_blocks``; ``cache``
        registers them once the KV is in)."""
        self._grow(req, num_tokens)

    def _grow(self, req: Request, num_tokens: int) -> None:
        missing = -(-num_tokens // self.block_size) - len(req.block_ids)
        if missing > 0:
            if missing > self.num_free_blocks:
                raise RuntimeError(f"KV pool exhausted: request {req.req_id} needs {missing} blocks, "
                                   f"{self.num_free_blocks} free (policy must call can_allocate first)")
            self._take(missing, req.block_ids)

    def append_block(self, req: Request) -> bool:
        if not self.num_free_blocks:
            return False
        self._take(1, req.block_ids)
        return True

    def cache(self, req: Request, num_tokens: int) -> None:
        """Register ``req``'s full blocks among its first ``num_tokens`` tokens
        (vLLM's ``cache_full_blocks``; those already registered are skipped).
        A request's registered blocks are always the first ``num_hashed_blocks``
        of its table (hits, then its own), the rest hold no hash."""
        block_size = self.block_size
        full = min(num_tokens // block_size, len(req.block_ids))
        done = req.num_hashed_blocks
        if done >= full:
            return
        hashes = extend_hashes(req, full * block_size, block_size)
        ids, cached = req.block_ids, self._cached
        new = dict(zip(hashes[done:full], ids[done:full]))
        self._hash_of.update(zip(ids[done:full], hashes[done:full]))
        if len(new) == full - done and cached.keys().isdisjoint(new):
            cached.update(new)                     # the common case: no hash seen before
        else:
            for k in range(done, full):
                b, h = ids[k], hashes[k]
                if h in cached:
                    self._dups.setdefault(h, []).append(b)
                else:
                    cached[h] = b
        req.num_hashed_blocks = full

    def free(self, req: Request) -> None:
        """Give back ``req``'s blocks, tail first (vLLM's ``free_blocks``): its
        unhashed tail to the queue's front (the last block frontmost), its
        hashed blocks no other request holds to the LRU end, last block first."""
        ids, k = req.block_ids, req.num_hashed_blocks
        self._front.extend(ids[k:])               # prepend_n of the tail-first list
        shared = self._shared
        if not shared:
            self._lru.update(dict.fromkeys(ids[k - 1::-1] if k else ()))
        else:
            lru = self._lru
            for b in ids[k - 1::-1] if k else ():
                left = shared.get(b)
                if left is None:
                    lru[b] = None
                elif left == 1:
                    del shared[b]
                else:
                    shared[b] = left - 1
        req.block_ids = []
        req.num_hashed_blocks = 0

    def free_tail(self, req: Request, num_blocks: int) -> None:
        """Give back ``req``'s blocks past its first ``num_blocks`` (a KV rewind: TensorRT-LLM's
        ``rewind_kv_cache`` after rejected drafts) to the free queue's front, the last frontmost.
        They must hold no hash (the caller keeps every registered block)."""
        if num_blocks < req.num_hashed_blocks:
            raise RuntimeError(f"request {req.req_id}: a rewind to {num_blocks} blocks would drop registered ones")
        tail = req.block_ids[num_blocks:]
        if tail:
            self._front.extend(tail)
            del req.block_ids[num_blocks:]

    # ---- lookups ------------------------------------------------------------------------------------
    def _hit(self, req: Request, limit: int) -> list[int]:
        """The cached blocks of ``req``'s first ``limit`` blocks, up to the first miss."""
        if limit <= 0 or not self._cached:
            return []
        hashes = extend_hashes(req, limit * self.block_size, self.block_size)
        get = self._cached.get
        hit = []
        for k in range(limit):
            b = get(hashes[k])
            if b is None:
                break
            hit.append(b)
        return hit

    def lookup(self, req: Request) -> list[int]:
        """The cached blocks of ``req``'s longest cached prefix (vLLM's
        ``find_longest_cache_hit``), at most ``num_tokens - 1`` tokens; changes nothing."""
        return self._hit(req, (req.num_prompt_tokens + req.num_output_tokens - 1) // self.block_size)

    def cached_prefix_blocks(self, req: Request) -> int:
        """How many of ``req``'s leading prompt blocks this pool holds cached (a
        router's view: whole prompt blocks, no ``num_tokens - 1`` cap; changes nothing)."""
        return len(self._hit(req, req.num_prompt_tokens // self.block_size))

    def num_evictable(self, blocks: list[int]) -> int:
        """How many of ``blocks`` (cached ones) no request holds: they sit in the free queue."""
        lru = self._lru
        return sum(1 for b in blocks if b in lru)

    def touch(self, req: Request, blocks: list[int]) -> None:
        """``req`` (holding no blocks) takes the hit ``blocks`` as its first ones."""
        lru, shared = self._lru, self._shared
        for b in blocks:
            if b in lru:
                del lru[b]
            else:
                shared[b] = shared.get(b, 0) + 1
        req.block_ids = list(blocks)
        req.num_hashed_blocks = len(blocks)

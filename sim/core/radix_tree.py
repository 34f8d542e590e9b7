"""The tree of SGLang's radix prefix cache, over token runs (``sim.core.radix`` gives the
rules and the pool built on it): ``RadixTree``, its ``Node`` and ``token_runs``.
SGLang 0.5.23, ``sglang/srt/mem_cache/radix_cache.py`` and ``evict_policy.py`` (LRU).
"""

from __future__ import annotations

from heapq import heapify, heappop, heappush
from typing import TYPE_CHECKING

from sim.core.prefix import own_content

if TYPE_CHECKING:
    from sim.core.request import Request

Runs = list  # [(key, start, stop), ...]: tokens (key, start) .. (key, stop - 1), in order


def token_runs(req: Request, num_tokens: int) -> Runs:
    """The runs of ``req``'s first ``num_tokens`` tokens: its prompt's segments, then its outputs."""
    content = req.content
    if content is None:
        content = req.content = own_content(req.req_id, req.num_prompt_tokens)
    runs: Runs = []
    left = min(num_tokens, req.num_prompt_tokens)
    for i in range(1, len(content), 2):
        n = min(content[i + 1], left)
        if n > 0:
            runs.append((content[i], 0, n))
            left -= n
    if left > 0:                  # content shorter than the prompt: the rest is the request's own
        own = own_content(req.req_id, req.num_prompt_tokens)[1]
        runs.append((own, req.num_prompt_tokens - left, req.num_prompt_tokens))
    if num_tokens > req.num_prompt_tokens:
        runs.append((content[0], 0, num_tokens - req.num_prompt_tokens))
    return runs


def _advance(q: Runs, i: int, o: int, n: int) -> tuple[int, int]:
    """The cursor (run i, offset o in it) moved on by n tokens."""
    while n:
        step = min(n, q[i][2] - q[i][1] - o)
        n -= step
        o += step
        if q[i][1] + o == q[i][2]:
            i, o = i + 1, 0
    return i, o


def _common(edge: tuple, q: Runs, i: int, o: int) -> int:
    """How many of ``edge``'s tokens equal ``q``'s from the cursor (i, o) on."""
    n = 0
    for k, s, e in edge:
        while s < e:
            if i == len(q):
                return n
            qk, qs, qe = q[i]
            if qk != k or qs + o != s:
                return n
            take = min(e - s, qe - qs - o)
            n += take
            s += take
            o += take
            if qs + o == qe:
                i, o = i + 1, 0
    return n


def _page_key(q: Runs, i: int, o: int, page: int) -> tuple:
    """The child key of the sequence at the cursor: its first token, or its first page's runs."""
    k, s, e = q[i]
    if page == 1:
        return k, s + o
    out = []
    while page and i < len(q):
        k, s, e = q[i]
        take = min(page, e - s - o)
        out.append((k, s + o, s + o + take))
        page -= take
        i, o = i + 1, 0
    return tuple(out)


def _split_runs(runs: tuple, n: int) -> tuple[tuple, tuple]:
    """``runs`` cut after n tokens (0 < n < their length)."""
    for idx, (k, s, e) in enumerate(runs):
        if n < e - s:
            head = runs[:idx] + (((k, s, s + n),) if n else ())
            return head, ((k, s + n, e),) + runs[idx + 1:]
        n -= e - s
    raise AssertionError("split past the edge's end")


class Node:
    __slots__ = ("parent", "children", "runs", "length", "lock_ref", "access", "nid")

    def __init__(self, parent: Node | None, runs: tuple, length: int, access: int, nid: int) -> None:
        self.parent = parent
        self.children: dict[tuple, Node] = {}
        self.runs = runs
        self.length = length
        self.lock_ref = 0
        self.access = access
        self.nid = nid


class RadixTree:
    """The tree of SGLang's ``RadixCache`` (the module doc gives its rules), in tokens."""

    def __init__(self, page_size: int = 1) -> None:
        self.page_size = page_size
        self.clock = 0
        self.num_nodes = 0                         # nodes in the tree, the root aside
        self._last_id = 0
        self.root = Node(None, (), 0, 0, 0)
        self.root.lock_ref = 1                     # never evicted, as SGLang's
        self.total_tokens = 0
        self.evictable_tokens = 0                  # tokens of unlocked nodes (SGLang's evictable_size_)
        self._heap: list[tuple[int, int, Node]] = []   # (access, nid, leaf), stale entries skipped

    # ---- the walk shared by match and insert -------------------------------------------------------
    def _walk(self, q: Runs, touch: bool, split: bool) -> tuple[int, Node, int, int]:
        """Follow ``q`` from the root: (tokens matched, last node, cursor run, cursor offset)."""
        page, node, i, o, total = self.page_size, self.root, 0, 0, 0
        if touch:
            self.clock += 1
            node.access = self.clock
        while i < len(q):
            child = node.children.get(_page_key(q, i, o, page))
            if child is None:
                break
            if touch:
                child.access = self.clock
            n = _common(child.runs, q, i, o) // page * page
            total += n
            i, o = _advance(q, i, o, n)
            if n < child.length:
                if split:
                    node = self._split(child, n)
                    self._touched(child)
                break
            node = child
        return total, node, i, o

    def _split(self, child: Node, n: int) -> Node:
        head, tail = _split_runs(child.runs, n)
        self.num_nodes += 1
        self._last_id += 1
        new = Node(child.parent, head, n, self.clock, self._last_id)
        new.lock_ref = child.lock_ref
        new.parent.children[_page_key(list(head), 0, 0, self.page_size)] = new
        child.parent, child.runs, child.length = new, tail, child.length - n
        new.children[_page_key(list(tail), 0, 0, self.page_size)] = child
        return new

    def _touched(self, node: Node) -> None:
        """Queue ``node`` for eviction if it is an unlocked leaf (with its current stamp). Entries
        go stale when a node is stamped again, locked or given a child; once they outnumber the
        nodes twice over they are dropped, so the queue stays within the tree's size."""
        if not node.lock_ref and not node.children and node.parent is not None:
            heap = self._heap
            heappush(heap, (node.access, node.nid, node))
            if len(heap) > 2 * self.num_nodes + 64:
                self._heap = heap = [e for e in heap if self._valid(e)]
                heapify(heap)

    # ---- SGLang's RadixCache API -------------------------------------------------------------------
    def match(self, q: Runs) -> tuple[int, Node]:
        """(cached tokens of ``q``'s longest prefix, its last node): ``match_prefix``."""
        if not q:
            return 0, self.root
        total, node, _, _ = self._walk(q, True, True)
        self._touched(node)
        return total, node

    def peek(self, q: Runs) -> int:
        """Cached tokens of ``q``'s longest prefix, changing nothing (no stamp, no split)."""
        return self._walk(q, False, False)[0] if q else 0

    def insert(self, q: Runs) -> tuple[int, Node]:
        """Insert ``q`` (page-aligned): (tokens it found cached, its last node)."""
        total, node, i, o = self._walk(q, True, True)
        if i < len(q):
            rest = [(q[i][0], q[i][1] + o, q[i][2])] + q[i + 1:]
            length = sum(e - s for _, s, e in rest)
            self.num_nodes += 1
            self._last_id += 1
            leaf = Node(node, tuple(rest), length, self.clock, self._last_id)
            node.children[_page_key(rest, 0, 0, self.page_size)] = leaf
            self.total_tokens += length
            self.evictable_tokens += length
            node = leaf
        self._touched(node)
        return total, node

    def lock(self, node: Node) -> None:
        while node is not self.root:
            if not node.lock_ref:
                self.evictable_tokens -= node.length
            node.lock_ref += 1
            node = node.parent

    def unlock(self, node: Node) -> None:
        while node is not self.root:
            node.lock_ref -= 1
            if not node.lock_ref:
                self.evictable_tokens += node.length
                self._touched(node)
            node = node.parent

    def evict(self, num_tokens: int) -> int:
        """Evict unlocked leaves, least recently used first, until ``num_tokens`` are freed or none is left;
        the tokens freed (whole nodes)."""
        freed = 0
        while freed < num_tokens and self._heap:      # (_touched may rebuild the queue)
            entry = heappop(self._heap)
            if not self._valid(entry):
                continue
            node = entry[2]
            parent = node.parent
            del parent.children[_page_key(list(node.runs), 0, 0, self.page_size)]
            node.parent = None
            self.num_nodes -= 1
            freed += node.length
            self.total_tokens -= node.length
            self.evictable_tokens -= node.length
            self._touched(parent)
        return freed

    @staticmethod
    def _valid(entry: tuple[int, int, Node]) -> bool:
        node = entry[2]
        return node.parent is not None and not node.lock_ref and not node.children and node.access == entry[0]

"""RadixCache: prefix sharing of KV slots between requests (sglang-facts.md §5).

Where it sits: the scheduler asks `match_prefix(fill_ids[:len-1])` when it considers a
waiting request, locks the matched node while the request runs, hands computed KV to
the tree with `cache_unfinished_req` (after each chunk / after prefill) and
`cache_finished_req` (on finish or retraction), and calls `evict_if_needed` before it
allocates. In: token ids and the KV slots a request wrote. Out: the KV slots of the
longest cached prefix. Owns: the tree of TreeNodes, i.e. which KV slots are cached, and
the evictable/protected token counts. It never frees a request's req_to_token row (the
scheduler does) and never touches the K/V tensors themselves.

Each node holds a segment of token ids (`key`) and the KV slots that hold their K/V
(`value`, int64, same length). A path from the root spells a token prefix. With
page_size P > 1 keys are whole pages: children are keyed by their first page (a tuple of
P ids) and matching compares whole pages, because the allocator frees page by page.

Namespaces (SGLang's RadixKey.extra_key): a request's `extra_key` (its LoRA adapter name and
its own cache key folded into one string by mem_cache/namespace.py; None for the base model
without a key) is part of every child key, `(extra_key, plain key)`, and every node keeps
the extra_key it was inserted under. The same tokens under two adapters are then two paths
that never meet: K/V computed with one adapter is never reused with another (it differs from
the first adapted layer on), and under the same adapter it is shared as usual. Two cache keys
(tenants' cache salts) are kept apart the same way, though their K/V would be equal: a tenant
must not reuse, nor learn from its time to first token, another tenant's prompt.

Accounting (the numbers the visualizer shows):
    evictable_size_ = tokens in nodes with lock_ref == 0   (free-able by evict)
    protected_size_ = tokens in nodes with lock_ref > 0    (a running request uses them)
    invariant, when no request is running:
        allocator.available_size() + evictable_size_ + protected_size_ == total KV tokens

Eviction order (`--radix-eviction-policy`, SGLang's, evict_policy.py there): lru (the least
recently used leaf first, the default), mru, lfu (the leaf the fewest admitted requests reused,
then lru: `record_hit`), fifo (the oldest first), filo, or priority (the leaf the least important
request reached first, then lru: a node keeps the highest importance of the requests that
inserted through it). Times are a logical clock (a counter bumped on every
match/insert), not wall time: the order is exact, ties are impossible and tests are
deterministic. SGLang stores time.monotonic() in the same fields.
"""

from __future__ import annotations

import heapq
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Protocol, Tuple, Union

import torch

from minisgl.mem_cache.allocator import TokenToKVPoolAllocator
from minisgl.mem_cache.memory_pool import ReqToTokenPool
from minisgl.mem_cache.namespace import key_tag, split_namespace

ChildKey = Union[int, Tuple[int, ...], Tuple[str, Union[int, Tuple[int, ...]]]]

# --radix-eviction-policy: each policy's sort key of an evictable leaf, the smallest evicted first
EVICTION_KEYS: Dict[str, Callable[["TreeNode"], Tuple[float, ...]]] = {
    "lru": lambda n: (n.last_access_time,),
    "mru": lambda n: (-n.last_access_time,),
    "lfu": lambda n: (n.hit_count, n.last_access_time),
    "fifo": lambda n: (n.creation_time,),
    "filo": lambda n: (-n.creation_time,),
    "priority": lambda n: (n.importance, n.last_access_time),
}


class CacheReq(Protocol):
    """The fields of a scheduler `Req` that the cache reads and writes."""

    origin_input_ids: List[int]
    output_ids: List[int]
    fill_ids: List[int]  # the tokens whose K/V the request row holds after this pass
    req_pool_idx: int
    prefix_indices: torch.Tensor  # [prefix_len] int64 KV slots
    last_node: Any  # TreeNode the request has locked, None when it holds no lock
    extra_key: Optional[str]  # the namespace of its tokens (its LoRA adapter; None: the base model)
    cache_protected_len: int  # row[:cache_protected_len] are tree-owned slots
    kv_committed_len: int  # positions of the row whose K/V were written


class TreeNode:
    """One segment of a cached prefix. `value is` never None here: evicted nodes are deleted."""

    def __init__(
        self, node_id: int, key: List[int], value: torch.Tensor, parent: Optional["TreeNode"], extra_key: Optional[str] = None
    ) -> None:
        self.id = node_id
        self.key = key  # token ids of this segment
        self.extra_key = extra_key  # the namespace it was inserted under (every node of a path shares it)
        self.value = value  # [len(key)] int64 KV slots
        self.parent = parent
        self.children: Dict[ChildKey, TreeNode] = {}
        self.lock_ref = 0  # running requests whose prefix passes through this node
        self.last_access_time = 0  # logical clock tick of the last match/insert through it
        self.creation_time = 0  # logical clock tick of its insert (a split-off part keeps it)
        # --radix-eviction-policy priority: the highest importance of the requests that inserted
        # through it (RadixCache.importance; 0 for all without priority scheduling)
        self.importance = 0.0
        # --radix-eviction-policy lfu: admitted requests that reused its tokens (RadixCache.record_hit)
        self.hit_count = 0

    def __repr__(self) -> str:
        return f"TreeNode(id={self.id}, len={len(self.key)}, lock_ref={self.lock_ref})"


class MatchResult(NamedTuple):
    device_indices: torch.Tensor  # [prefix_len] int64 KV slots of the matched prefix
    last_device_node: TreeNode  # the deepest matched node (the one to lock)


class RadixCache:
    def __init__(
        self,
        req_to_token_pool: ReqToTokenPool,
        token_to_kv_pool_allocator: TokenToKVPoolAllocator,
        page_size: int,
        disable: bool = False,
        eviction_policy: str = "lru",
        priority_order: Optional[int] = None,
    ) -> None:
        """`priority_order`: the scheduler's (+1 when lower priority values are more important, -1
        when higher ones are, None without priority scheduling), for the priority policy."""
        assert page_size == token_to_kv_pool_allocator.page_size, "cache and allocator page sizes differ"
        if eviction_policy not in EVICTION_KEYS:
            raise ValueError(f"eviction_policy must be one of {', '.join(EVICTION_KEYS)}, got {eviction_policy!r}")
        self.req_to_token_pool = req_to_token_pool
        self.token_to_kv_pool_allocator = token_to_kv_pool_allocator
        self.page_size = page_size
        self.disable = disable
        self.eviction_policy = eviction_policy
        self._eviction_key = EVICTION_KEYS[eviction_policy]
        self.priority_order = priority_order
        self.device = token_to_kv_pool_allocator.device
        self.reset()

    # ------------------------------------------------------------------ basics
    def reset(self) -> None:
        """Forget the whole tree. The caller clears the allocator and request pool too
        (flush_cache); the slots the tree held are not freed one by one here."""
        self._next_id = 0
        self._clock = 0
        self.root_node = self._new_node([], self._empty(), parent=None)
        self.root_node.lock_ref = 1  # the root is never evictable
        self.evictable_size_ = 0
        self.protected_size_ = 0

    def _empty(self) -> torch.Tensor:
        return torch.empty(0, dtype=torch.int64, device=self.device)

    def _new_node(
        self, key: List[int], value: torch.Tensor, parent: Optional[TreeNode], extra_key: Optional[str] = None
    ) -> TreeNode:
        node = TreeNode(self._next_id, key, value, parent, extra_key)
        self._next_id += 1
        return node

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    def _child_key(self, key: List[int], extra_key: Optional[str] = None) -> ChildKey:
        plain = key[0] if self.page_size == 1 else tuple(key[: self.page_size])
        return plain if extra_key is None else (extra_key, plain)

    def _node_child_key(self, node: TreeNode) -> ChildKey:
        """The key under which `node` sits in its parent's children."""
        return self._child_key(node.key, node.extra_key)

    def _key_match(self, key0: List[int], key1: List[int]) -> int:
        """Length of the common prefix; with pages, only whole equal pages count."""
        n = min(len(key0), len(key1))
        i = 0
        if self.page_size == 1:
            while i < n and key0[i] == key1[i]:
                i += 1
            return i
        P = self.page_size
        while i + P <= n and key0[i : i + P] == key1[i : i + P]:
            i += P
        return i

    def evictable_size(self) -> int:
        return self.evictable_size_

    def protected_size(self) -> int:
        return self.protected_size_

    def total_size(self) -> int:
        """Tokens held by the tree, counted by walking it (tests compare it with the kept counters)."""
        return sum(len(node.value) for node in self._all_nodes())

    def _all_nodes(self) -> List[TreeNode]:
        nodes, stack = [], [self.root_node]
        while stack:
            node = stack.pop()
            nodes.append(node)
            stack.extend(node.children.values())
        return nodes

    # ------------------------------------------------------------------ match / insert
    def match_prefix(self, key: List[int], extra_key: Optional[str] = None) -> MatchResult:
        """KV slots of the longest cached prefix of `key` in the namespace `extra_key`, whole pages only.

        Callers cap the key at len(fill_ids) - 1 (Req.init_next_round_input does) so that
        at least one token is recomputed to produce the next-token logits. Mutates the
        tree (splits a node when the match ends inside it, bumps access times) but never
        locks: lock `last_device_node` with inc_lock_ref to keep the prefix alive.
        """
        if self.disable or len(key) < self.page_size:
            return MatchResult(self._empty(), self.root_node)
        key = list(key[: len(key) // self.page_size * self.page_size])
        now = self._tick()
        node = self.root_node
        node.last_access_time = now
        values: List[torch.Tensor] = []
        while key and self._child_key(key, extra_key) in node.children:
            child = node.children[self._child_key(key, extra_key)]
            child.last_access_time = now
            prefix_len = self._key_match(child.key, key)
            if prefix_len < len(child.key):
                node = self._split_node(child, prefix_len)
                values.append(node.value)
                break
            values.append(child.value)
            node = child
            key = key[prefix_len:]
        device_indices = torch.cat(values) if values else self._empty()  # [prefix_len]
        return MatchResult(device_indices, node)

    def _split_node(self, child: TreeNode, split_len: int) -> TreeNode:
        """Cut `child` at split_len; the new upper node inherits lock_ref, so the
        evictable/protected sizes do not change. Returns the upper node."""
        parent = child.parent
        assert parent is not None and 0 < split_len < len(child.key)
        new_node = self._new_node(child.key[:split_len], child.value[:split_len], parent, child.extra_key)
        new_node.lock_ref = child.lock_ref
        new_node.last_access_time = child.last_access_time
        new_node.creation_time = child.creation_time  # (its tokens are as old as the child's)
        new_node.importance = child.importance
        new_node.hit_count = child.hit_count  # (every hit on the child reused these tokens too)
        child.key = child.key[split_len:]
        child.value = child.value[split_len:]
        child.parent = new_node
        new_node.children[self._node_child_key(child)] = child
        parent.children[self._node_child_key(new_node)] = new_node
        return new_node

    def record_hit(self, node: TreeNode) -> None:
        """An admitted request reuses the prefix ending at `node`: count a hit on every node of the
        path (the lfu policy). Called once per admission (PrefillAdder), not from match_prefix,
        which runs each time the scheduler merely considers a waiting request."""
        while node is not self.root_node:
            node.hit_count += 1
            node = node.parent

    def importance(self, req: Any) -> float:
        """How important a request's tokens are to keep (the priority policy): its priority, made
        "higher is more important" by the scheduler's order; 0 without priority scheduling."""
        priority = getattr(req, "priority", None)  # (getattr: tests drive the cache with stand-in requests)
        return 0.0 if self.priority_order is None or priority is None else float(-self.priority_order * priority)

    def insert(self, key: List[int], value: torch.Tensor, importance: float = 0.0, extra_key: Optional[str] = None) -> int:
        """Add key -> value (KV slots); returns how many leading tokens were already in the
        tree. Of value[:returned], the caller frees only the slots it allocated itself,
        [req.cache_protected_len, returned): value[:cache_protected_len] are the tree's own
        slots, which the request matched earlier. `key` must be whole pages. Every node on the
        path keeps the highest `importance` that reached it (SGLang's max). `extra_key`: the namespace."""
        if self.disable:
            return 0
        assert len(key) == len(value), f"insert: {len(key)} tokens but {len(value)} KV slots"
        assert len(key) % self.page_size == 0, "insert takes whole pages; page-align the key first"
        key = list(key)
        now = self._tick()
        node = self.root_node
        node.last_access_time = now
        total_prefix_len = 0
        while key and self._child_key(key, extra_key) in node.children:
            node = node.children[self._child_key(key, extra_key)]
            node.last_access_time = now
            prefix_len = self._key_match(node.key, key)
            total_prefix_len += prefix_len
            key, value = key[prefix_len:], value[prefix_len:]
            if prefix_len < len(node.key):
                # the rest of `key` differs from the rest of node: it becomes a sibling
                node = self._split_node(node, prefix_len)
            node.importance = max(node.importance, importance)
        if key:
            leaf = self._new_node(key, value.clone(), node, extra_key)
            leaf.last_access_time = leaf.creation_time = now
            leaf.importance = importance
            node.children[self._child_key(key, extra_key)] = leaf
            self.evictable_size_ += len(key)
        return total_prefix_len

    # ------------------------------------------------------------------ requests
    def cache_finished_req(self, req: CacheReq, is_insert: bool = True) -> None:
        """Give a finished (or, with is_insert=False, retracted) request's KV to the tree.

        Row positions [0, kv_committed_len) hold K/V. The page-aligned part is inserted;
        this request's copies of tokens another request cached meanwhile
        ([cache_protected_len, new_prefix_len)) are freed, as is the unaligned tail. Then
        the request's lock is released and `req.last_node` set to None, so a second
        release (abort racing finish) raises instead of double-freeing.
        The scheduler frees the req_to_token row afterwards.
        """
        assert req.last_node is not None, "cache_finished_req: request already released (double free)"
        committed = req.kv_committed_len
        kv_indices = self.req_to_token_pool.req_to_token[req.req_pool_idx, :committed].clone()  # [committed]
        allocator = self.token_to_kv_pool_allocator
        if self.disable:
            allocator.free(kv_indices)
            req.last_node = None
            return
        token_ids = (list(req.origin_input_ids) + list(req.output_ids))[:committed]
        assert len(token_ids) == committed, "kv_committed_len exceeds origin_input_ids + output_ids"
        aligned_len = committed // self.page_size * self.page_size
        if is_insert:
            new_prefix_len = self.insert(
                token_ids[:aligned_len], kv_indices[:aligned_len], self.importance(req), _extra_key(req)
            )
            # [0, cache_protected_len) were tree slots already; the rest up to
            # new_prefix_len are this request's duplicates of tree slots
            allocator.free(kv_indices[req.cache_protected_len : new_prefix_len])
        else:
            allocator.free(kv_indices[req.cache_protected_len : aligned_len])
        # the unaligned tail never enters the tree (its page is this request's alone)
        allocator.free(kv_indices[aligned_len:])
        self.dec_lock_ref(req.last_node)
        req.last_node = None

    def cache_unfinished_req(self, req: CacheReq, chunked: bool = False) -> None:
        """Insert what a still-running request has computed (req.fill_ids) so others can
        share it now, and make the request use the tree's copies.

        After it: req_to_token[row, :aligned] are tree slots, the lock sits on the node
        of the last full page, req.prefix_indices covers all of fill_ids (tree slots plus
        the request's own partial page) and cache_protected_len = aligned length.
        `chunked=True` says fill_ids ends at a chunk boundary inside the input; this is
        asserted, because a chunk that reaches the end is a finished prefill.
        """
        n = len(req.fill_ids)
        if chunked:
            assert n < len(req.origin_input_ids) + len(req.output_ids), "chunked=True but fill_ids is complete"
        row = req.req_pool_idx
        kv_indices = self.req_to_token_pool.req_to_token[row, :n].clone()  # [n]
        if self.disable:
            # ChunkCache semantics: nothing is shared, the next chunk extends the row
            req.prefix_indices = kv_indices
            return
        aligned_len = n // self.page_size * self.page_size
        keys = list(req.fill_ids[:aligned_len])
        new_prefix_len = self.insert(keys, kv_indices[:aligned_len], self.importance(req), _extra_key(req))
        self.token_to_kv_pool_allocator.free(kv_indices[req.cache_protected_len : new_prefix_len])

        new_indices, new_last_node = self.match_prefix(keys, _extra_key(req))  # [aligned_len]
        assert len(new_indices) == aligned_len, "re-match after insert must find every inserted page"
        # the row must point at the tree's slots: ours in [cache_protected_len, new_prefix_len) were just freed
        start = req.cache_protected_len
        self.req_to_token_pool.req_to_token[row, start:aligned_len] = new_indices[start:]

        # take the new lock before dropping the old so the shared path is never unlocked
        self.inc_lock_ref(new_last_node)
        self.dec_lock_ref(req.last_node)
        req.prefix_indices = torch.cat((new_indices, kv_indices[aligned_len:]))  # [n]
        req.last_node = new_last_node
        req.cache_protected_len = aligned_len

    # ------------------------------------------------------------------ locks
    def inc_lock_ref(self, node: TreeNode) -> int:
        """Protect the path root..node from eviction. Returns the change in evictable size."""
        if self.disable:
            return 0
        delta = 0
        while node is not self.root_node:
            if node.lock_ref == 0:
                self.evictable_size_ -= len(node.key)
                self.protected_size_ += len(node.key)
                delta -= len(node.key)
            node.lock_ref += 1
            node = node.parent
        return delta

    def dec_lock_ref(self, node: TreeNode) -> int:
        """Undo one inc_lock_ref(node). Returns the change in evictable size."""
        if self.disable:
            return 0
        delta = 0
        while node is not self.root_node:
            assert node.lock_ref > 0, f"dec_lock_ref below zero on node {node.id}"
            if node.lock_ref == 1:
                self.evictable_size_ += len(node.key)
                self.protected_size_ -= len(node.key)
                delta += len(node.key)
            node.lock_ref -= 1
            node = node.parent
        return delta

    # ------------------------------------------------------------------ eviction
    def evict(self, num_tokens: int) -> int:
        """Free at least num_tokens cached tokens (or all that are evictable), unlocked leaves
        in the eviction policy's order (lru: the least recently used first); a parent left
        childless and unlocked becomes a candidate in turn. Whole leaves go, so it may free
        more. Returns tokens freed."""
        if self.disable or num_tokens <= 0:
            return 0
        # (node.id breaks ties and keeps the heap from ever comparing two nodes)
        heap = [(self._eviction_key(n), n.id, n) for n in self._all_nodes() if not n.children and n.lock_ref == 0]
        heapq.heapify(heap)
        num_evicted = 0
        while num_evicted < num_tokens and heap:
            _, _, node = heapq.heappop(heap)
            self.token_to_kv_pool_allocator.free(node.value)
            num_evicted += len(node.value)
            parent = self._delete_leaf(node)
            if parent is not self.root_node and not parent.children and parent.lock_ref == 0:
                heapq.heappush(heap, (self._eviction_key(parent), parent.id, parent))
        return num_evicted

    def _delete_leaf(self, node: TreeNode) -> TreeNode:
        parent = node.parent
        assert parent is not None and not node.children and node.lock_ref == 0
        del parent.children[self._node_child_key(node)]
        self.evictable_size_ -= len(node.key)
        return parent

    def evict_if_needed(self, num_tokens: int) -> int:
        """Before allocating num_tokens: evict only if the allocator is short. Like
        SGLang's alloc_token_slots it then evicts num_tokens (not the shortfall), so the
        next allocations of this step find room too. Returns tokens freed."""
        if self.token_to_kv_pool_allocator.available_size() >= num_tokens:
            return 0
        return self.evict(num_tokens)

    # ------------------------------------------------------------------ inspection
    def check_integrity(self, available_size: Optional[int] = None, total: Optional[int] = None) -> None:
        """Walk the tree and raise AssertionError naming the first broken invariant.

        `total` (KV tokens of the pool) enables the conservation check
        available + evictable + protected == total. `available_size` defaults to
        allocator.available_size(); while requests run, pass that plus the tokens they
        hold outside the tree (their own pages), else the check cannot balance.
        """
        assert self.root_node.lock_ref == 1, f"root lock_ref is {self.root_node.lock_ref}, must stay 1"
        evictable, protected = self._check_nodes()
        assert evictable == self.evictable_size_, (
            f"evictable_size_ is {self.evictable_size_} but unlocked nodes hold {evictable} tokens"
        )
        assert protected == self.protected_size_, (
            f"protected_size_ is {self.protected_size_} but locked nodes hold {protected} tokens"
        )
        allocator = self.token_to_kv_pool_allocator
        allocator.check_free_list()
        slots = [n.value for n in self._all_nodes() if len(n.value) > 0]
        if slots:
            all_slots = torch.cat(slots)  # [tree tokens]
            unique = torch.unique(all_slots)
            assert len(unique) == len(all_slots), (
                f"{len(all_slots) - len(unique)} KV slots appear twice in the tree"
            )
            assert int(all_slots.min()) >= self.page_size, "the tree holds a slot of reserved page 0"
            in_free = allocator.is_free(all_slots)
            assert not bool(in_free.any()), (
                f"tree slots {all_slots[in_free][:8].tolist()} are in the allocator's free list (use after free)"
            )
        if total is not None:
            available = allocator.available_size() if available_size is None else available_size
            assert available + self.evictable_size_ + self.protected_size_ == total, (
                f"memory leak or double free: available {available} + evictable {self.evictable_size_}"
                f" + protected {self.protected_size_} != total {total}"
            )

    def _check_nodes(self) -> Tuple[int, int]:
        """Per-node checks; returns (tokens in unlocked nodes, tokens in locked nodes)."""
        evictable = protected = 0
        for node in self._all_nodes():
            if node is self.root_node:
                continue
            parent = node.parent
            assert parent is not None and parent.children.get(self._node_child_key(node)) is node, (
                f"node {node.id} is not reachable from its parent under its first token/page"
            )
            assert parent is self.root_node or parent.extra_key == node.extra_key, (
                f"node {node.id} (namespace{_namespace_text(node.extra_key) or ' none'}) hangs under node {parent.id} "
                f"(namespace{_namespace_text(parent.extra_key) or ' none'})"  # (a tag, never a tenant's key)
            )
            assert len(node.key) > 0, f"node {node.id} has an empty key"
            assert len(node.value) == len(node.key), (
                f"node {node.id}: {len(node.key)} tokens but {len(node.value)} KV slots"
            )
            assert len(node.key) % self.page_size == 0, f"node {node.id} is not whole pages"
            assert node.lock_ref >= 0, f"node {node.id} has negative lock_ref {node.lock_ref}"
            if parent is not self.root_node:
                assert parent.lock_ref >= node.lock_ref, (
                    f"node {node.id} lock_ref {node.lock_ref} > parent {parent.id} lock_ref {parent.lock_ref}"
                )
            if node.lock_ref > 0:
                protected += len(node.key)
            else:
                evictable += len(node.key)
        return evictable, protected

    def summary(self, max_nodes: int = 64) -> Dict[str, Any]:
        """JSON-ready view for Scheduler.snapshot()["radix"] (docs/snapshot.md); the tree
        is cut breadth-first after max_nodes nodes, children ordered by first token/page
        (a stable layout: splitting a node does not reorder its siblings)."""
        num_nodes = len(self._all_nodes())
        root_dict = self._node_dict(self.root_node)
        queue = [(self.root_node, root_dict)]
        shown = 1
        while queue and shown < max_nodes:
            node, node_dict = queue.pop(0)
            for child in self._sorted_children(node):
                if shown >= max_nodes:
                    break
                child_dict = self._node_dict(child)
                node_dict["children"].append(child_dict)
                queue.append((child, child_dict))
                shown += 1
        return {
            "num_nodes": num_nodes,
            "total_tokens": self.evictable_size_ + self.protected_size_,
            "evictable": self.evictable_size_,
            "protected": self.protected_size_,
            "tree": root_dict,
        }

    @staticmethod
    def _sorted_children(node: TreeNode) -> List[TreeNode]:
        # the base model's unkeyed children first, then each other namespace's (by its extra_key string); within one by first token/page
        return sorted(node.children.values(), key=lambda c: (c.extra_key is not None, c.extra_key or "", c.key))

    @staticmethod
    def _node_dict(node: TreeNode) -> Dict[str, Any]:
        return {
            "id": node.id,
            "len": len(node.key),
            "lock_ref": node.lock_ref,
            "hits": node.hit_count,
            "tokens_preview": list(node.key[:8]),
            # its namespace: the adapter, and the request key as a tag (the key itself is not shown)
            "lora_id": split_namespace(node.extra_key)[0],
            "cache_key": key_tag(split_namespace(node.extra_key)[1]),
            "children": [],
        }

    def pretty_print(self) -> None:
        """Print the tree, one node per line, indented by depth (for notebooks)."""
        print(self.format_tree())

    def format_tree(self) -> str:
        lines = [
            f"RadixCache(page_size={self.page_size}, evictable={self.evictable_size_},"
            f" protected={self.protected_size_}{', disabled' if self.disable else ''})"
        ]
        stack = [(child, 1) for child in reversed(self._sorted_children(self.root_node))]
        while stack:
            node, depth = stack.pop()
            preview = node.key[:8] + (["..."] if len(node.key) > 8 else [])
            lines.append(
                f"{'  ' * depth}[{node.id}]{_namespace_text(node.extra_key)}"
                f" len={len(node.key)} lock_ref={node.lock_ref} hits={node.hit_count}"
                f" tokens={preview} slots={node.value[:4].tolist()}{'...' if len(node.value) > 4 else ''}"
            )
            stack.extend((c, depth + 1) for c in reversed(self._sorted_children(node)))
        return "\n".join(lines)


def _namespace_text(extra_key: Optional[str]) -> str:
    """A node's namespace in format_tree: " lora=NAME", " key=TAG" (the key's tag, not the key), both or ""."""
    lora_id, cache_key = split_namespace(extra_key)
    return ("" if lora_id is None else f" lora={lora_id}") + ("" if cache_key is None else f" key={key_tag(cache_key)}")


def _extra_key(req: CacheReq) -> Optional[str]:
    """A request's namespace (getattr: tests drive the cache with stand-in requests that have none)."""
    return getattr(req, "extra_key", None)

"""Token-to-KV allocators: which KV slots are free (sglang-facts.md §4.2-4.3).

Where it sits: the ScheduleBatch asks the allocator for KV slots when it prepares an
extend (`alloc_extend`) or a decode (`alloc_decode`); the RadixCache and finished
requests give slots back (`free`). The allocator owns only the free list; the K/V
tensors live in MHATokenToKVPool and the per-request slot rows in ReqToTokenPool.

Slot 0 is the padding slot: never handed out, so slot ids run 1..size; padded reads
(the torch backend's [batch, max_len] gather) point there and nothing writes to it.
With page_size P > 1 the allocator hands out whole pages: page p owns slots
p*P .. p*P+P-1, pages run 1..num_pages, and freeing any slot frees its page.

Invariant: available_size() + (slots held by requests and the tree) == size.
"""

from __future__ import annotations

from typing import List, Optional

import torch


# The page arithmetic, in one place: the scheduler sizes evictions and budgets with the same
# functions the allocator hands out slots by, so the two cannot disagree on what a step takes.
def ceil_paged_tokens(tokens: int, page_size: int) -> int:
    """`tokens` rounded up to whole pages."""
    return -(-tokens // page_size) * page_size


def new_page_slots(prefix_len: int, seq_len: int, page_size: int) -> int:
    """Slots an extend from prefix_len to seq_len takes from the free list: its new whole pages
    (the partial page that holds position prefix_len-1 is already the request's)."""
    return ceil_paged_tokens(seq_len, page_size) - ceil_paged_tokens(prefix_len, page_size)


def decode_starts_page(committed_len: int, page_size: int) -> bool:
    """Does the next decode token (at position committed_len) open a new page?"""
    return committed_len % page_size == 0


class TokenToKVPoolAllocator:
    """page_size == 1: a free list of slot ids, lowest first after a sort."""

    def __init__(self, size: int, device: str = "cpu", page_size: int = 1) -> None:
        assert page_size == 1, "use PagedTokenToKVPoolAllocator for page_size > 1"
        self.size = size
        self.page_size = 1
        self.device = device
        self.clear()

    def clear(self) -> None:
        # slot 0 is the padding slot: never handed out
        self.free_pages = torch.arange(1, self.size + 1, dtype=torch.int64, device=self.device)
        self.release_pages = torch.empty(0, dtype=torch.int64, device=self.device)
        self.is_not_in_free_group = True
        self.free_group: List[torch.Tensor] = []

    def available_size(self) -> int:
        return len(self.free_pages) + len(self.release_pages)

    def merge_and_sort_free(self) -> None:
        if len(self.release_pages) > 0:
            self.free_pages = torch.cat((self.free_pages, self.release_pages)).sort().values
            self.release_pages = torch.empty(0, dtype=torch.int64, device=self.device)

    def alloc(self, need_size: int) -> Optional[torch.Tensor]:
        """`need_size` slots, or None when there are not enough (the caller evicts first)."""
        if need_size > len(self.free_pages):
            self.merge_and_sort_free()
        if need_size > len(self.free_pages):
            return None
        out = self.free_pages[:need_size]
        self.free_pages = self.free_pages[need_size:]
        return out

    def alloc_extend(
        self, prefix_lens: List[int], seq_lens: List[int], last_loc: List[int], extend_num_tokens: int
    ) -> Optional[torch.Tensor]:
        """Slots for every extend token of a batch, concatenated in batch order."""
        return self.alloc(extend_num_tokens)

    def alloc_decode(self, seq_lens: List[int], last_loc: List[int]) -> Optional[torch.Tensor]:
        """One slot per request; `seq_lens` already counts the new token."""
        return self.alloc(len(seq_lens))

    def free(self, free_index: torch.Tensor) -> None:
        if free_index.numel() == 0:
            return
        if self.is_not_in_free_group:
            self.release_pages = torch.cat((self.release_pages, free_index.to(torch.int64)))
        else:
            self.free_group.append(free_index)

    def is_free(self, index: torch.Tensor) -> torch.Tensor:
        """[n] bool: whether each slot's page is in the free list (used by integrity checks)."""
        free_ids = torch.cat((self.free_pages, self.release_pages))  # [num_free_pages]
        return torch.isin(index.to(torch.int64) // self.page_size, free_ids)

    def check_free_list(self) -> None:
        """Raise AssertionError if the free list is corrupt: a page listed twice is a double
        free (available_size() would then exceed size), page 0 is the reserved padding page."""
        free_ids = torch.cat((self.free_pages, self.release_pages))  # [num_free_pages]
        num_ids = self.size // self.page_size
        unique = torch.unique(free_ids)
        if len(unique) != len(free_ids):
            counts = torch.bincount(free_ids, minlength=num_ids + 1)
            twice = torch.nonzero(counts > 1).flatten()[:8].tolist()
            raise AssertionError(f"double free: page/slot ids {twice} are in the free list more than once")
        if len(free_ids) > 0:
            assert int(free_ids.min()) >= 1, "the reserved padding slot/page 0 is in the free list"
            assert int(free_ids.max()) <= num_ids, f"free list holds id {int(free_ids.max())} > {num_ids}"

    def free_group_begin(self) -> None:
        """Batch all frees of one step into a single tensor op (freed at free_group_end)."""
        self.is_not_in_free_group = False
        self.free_group = []

    def free_group_end(self) -> None:
        self.is_not_in_free_group = True
        if self.free_group:
            self.free(torch.cat(self.free_group))
        self.free_group = []


class PagedTokenToKVPoolAllocator(TokenToKVPoolAllocator):
    """page_size > 1: the free list holds page ids; allocation fills partial pages first."""

    def __init__(self, size: int, device: str = "cpu", page_size: int = 16) -> None:
        assert page_size > 1
        self.size = size - size % page_size
        self.page_size = page_size
        self.num_pages = self.size // page_size
        self.device = device
        self.clear()

    def clear(self) -> None:
        self.free_pages = torch.arange(1, self.num_pages + 1, dtype=torch.int64, device=self.device)
        self.release_pages = torch.empty(0, dtype=torch.int64, device=self.device)
        self.is_not_in_free_group = True
        self.free_group = []

    def available_size(self) -> int:
        return (len(self.free_pages) + len(self.release_pages)) * self.page_size

    def _take_pages(self, n: int) -> Optional[torch.Tensor]:
        if n > len(self.free_pages):
            self.merge_and_sort_free()
        if n > len(self.free_pages):
            return None
        pages = self.free_pages[:n]
        self.free_pages = self.free_pages[n:]
        return pages

    def alloc(self, need_size: int) -> Optional[torch.Tensor]:
        assert need_size % self.page_size == 0, "paged alloc takes whole pages"
        pages = self._take_pages(need_size // self.page_size)
        if pages is None:
            return None
        offsets = torch.arange(self.page_size, device=self.device)
        return (pages[:, None] * self.page_size + offsets[None, :]).reshape(-1)

    def alloc_extend(
        self, prefix_lens: List[int], seq_lens: List[int], last_loc: List[int], extend_num_tokens: int
    ) -> Optional[torch.Tensor]:
        """Per request: finish the current partial page (slots after last_loc), then new pages.

        `last_loc[i]` is the slot of position prefix_lens[i]-1, or -1 for an empty prefix.
        """
        P = self.page_size
        num_new_pages = sum(new_page_slots(p, s, P) for p, s in zip(prefix_lens, seq_lens)) // P
        pages = self._take_pages(num_new_pages)
        if pages is None:
            return None
        pages_list = pages.tolist()
        out: List[int] = []
        cursor = 0
        for prefix, seq, last in zip(prefix_lens, seq_lens, last_loc):
            # 1) the rest of the partial page that holds position prefix-1
            in_partial = min(seq, ceil_paged_tokens(prefix, P)) - prefix
            out.extend(range(last + 1, last + 1 + in_partial))
            # 2) and 3) whole and partial new pages for the remaining tokens
            remaining = seq - prefix - in_partial
            while remaining > 0:
                page = pages_list[cursor]
                cursor += 1
                take = min(P, remaining)
                out.extend(range(page * P, page * P + take))
                remaining -= take
        assert len(out) == extend_num_tokens and cursor == num_new_pages
        return torch.tensor(out, dtype=torch.int64, device=self.device)

    def alloc_decode(self, seq_lens: List[int], last_loc: List[int]) -> Optional[torch.Tensor]:
        """A request whose new token starts a page takes a fresh page; others use last_loc+1."""
        P = self.page_size
        needs_page = [decode_starts_page(s - 1, P) for s in seq_lens]  # (s counts the new token)
        pages = self._take_pages(sum(needs_page))
        if pages is None:
            return None
        pages_iter = iter(pages.tolist())
        out = [next(pages_iter) * P if new else last + 1 for new, last in zip(needs_page, last_loc)]
        return torch.tensor(out, dtype=torch.int64, device=self.device)

    def free(self, free_index: torch.Tensor) -> None:
        if free_index.numel() == 0:
            return
        if self.is_not_in_free_group:
            pages = torch.unique(free_index.to(torch.int64) // self.page_size)
            self.release_pages = torch.cat((self.release_pages, pages))
        else:
            self.free_group.append(free_index)


def make_allocator(size: int, page_size: int, device: str = "cpu") -> TokenToKVPoolAllocator:
    if page_size == 1:
        return TokenToKVPoolAllocator(size, device)
    return PagedTokenToKVPoolAllocator(size, device, page_size)

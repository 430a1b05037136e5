"""KV slot allocators: random alloc/extend/decode/free sequences keep the free list honest.

Each simulated request holds the slots of its positions 0..len-1, as a req_to_token row
would. Properties: no slot is handed out twice while held, slot 0 never is, with pages
position i sits at offset i % P of a page the request owns alone, and available_size()
plus what is held always equals the total.
"""

from __future__ import annotations

from typing import Dict, List

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from minisgl.mem_cache.allocator import PagedTokenToKVPoolAllocator, TokenToKVPoolAllocator, make_allocator


def _held_tokens(reqs: Dict[int, List[int]], page_size: int) -> int:
    """Tokens the allocator counts as used: whole pages for every request."""
    return sum((len(slots) + page_size - 1) // page_size * page_size for slots in reqs.values())


def _check_layout(alloc: TokenToKVPoolAllocator, reqs: Dict[int, List[int]]) -> None:
    P = alloc.page_size
    owner: Dict[int, int] = {}
    for rid, slots in reqs.items():
        assert 0 not in slots, "slot 0 (padding) was handed out"
        assert len(set(slots)) == len(slots), f"request {rid} got a slot twice"
        for pos, slot in enumerate(slots):
            page = slot // P
            assert owner.setdefault(page, rid) == rid, f"page {page} held by requests {owner[page]} and {rid}"
            if P > 1:
                assert slot % P == pos % P, f"position {pos} at page offset {slot % P}"
                assert page == slots[pos - pos % P] // P, "a page-aligned run of positions spans two pages"
    assert not alloc.is_free(torch.tensor([s for v in reqs.values() for s in v], dtype=torch.int64)).any()
    alloc.check_free_list()
    assert alloc.available_size() + _held_tokens(reqs, P) == alloc.size


def _extend(alloc: TokenToKVPoolAllocator, reqs: Dict[int, List[int]], rids: List[int], lens: List[int]) -> None:
    prefix_lens = [len(reqs[r]) for r in rids]
    seq_lens = [p + n for p, n in zip(prefix_lens, lens)]
    last_loc = [reqs[r][-1] if reqs[r] else -1 for r in rids]
    before = alloc.available_size()
    out = alloc.alloc_extend(prefix_lens, seq_lens, last_loc, sum(lens))
    if out is None:
        assert alloc.available_size() == before, "a failed alloc_extend must not take pages"
        return
    assert out.dtype == torch.int64 and len(out) == sum(lens)
    pt = 0
    for r, n in zip(rids, lens):
        reqs[r].extend(out[pt : pt + n].tolist())
        pt += n


def _decode(alloc: TokenToKVPoolAllocator, reqs: Dict[int, List[int]], rids: List[int]) -> None:
    seq_lens = [len(reqs[r]) + 1 for r in rids]
    last_loc = [reqs[r][-1] for r in rids]
    out = alloc.alloc_decode(seq_lens, last_loc)
    if out is None:
        return
    for r, slot in zip(rids, out.tolist()):
        reqs[r].append(slot)


@pytest.mark.parametrize("page_size", [1, 16])
@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_random_alloc_free_sequences(page_size: int, data: st.DataObject) -> None:
    alloc = make_allocator(page_size * 12, page_size)
    reqs: Dict[int, List[int]] = {}
    next_rid = 0
    for _ in range(data.draw(st.integers(5, 40), label="steps")):
        op = data.draw(st.sampled_from(["new", "extend", "decode", "free", "free_group"]))
        if op == "new":
            rids = list(range(next_rid, next_rid + data.draw(st.integers(1, 3))))
            next_rid += len(rids)
            for r in rids:
                reqs[r] = []
            _extend(alloc, reqs, rids, [data.draw(st.integers(1, 3 * page_size + 2)) for _ in rids])
            for r in rids:  # a failed batch leaves empty requests behind: drop them
                if not reqs[r]:
                    del reqs[r]
        elif op == "extend" and reqs:
            rids = data.draw(st.lists(st.sampled_from(sorted(reqs)), min_size=1, max_size=3, unique=True))
            _extend(alloc, reqs, rids, [data.draw(st.integers(1, 2 * page_size + 1)) for _ in rids])
        elif op == "decode" and reqs:
            _decode(alloc, reqs, data.draw(st.lists(st.sampled_from(sorted(reqs)), min_size=1, unique=True)))
        elif op == "free" and reqs:
            alloc.free(torch.tensor(reqs.pop(data.draw(st.sampled_from(sorted(reqs))))))
        elif op == "free_group" and reqs:
            victims = data.draw(st.lists(st.sampled_from(sorted(reqs)), min_size=1, unique=True))
            before = alloc.available_size()
            alloc.free_group_begin()
            for r in victims:
                alloc.free(torch.tensor(reqs.pop(r)))
            assert alloc.available_size() == before, "frees inside a group wait for free_group_end"
            alloc.free_group_end()
        _check_layout(alloc, reqs)
    for slots in reqs.values():
        alloc.free(torch.tensor(slots))
    assert alloc.available_size() == alloc.size
    alloc.check_free_list()


def test_free_group_batches_frees_into_one_release() -> None:
    alloc = TokenToKVPoolAllocator(16)
    a, b = alloc.alloc(4), alloc.alloc(4)
    alloc.free_group_begin()
    alloc.free(a)
    alloc.free(b)
    assert alloc.available_size() == 8, "frees inside a group are deferred"
    alloc.free_group_end()
    assert alloc.available_size() == 16
    assert len(alloc.release_pages) == 8  # one concatenated release, sorted on the next alloc
    assert alloc.alloc(16).tolist() == list(range(1, 17))


def test_lowest_slots_first_and_none_when_full() -> None:
    alloc = TokenToKVPoolAllocator(8)
    assert alloc.alloc(3).tolist() == [1, 2, 3]
    assert alloc.alloc(6) is None and alloc.available_size() == 5
    alloc.free(torch.tensor([2]))
    assert alloc.alloc(6).tolist() == [2, 4, 5, 6, 7, 8]


def test_paged_extend_fills_partial_page_then_new_pages() -> None:
    alloc = PagedTokenToKVPoolAllocator(64, page_size=4)  # pages 1..16
    first = alloc.alloc_extend([0], [6], [-1], 6)
    assert first.tolist() == [4, 5, 6, 7, 8, 9]  # page 1 whole, page 2 half
    more = alloc.alloc_extend([6], [11], [9], 5)
    assert more.tolist() == [10, 11, 12, 13, 14]  # rest of page 2, then page 3
    assert alloc.alloc_decode([12], [14]).tolist() == [15]  # same page
    assert alloc.alloc_decode([13], [15]).tolist() == [16]  # position 12 opens page 4
    assert alloc.available_size() == 64 - 4 * 4


def test_paged_free_of_any_slot_frees_its_page_and_double_free_is_caught() -> None:
    alloc = PagedTokenToKVPoolAllocator(32, page_size=4)
    slots = alloc.alloc(8)
    alloc.free(slots[5:6])
    assert alloc.available_size() == 32 - 4
    assert alloc.is_free(slots).tolist() == [False] * 4 + [True] * 4
    alloc.free(slots[4:])  # the same page again: a double free
    with pytest.raises(AssertionError, match="double free"):
        alloc.check_free_list()

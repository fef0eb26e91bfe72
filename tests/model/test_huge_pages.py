"""Weights and the KV cache on transparent huge pages: moved whole (values, ties and
views kept), and on memory the kernel may back with huge pages."""

from __future__ import annotations

import pytest
import torch

from pagoda.attention.kv_cache import PagedKVCache
from pagoda.model_executor.huge_pages import (
    huge_page_zeros,
    move_to_huge_pages,
    thp_mode,
)
from pagoda.model_executor.quantization import QuantizedWeight

needs_thp = pytest.mark.skipif(
    thp_mode() not in ("always", "madvise"), reason="this kernel has no transparent huge pages"
)


def thp_eligible(t: torch.Tensor) -> bool:
    """Whether the mapping that holds `t` may get huge pages (/proc/self/smaps)."""
    address, eligible = t.data_ptr(), None
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                start, end = (int(x, 16) for x in head.split("-"))
                inside = start <= address < end
            elif inside and head == "THPeligible:":
                eligible = line.split()[1] == "1"
    return bool(eligible)


class Holder(torch.nn.Module):
    def __init__(self, shared: torch.nn.Parameter, qw: QuantizedWeight) -> None:
        super().__init__()
        self.w = shared  # a parameter
        self.register_buffer("table", torch.randn(64, 512))
        self.plain = torch.randn(256, 256)  # a tensor attribute
        self.qweight = qw
        self.experts = [qw, QuantizedWeight("q8_0", *_blocks(128, 8, 32))]
        self.small = torch.randn(4)  # under min_bytes: stays


def _blocks(n: int, nb: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    qs = torch.randint(0, 256, (n, nb, size), dtype=torch.uint8)
    return qs, torch.rand(n, nb).half()


@needs_thp
@pytest.mark.parametrize("shift", [0, 4096 + 64])
def test_a_model_moves_whole_with_ties_and_views(monkeypatch, shift):
    """`shift`: the arena starts that far into its mapping (a kernel whose anonymous
    mappings are not 2 MiB aligned), so that every view's offset counts."""
    from pagoda.model_executor import huge_pages

    unshifted = huge_pages.huge_page_buffer
    monkeypatch.setattr(huge_pages, "huge_page_buffer", lambda n: unshifted(n + shift)[shift:])
    shared = torch.nn.Parameter(torch.randn(512, 256), requires_grad=False)
    big = torch.randn(300, 256)
    qw = QuantizedWeight("q4_0", *_blocks(512, 64, 16))
    root = torch.nn.Module()
    root.first = torch.nn.Linear(128, 128, bias=False)  # moved before the tied parameter
    root.a, root.b = Holder(shared, qw), Holder(shared, qw)  # tied: one parameter, one qw
    root.a.view_lo, root.a.view_hi = big[:100], big[100:]  # two views of one storage
    before = {k: v.clone() for k, v in root.state_dict().items()}
    small_ptr, shared_ptr = root.a.small.data_ptr(), shared.data_ptr()
    values = [t.clone() for t in (root.a.plain, qw.qs, qw.d, root.a.experts[1].qs)]

    moved = move_to_huge_pages(root, min_bytes=1 << 16)

    # Each distinct storage of at least 64 KiB, once: `first` (64 KiB), the tied
    # parameter (512 KiB), two buffers (128 KiB each), two plain tensors (256 KiB each),
    # `big` under its two views (300 KiB), the tied QuantizedWeight's qs (512 KiB) and
    # d (64 KiB). Not the second experts' 32 KiB blocks, nor `small`.
    assert moved == 2**16 + 2**19 + 2 * 2**17 + 2 * 2**18 + 300 * 1024 + 2**19 + 2**16
    assert root.state_dict().keys() == before.keys()
    for k, v in root.state_dict().items():
        assert torch.equal(v, before[k]), k
    after = (root.a.plain, qw.qs, qw.d, root.a.experts[1].qs)
    assert all(torch.equal(a, b) for a, b in zip(after, values, strict=True))
    assert root.a.w is root.b.w and root.a.w.data_ptr() != shared_ptr
    assert root.a.qweight is root.b.qweight is root.a.experts[0]
    # The tied parameter and QuantizedWeight moved once; the views still share storage.
    assert thp_eligible(root.a.w) and thp_eligible(qw.qs) and thp_eligible(root.a.view_lo)
    assert root.a.view_hi.data_ptr() - root.a.view_lo.data_ptr() == 100 * 256 * 4
    root.a.view_lo.add_(1.0)
    assert torch.equal(root.a.view_lo, big[:100] + 1.0)
    assert thp_eligible(root.a.plain) and thp_eligible(root.b.table)
    # Below min_bytes: left where it was. (Not checked: its mapping's eligibility, which
    # is the allocator's; one run in a long process found a 16-byte tensor's eligible.)
    assert root.a.small.data_ptr() == small_ptr


@needs_thp
def test_nothing_moves_under_min_bytes():
    m = torch.nn.Linear(8, 8)
    ptr = m.weight.data_ptr()
    assert move_to_huge_pages(m, min_bytes=1 << 20) == 0
    assert m.weight.data_ptr() == ptr


@needs_thp
def test_the_kv_cache_is_zeroed_on_huge_pages():
    import psutil

    rss = psutil.Process().memory_info().rss
    z = huge_page_zeros((64, 1024, 1024), torch.float32)  # 256 MiB, resident as written
    assert psutil.Process().memory_info().rss - rss < 64 << 20
    z[5, 7, 9] = 1.0
    assert z.shape == (64, 1024, 1024) and z.dtype == torch.float32
    assert z.count_nonzero() == 1 and thp_eligible(z)
    cache = PagedKVCache(2, 8, 16, 2, 64, torch.int8)
    assert thp_eligible(cache.data) and thp_eligible(cache.scales)
    assert not cache.data.any() and not cache.scales.any()


def test_no_huge_pages_where_the_kernel_has_none(monkeypatch):
    from pagoda.model_executor import huge_pages

    monkeypatch.setattr(huge_pages, "thp_mode", lambda: "never")
    m = torch.nn.Linear(256, 256)
    ptr = m.weight.data_ptr()
    assert move_to_huge_pages(m, min_bytes=1) == 0 and m.weight.data_ptr() == ptr
    z = huge_page_zeros((4, 5), torch.float32)
    assert torch.equal(z, torch.zeros(4, 5))

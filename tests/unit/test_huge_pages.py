"""service.engine.huge_pages: tensors the engine's packed weights live in."""

import pytest
import torch

from service.engine import cpu_gemm, huge_pages


def test_small_tensors_are_torch_s_own():
    tensor = huge_pages.empty((4, 1000), torch.float32)
    assert tensor.shape == (4, 1000) and tensor.dtype == torch.float32
    assert huge_pages.huge_bytes([tensor.fill_(1.0)]) == 0


@pytest.mark.skipif(not huge_pages.offered(), reason="this Linux gives no 2 MB pages (THP never, or no madvise)")
def test_large_tensors_start_on_a_boundary_and_take_2mb_pages_when_written():
    tensor = huge_pages.empty((3, 1 << 20), torch.float32)  # 12 MiB
    assert tensor.shape == (3, 1 << 20) and tensor.is_contiguous() and tensor.data_ptr() % huge_pages.HUGE_PAGE == 0
    assert huge_pages.huge_bytes([tensor]) == 0  # nothing written yet
    tensor.copy_(torch.arange(3 << 20, dtype=torch.float32).view(3, -1))
    assert huge_pages.huge_bytes([tensor]) >= 8 << 20  # the kernel may keep a page 4 KB when memory is short
    assert float(tensor[2, -1]) == (3 << 20) - 1


def test_packed_panels_are_the_weight_s_columns_in_panels():
    weight = torch.randn(1000, 768)  # 3 MB: on 2 MB pages where they are offered
    panels = cpu_gemm.pack(weight)
    assert panels.shape == (42, 768, 24)
    assert torch.equal(panels.transpose(1, 2).reshape(-1, 768)[:1000], weight)
    assert not panels.transpose(1, 2).reshape(-1, 768)[1000:].any()


@pytest.mark.skipif(not huge_pages.offered(), reason="this Linux gives no 2 MB pages (THP never, or no madvise)")
def test_an_arena_lays_tensors_side_by_side_on_2mb_pages():
    arena = huge_pages.Arena()
    first = arena.empty((3, 1000, 1001), torch.bfloat16)  # 6 MB, not a whole number of lines
    small = arena.empty((100,), torch.float32)  # under 2 MB: beside the others all the same
    second = arena.empty((2, 1 << 20), torch.float32)  # 8 MB
    assert first.data_ptr() % huge_pages.HUGE_PAGE == 0 and small.data_ptr() % 64 == 0 and second.data_ptr() % 64 == 0
    assert small.data_ptr() - (first.data_ptr() + first.numel() * 2) < 64  # next to it, not on a mapping of its own
    assert second.data_ptr() - (small.data_ptr() + small.numel() * 4) < 64
    first.fill_(2.0)
    small.fill_(1.0)
    second.fill_(3.0)
    size = first.numel() * 2 + small.numel() * 4 + second.numel() * 4
    assert size - (4 << 20) <= huge_pages.huge_bytes([first, small, second]) <= size  # the kernel may keep a page 4 KB
    assert float(first[2, -1, -1]) == 2.0 and float(small[-1]) == 1.0 and float(second[0, 0]) == 3.0  # none overwrote another


@pytest.mark.skipif(not huge_pages.offered(), reason="this Linux gives no 2 MB pages (THP never, or no madvise)")
def test_an_arena_gives_a_tensor_larger_than_its_chunk_a_mapping_of_its_own():
    arena = huge_pages.Arena()
    arena.CHUNK = 4 << 20
    first, large = arena.empty((3 << 20,), torch.uint8), arena.empty((5 << 20,), torch.uint8)
    assert large.numel() == 5 << 20 and large.data_ptr() % 64 == 0
    assert not (first.data_ptr() <= large.data_ptr() < first.data_ptr() + first.numel())

"""launch_config: every width gets a tile that holds whole rows (or a chunked kernel past the single-block
limit) at a bounded number of values a thread, and the row-group counts never exceed the work."""
import pytest
import torch

from megatron.fused_kernels import launch_config as lc

WIDTHS = [1, 5, 24, 100, 768, 1024, 2048, 2560, 4096, 4097, 5120, 8192, 8193, 12288, 16384, 32768, 50304, 131072]


@pytest.mark.parametrize("width", WIDTHS)
def test_row_kernels_hold_whole_rows_or_chunk(width):
    for blocks, single, per_thread in (
        (lc.norm_forward_blocks(width), lc.NORM_FORWARD_SINGLE_BLOCK, lc.ELEMENTS_PER_THREAD),
        (lc.norm_backward_blocks(width), lc.NORM_BACKWARD_SINGLE_BLOCK, lc.NORM_BACKWARD_ELEMENTS_PER_THREAD),
        (lc.softmax_blocks(width), lc.SOFTMAX_SINGLE_BLOCK, lc.ELEMENTS_PER_THREAD),
    ):
        assert blocks.num_warps in (4, 8, 16, 32)
        assert blocks.chunked == (width > single), blocks
        if blocks.chunked:
            assert blocks.block_m == 1 and blocks.block_n == lc.CHUNK
        else:
            assert blocks.block_n >= width and blocks.block_n & (blocks.block_n - 1) == 0
        assert blocks.block_m * blocks.block_n <= per_thread * 32 * blocks.num_warps, blocks


@pytest.mark.parametrize("width", WIDTHS)
def test_tiles_of_elementwise_and_column_sum_kernels(width):
    tile = lc.elementwise_blocks(width)
    assert tile.block_n % 4 == 0 and tile.block_n // 4 >= 4  # bias_dropout_add's four column quarters
    assert tile.block_n <= lc.ELEMENTWISE_MAX_COLUMNS and tile.block_m * tile.block_n == lc.ROW_TILE
    sums = lc.column_sum_blocks(width)
    assert sums.block_m * sums.block_n == lc.ROW_TILE and sums.block_n <= lc.COLUMN_SUM_MAX_COLUMNS


def test_row_groups_fill_the_machine_without_exceeding_the_tiles():
    cpu = torch.device("cpu")
    tile = lc.Blocks(block_m=4, block_n=512, num_warps=8)
    assert lc.row_groups(cpu, rows=1, blocks=tile) == 1
    assert lc.row_groups(cpu, rows=9, blocks=tile) == 3  # three tiles
    assert lc.row_groups(cpu, rows=10_000, blocks=tile) == lc.CPU_PROGRAMS
    assert lc.row_groups(cpu, rows=10_000, blocks=tile, column_blocks=3) == 2  # ceil(4 programs / 3 columns)
    assert lc.row_groups(cpu, rows=0, blocks=tile) == 1


def test_partials_sum_to_the_gradient_in_its_dtype():
    partial = lc.partial_buffer(3, 5, True, torch.device("cpu"))
    partial.copy_(torch.arange(15.0).view(3, 5))
    torch.testing.assert_close(lc.sum_partials(partial, rows=7, dtype=torch.bfloat16),
                               torch.tensor([15.0, 18.0, 21.0, 24.0, 27.0], dtype=torch.bfloat16))
    assert lc.sum_partials(partial, rows=7, dtype=None) is None
    assert torch.equal(lc.sum_partials(partial, rows=0, dtype=torch.float32), torch.zeros(5))
    assert lc.partial_buffer(3, 5, False, torch.device("cpu")).shape == (1, 1)

import torch
import torch.nn.functional as F

from services.executor.lm_head import SMALL_ROWS, LmHead


def test_logits_equal_the_plain_product_for_every_row_count():
    torch.manual_seed(0)
    weight = torch.randn(1000, 64)
    head = LmHead(weight)
    assert head.transposed is not None and head.transposed.is_contiguous()
    for rows in range(1, SMALL_ROWS + 3):
        hidden = torch.randn(rows, 64)
        got = head(hidden)
        assert got.dtype == torch.float32 and got.shape == (rows, 1000)
        torch.testing.assert_close(got, F.linear(hidden, weight), rtol=1e-5, atol=1e-4)


def test_no_copy_for_other_dtypes():
    head = LmHead(torch.randn(100, 16, dtype=torch.bfloat16))
    assert head.transposed is None
    out = head(torch.randn(2, 16, dtype=torch.bfloat16))
    assert out.dtype == torch.float32 and out.shape == (2, 100)

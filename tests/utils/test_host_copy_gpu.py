"""to_device on a GPU: pinned, non-blocking copies carry the same values as a plain copy, also for
non-contiguous (expanded, sliced) sources and when the source changes right after the call."""

import pytest
import torch

from megatron_gptoss.utils.host import to_device

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def test_pinned_copy_equals_plain_copy():
    device = torch.device("cuda")
    gen = torch.Generator().manual_seed(0)
    base = torch.randn(64, 33, generator=gen)
    for source in (base, base[:, 1::2], base[:, :1].expand(64, 40), torch.arange(1000)):
        want = source.to(device)
        got = to_device(source, device)
        source_copy = source.clone()
        if source.is_contiguous():
            source.zero_()  # the staged copy must not read the source after the call
        torch.cuda.synchronize()
        assert torch.equal(got, want) and torch.equal(got.cpu(), source_copy)

"""The adaptive span's soft mask, span loss, trimming bound and cache length against hand-computed values."""

import pytest
import torch

from xlm_pkm.model.adaptive_span import AdaptiveSpan


def test_mask_matches_hand_computed_ramp():
    span = AdaptiveSpan(n_heads=3, max_span=8, ramp=2, loss_coeff=0.1)
    with torch.no_grad():
        span.z.copy_(torch.tensor([0.0, 0.25, 1.0]))  # spans 0, 2 and 8 tokens
    expected = torch.tensor([
        [1.0, 0.5, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0],   # (2 + 0 - x) / 2
        [1.0, 1.0, 1.0, 0.5, 0.0, 0.0, 0.0, 0.0],   # (2 + 2 - x) / 2
        [1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0],   # (2 + 8 - x) / 2 >= 1 for x <= 8
    ])
    torch.testing.assert_close(span.mask(8), expected)
    torch.testing.assert_close(span.span_loss(), torch.tensor(0.1 * 8 * (1.25 / 3)))


def test_mask_gradient_reaches_z_through_the_ramp_only():
    span = AdaptiveSpan(n_heads=1, max_span=8, ramp=4, loss_coeff=0.0)
    with torch.no_grad():
        span.z.fill_(0.1)  # m(x) = (4.8 - x) / 4: 1.2 -> 1, 0.95, 0.7, 0.45, 0.2, then < 0 -> 0
    span.mask(8).sum().backward()
    # offsets 1..4 are on the ramp, each with dm/dz = S/R = 2; the clamped ones give nothing
    assert span.z.grad.item() == pytest.approx(4 * 2.0)


def test_clamp_keeps_ratios_in_unit_interval():
    span = AdaptiveSpan(n_heads=2, max_span=8, ramp=2, loss_coeff=0.0)
    with torch.no_grad():
        span.z.copy_(torch.tensor([-0.5, 1.5]))
    span.clamp_()
    assert span.z.tolist() == [0.0, 1.0]


@pytest.mark.parametrize("z_max, span_in_use, cache", [
    (0.0, 64, 128),            # ceil(0) + 32 = 32 -> 64
    (0.004, 128, 192),         # ceil(32.768) + 32 = 65 -> 128
    (96 / 8192, 128, 192),     # 96 + 32 = 128 exactly
    (0.5, 4096 + 64, 4096 + 128),
    (0.995, 8192, 8192),       # capped at S
])
def test_span_in_use_and_cache_length(z_max, span_in_use, cache):
    span = AdaptiveSpan(n_heads=2, max_span=8192, ramp=32, loss_coeff=0.0)
    with torch.no_grad():
        span.z.copy_(torch.tensor([0.0, z_max]))
    assert span.span_in_use() == span_in_use
    assert span.cache_length() == cache

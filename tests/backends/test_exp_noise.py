"""The verification's Exp(1) noise as each backend draws it (``Backend.fill_exp_noise``).

The CPU backend draws ``-log(U)`` with a vectorised uniform instead of torch's
element-by-element ``exponential_`` (a quarter of the time per row); these tests hold it
to the distribution the verify rules need (Exp(1), and through the exponential race a
token drawn with its probability), to the generator it is given, and to the row it fills.
"""

from __future__ import annotations

import math

import pytest
import torch

from vllm_specx.backends import backend_for_device
from vllm_specx.backends.base import exponential_noise
from vllm_specx.backends.cpu import fill_exp_noise


def test_cpu_noise_is_exp1():
    # Kolmogorov-Smirnov against Exp(1)'s CDF: at n = 400k the 0.1% critical distance is
    # 1.95 / sqrt(n) ~ 0.0031 (seeded: the same draws every run).
    n = 400_000
    noise = torch.empty(n)
    fill_exp_noise(noise, torch.Generator().manual_seed(11))
    assert bool((noise >= 0).all())
    x, _ = noise.double().sort()
    cdf = 1.0 - torch.exp(-x)
    i = torch.arange(1, n + 1, dtype=torch.float64)
    ks = float(torch.maximum(i / n - cdf, cdf - (i - 1) / n).max())
    assert ks < 1.95 / math.sqrt(n), ks
    assert abs(float(x.mean()) - 1.0) < 0.01 and abs(float(x.var()) - 1.0) < 0.02


def test_cpu_noise_follows_the_generator_and_fills_only_its_row():
    rows = torch.full((3, 1000), -1.0)
    fill_exp_noise(rows[1], torch.Generator().manual_seed(5))
    again = torch.empty(1000)
    fill_exp_noise(again, torch.Generator().manual_seed(5))
    other = torch.empty(1000)
    fill_exp_noise(other, torch.Generator().manual_seed(6))
    assert torch.equal(rows[1], again) and not torch.equal(again, other)
    assert bool((rows[0] == -1).all()) and bool((rows[2] == -1).all())


@pytest.mark.parametrize("fill", [fill_exp_noise, exponential_noise])
def test_exponential_race_draws_each_token_with_its_probability(fill):
    # argmax(p / noise) is how the verify rules draw the extra token: chi-square of the
    # drawn tokens against p (4 degrees of freedom; 18.47 is the 0.1% critical value).
    p = torch.tensor([0.05, 0.1, 0.2, 0.25, 0.4])
    draws = 40_000
    noise = torch.empty(draws, p.shape[0])
    torch.manual_seed(3)
    fill(noise, None)
    counts = torch.bincount((p / noise).argmax(dim=-1), minlength=p.shape[0]).double()
    expected = p.double() * draws
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 18.47, (chi2, counts.tolist())


def test_every_backend_draws_noise():
    assert backend_for_device("cpu").fill_exp_noise is fill_exp_noise
    for device in ("cuda", "npu"):
        assert backend_for_device(device).fill_exp_noise is exponential_noise

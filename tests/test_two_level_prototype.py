"""The prototype backward of benchmarks/prototypes/two_level_bwd.py against chapter 07's backward
(scan_lib.fast_selective_scan.strided_bwd, itself checked against float64 in test_selective_scan)."""
import sys
from pathlib import Path

import pytest
import torch

import scan_lib.fast_selective_scan as fast

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks" / "prototypes"))
from two_level_bwd import two_level_bwd  # noqa: E402

from scan_lib.runtime import DEVICE  # noqa: E402

CASES = [  # batch, dim, L, N, groups, chunk, items per thread, channels per program, dtype
    (1, 2, 16, 2, 1, 16, 4, 2, torch.float32),
    (2, 4, 37, 3, 1, 16, 4, 2, torch.float32),
    (2, 8, 45, 4, 2, 16, 8, 2, torch.float32),
    (1, 3, 70, 5, 1, 32, 2, 4, torch.float32),
    (1, 5, 5, 3, 1, 16, 4, 2, torch.float32),
    (2, 5, 129, 2, 1, 32, 8, 2, torch.float32),
    (2, 4, 100, 4, 1, 32, 8, 2, torch.float64),
]


@pytest.mark.parametrize("batch, dim, length, n_states, groups, chunk, items, block_d, dtype", CASES)
def test_two_level_backward_matches_chapter_07s(batch, dim, length, n_states, groups, chunk, items, block_d, dtype):
    g = torch.Generator().manual_seed(batch * 1000 + length)
    u = torch.randn(batch, dim, length, generator=g, dtype=dtype)
    delta = (0.05 + torch.rand(batch, dim, length, generator=g)).to(dtype)
    A = -(0.5 + torch.rand(dim, n_states, generator=g, dtype=dtype))
    B = torch.randn(batch, groups, n_states, length, generator=g, dtype=dtype)
    C = torch.randn(batch, groups, n_states, length, generator=g, dtype=dtype)
    dout = torch.randn(batch, dim, length, generator=g, dtype=dtype)
    u, delta, A, B, C, dout = (t.to(DEVICE) for t in (u, delta, A, B, C, dout))
    inputs = (u, delta, A, B, C, None, None, None)
    states = fast.strided_fwd(*inputs, None, False, chunk, 1)[2]
    want = fast.strided_bwd(*inputs, states, dout, None, False, chunk, 1)[:5]
    got = two_level_bwd(u, delta, A, B, C, states, dout, chunk, block_d=block_d, items=items)
    tol = 1e-12 if dtype == torch.float64 else 1e-5
    for name, x, y in zip(["du", "ddelta", "dA", "dB", "dC"], got, want):
        err = ((x.double() - y.double()).abs().max() / y.double().abs().max()).item()
        assert err < tol, f"{name}: {err:.1e}"

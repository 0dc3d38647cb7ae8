"""scan_lib.ema: the checks of chapter 02 catch the bugs they guard against, and the combine's
documented behaviour with zero and infinite gates."""
import math
import sys
from pathlib import Path

import pytest
import torch

import scan_lib  # first: without a GPU it switches Triton to its interpreter before triton.language loads
import triton.language as tl
from scan_lib import ema
from scan_lib.ema import error_bound, first_order_op, is_associative, linear_scan_loop, linear_scan_rows
from scan_lib.runtime import DEVICE, ON_GPU

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools" / "grading"))
from checks_02 import tree_scan  # noqa: E402  (Hillis-Steele on tensors: the grouping of a GPU scan)


def long_memory_inputs(rows=2, length=600, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    gates = (0.5 + 0.5 * torch.rand(rows, length, generator=gen)).to(DEVICE, dtype)
    tokens = torch.randn(rows, length, generator=gen).to(DEVICE, dtype)
    return gates, tokens


def ratio(h, gates, tokens, initial_state=None, reverse=False):
    return ema.error_ratio(h, gates, tokens, initial_state, reverse)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("reverse", [False, True])
def test_kernel_within_bound(dtype, reverse):
    gates, tokens = long_memory_inputs(length=300, dtype=dtype, seed=1)
    init = torch.randn(2, dtype=torch.float64).to(DEVICE, dtype)
    h = linear_scan_rows(gates, tokens, init, reverse=reverse, chunk=64)
    assert h.dtype == dtype
    assert ratio(h, gates, tokens, init, reverse) <= 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_fp16_accumulation_fails_the_check(dtype, monkeypatch):
    gates, tokens = long_memory_inputs(dtype=dtype)
    assert ratio(linear_scan_rows(gates, tokens, chunk=64), gates, tokens) <= 1
    monkeypatch.setattr(ema, "accumulator_dtype", lambda dtype: tl.float16)  # the injected bug
    assert ratio(linear_scan_rows(gates, tokens, chunk=64), gates, tokens) > 1


@pytest.mark.parametrize("reverse", [False, True])
def test_skipped_carry_fails_the_check(reverse):
    gates, tokens = long_memory_inputs(length=512)
    h = linear_scan_rows(gates, tokens, reverse=reverse, chunk=64)
    assert ratio(h, gates, tokens, reverse=reverse) <= 1
    # the injected bug: every chunk of 64 scanned from a zero state, the carry between chunks skipped
    no_carry = linear_scan_rows(gates.reshape(-1, 64), tokens.reshape(-1, 64), reverse=reverse).reshape(2, 512)
    assert ratio(no_carry, gates, tokens, reverse=reverse) > 1


def test_non_associative_combine_is_caught():
    def broken(a_left, b_left, a_right, b_right):  # the injected bug: the later gate, not the product
        return a_right, a_right * b_left + b_right

    assert is_associative(first_order_op.fn)
    assert not is_associative(broken)
    # and why the property test is needed: a left-to-right fold (the interpreter) cannot tell them apart,
    # a tree (a GPU) can
    gen = torch.Generator().manual_seed(2)
    gates, tokens = torch.rand(3, 50, generator=gen, dtype=torch.float64), torch.randn(3, 50, generator=gen, dtype=torch.float64)
    expected = linear_scan_loop(gates, tokens)
    torch.testing.assert_close(tree_scan(first_order_op.fn, gates, tokens), expected)
    assert not torch.allclose(tree_scan(broken, gates, tokens), expected)


def test_error_bound_is_per_element_and_by_dtype():
    gates, tokens = long_memory_inputs(length=100)
    h = linear_scan_loop(gates, tokens)
    b64, b32, b16 = (error_bound(gates, tokens, dtype=d) for d in (torch.float64, torch.float32, torch.float16))
    assert b64.shape == b32.shape == b16.shape == h.shape
    assert (b64 < b32).all() and (b32 < b16).all()
    assert (b16 >= 2.0**-11 * h.abs()).all() and (b16 < 2.0**-11 * h.abs() + 1e-3).all()


def test_tree_combine_with_finite_gates_and_zeros_matches_the_loop():
    gen = torch.Generator().manual_seed(3)
    gates = torch.rand(4, 200, generator=gen, dtype=torch.float64)
    gates[gates < 0.2] = 0.0  # exact zeros: the state is reset
    tokens = torch.randn(4, 200, generator=gen, dtype=torch.float64)
    torch.testing.assert_close(tree_scan(first_order_op.fn, gates, tokens), linear_scan_loop(gates, tokens))


def test_zero_then_infinite_gate_documented_behaviour():
    """first_order_op's docstring: a zero gate followed by an infinite one composes to the gate
    0 * inf = NaN, so a tree gives NaN where the recurrence gives +-inf; a left fold gives the loop."""
    gates = torch.tensor([[0.5, 0.0, math.inf, 0.5, 0.5, 2.0]], dtype=torch.float64)
    tokens = torch.tensor([[1.0, 1.0, 1.0, -2.0, 1.0, 1.0]], dtype=torch.float64)
    loop = linear_scan_loop(gates, tokens)
    assert loop[0, 2] == math.inf and not loop.isnan().any()
    a, b = first_order_op.fn(gates[:, 1], tokens[:, 1], gates[:, 2], tokens[:, 2])
    assert a.isnan().all() and b.isinf().all()  # the composed pair of the steps 0 then inf
    tree = tree_scan(first_order_op.fn, gates, tokens)
    differs = ~torch.eq(tree, loop)
    assert differs.any() and tree[differs].isnan().all() and loop[differs].isinf().all()
    # the kernel: the loop's values on the interpreter (a left fold); on a GPU the loop's or NaN where it gives inf
    h = linear_scan_rows(gates.to(DEVICE), tokens.to(DEVICE)).cpu()
    differs = ~torch.eq(h, loop)
    assert (h[differs].isnan() & loop[differs].isinf()).all()
    assert ON_GPU or not differs.any()

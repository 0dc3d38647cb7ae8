"""scan_lib.cumsum against a float64 reference and against torch.cumsum: shapes, dims, dtypes (integers and
bool included), edge cases, gradients of any order, torch.func / vmap / torch.compile, bad input; the column
scan along a dim but the last (views read at their strides, no copy) and the threshold that picks it; a property
test that the combine operator is associative (which the CPU interpreter cannot see); and injected bugs
(a skipped carry, float16 accumulation, a look-back that runs past its row) that the checks must catch."""
import math
import random
import sys

import pytest
import torch

import scan_lib  # noqa: I001  (before triton: without a GPU it switches Triton to its interpreter)
import triton
import triton.language as tl
from scan_lib.cumsum import ALGORITHMS, CONFIG, add_combine, look_back, scan_rows
from scan_lib.runtime import DEVICE, INTERPRET, ON_GPU

cs = sys.modules["scan_lib.cumsum"]  # the module: scan_lib.cumsum is the function
UNIT_ROUNDOFF = {torch.float64: 2.0**-53, torch.float32: 2.0**-24, torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8}
AWKWARD_LENGTHS = (1, 2, 7, 15, 16, 17, 129, 1000, 4097)


def tolerance(dtype: torch.dtype, length: int) -> float:
    """The notebook's scan_tolerance: rounding to the output dtype (twice that for bfloat16 under the
    interpreter, which truncates) plus 32 log2(length) roundings in the accumulation dtype."""
    accumulate = torch.float64 if dtype == torch.float64 else torch.float32
    output = (2 if INTERPRET and dtype == torch.bfloat16 else 1) * UNIT_ROUNDOFF[dtype]
    return output + 32 * UNIT_ROUNDOFF[accumulate] * math.log2(max(length, 2))


def scaled_error(y: torch.Tensor, x: torch.Tensor, dim: int) -> float:
    reference = torch.cumsum(x.double(), dim=dim)
    scale = torch.cumsum(x.double().abs(), dim=dim).clamp_min(1e-30)
    return ((y.double() - reference).abs() / scale).max().item()


def assert_matches_reference(y: torch.Tensor, x: torch.Tensor, dim: int) -> None:
    """Relative to sum_{j<=t} |x_j| (the size of what was summed up to t)."""
    assert y.shape == x.shape and y.dtype == x.dtype and y.device == x.device
    error, allowed = scaled_error(y, x, dim), tolerance(x.dtype, x.shape[dim])
    assert error <= allowed, f"scaled error {error:.2e} > {allowed:.1e} for {x.dtype} {tuple(x.shape)} dim={dim}"


def random_case(seed: int) -> tuple[tuple[int, ...], int]:
    """A random shape of rank 1 to 3 with at least one awkward length, and a random dim (maybe negative)."""
    rng = random.Random(seed)
    rank = rng.randint(1, 3)
    shape = [rng.choice((1, 3, 5, 8)) for _ in range(rank)]
    shape[rng.randrange(rank)] = rng.choice((7, 129, 1000, 2049))
    return tuple(shape), rng.randrange(-rank, rank)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("seed", range(4))
def test_random_shapes_dims_dtypes(dtype, seed):
    shape, dim = random_case(seed)
    torch.manual_seed(seed)
    x = torch.randn(shape, device=DEVICE, dtype=dtype)
    assert_matches_reference(scan_lib.cumsum(x, dim=dim), x, dim)


@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize("block", [16, 64])
def test_awkward_lengths_through_many_blocks(algorithm, block):
    """Blocks of 16 cut 4097 values into 257 tiles: a long look-back chain, or 257 totals scanned in chunks."""
    torch.manual_seed(block)
    for n in AWKWARD_LENGTHS:
        x = torch.randn(1, n, device=DEVICE)
        assert_matches_reference(scan_rows(x, algorithm=algorithm, block=block), x, -1)


@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize("window", [1, 2, 32])
def test_rows_do_not_leak_into_each_other(algorithm, window):
    """Rows with very different sums: a look-back that crossed a row start would be far off."""
    torch.manual_seed(window)
    x = torch.randn(5, 300, device=DEVICE) + 1000 * torch.arange(5, device=DEVICE)[:, None]
    assert_matches_reference(scan_rows(x, algorithm=algorithm, block=16, window=window), x, -1)


@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_both_algorithms_in_every_dtype(algorithm, dtype):
    """float64 always takes reduce_then_scan (its sum does not fit in a state word), and stays exact to 1e-12."""
    torch.manual_seed(9)
    x = torch.randn(3, 1000, device=DEVICE, dtype=dtype)
    assert_matches_reference(scan_rows(x, algorithm=algorithm, block=64), x, -1)


def test_reverse_order_of_pass_three():
    torch.manual_seed(10)
    x = torch.randn(2, 1000, device=DEVICE)
    for reverse in (False, True):
        assert_matches_reference(scan_rows(x, algorithm="reduce_then_scan", block=16, reverse=reverse), x, -1)


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_config_switches_the_public_function(algorithm, monkeypatch):
    monkeypatch.setitem(CONFIG, "algorithm", algorithm)
    monkeypatch.setitem(CONFIG, "block", 32)
    torch.manual_seed(11)
    x = torch.randn(4, 500, device=DEVICE)
    assert_matches_reference(scan_lib.cumsum(x, dim=1), x, 1)


# Under the interpreter every look-back finds its predecessor's PREFIX at once, so the walk over
# aggregates is tested here on hand-made snapshots of the state words, as a GPU might leave them.

@triton.jit
def look_back_probe_kernel(STATE, OUT, tile, first, WINDOW: tl.constexpr):
    tl.store(OUT, look_back(STATE, tile, first, WINDOW))


def pack_words(flags: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """State words as the kernel's pack_state writes them: flag << 32 | float32 bits of value."""
    return flags.to(torch.int64) << 32 | (values.float().view(torch.int32).to(torch.int64) & 0xFFFFFFFF)


def probe_look_back(words: torch.Tensor, tile: int, first: int, window: int) -> float:
    out = torch.empty(1, device=DEVICE)
    look_back_probe_kernel[(1,)](words.to(DEVICE), out, tile, first, WINDOW=window)
    return out.item()


@pytest.mark.parametrize("window", [1, 2, 8, 64])
def test_look_back_on_snapshots(window):
    rng = random.Random(window)
    totals = torch.tensor([float(rng.randint(-9, 9)) for _ in range(50)])   # integers: exact in float32
    flags = torch.ones(50, dtype=torch.int64)                                # AGGREGATE ...
    prefix_tile = 7
    flags[prefix_tile] = 2                                                   # ... one PREFIX
    values = totals.clone()
    values[prefix_tile] = totals[: prefix_tile + 1].sum()
    words = pack_words(flags, values)
    for tile, first in ((49, 0), (8, 0), (30, 10), (10, 10), (49, 40)):
        expected = totals[first:tile].sum().item()
        assert probe_look_back(words, tile, first, window) == expected, (tile, first)


def test_state_word_layout():
    assert pack_words(torch.tensor([2]), torch.tensor([-1.5])).item() == (2 << 32) | 0xBFC00000


def test_default_blocks_on_long_rows():
    n = 2**22 + 3 if ON_GPU else 3 * 1024 + 5
    torch.manual_seed(1)
    x = torch.randn(n, device=DEVICE)
    assert_matches_reference(scan_lib.cumsum(x), x, -1)


def test_many_short_rows_share_a_program():
    torch.manual_seed(2)
    x = torch.randn(300, 5, device=DEVICE)
    assert_matches_reference(scan_lib.cumsum(x, dim=1), x, 1)


def test_nonnegative_inputs_grow_monotonically():
    torch.manual_seed(3)
    y = scan_lib.cumsum(torch.rand(3, 1000, device=DEVICE), dim=1)
    assert (y[:, 1:] >= y[:, :-1]).all()


@pytest.mark.parametrize("shape,dim", [((0,), 0), ((3, 0), 1), ((0, 5), 0), ((0, 5), 1)])
def test_empty_tensors(shape, dim):
    x = torch.empty(shape, device=DEVICE)
    y = scan_lib.cumsum(x, dim=dim)
    assert y.shape == x.shape and y.dtype == x.dtype


def test_size_one_dims_are_the_identity():
    torch.manual_seed(4)
    x = torch.randn(4, 1, 5, device=DEVICE)
    assert torch.equal(scan_lib.cumsum(x, dim=1), x)
    assert_matches_reference(scan_lib.cumsum(x, dim=2), x, 2)


@pytest.mark.parametrize("view", ["transpose", "step", "expand"])
def test_non_contiguous_input(view):
    torch.manual_seed(5)
    base = torch.randn(40, 60, device=DEVICE)
    x = {"transpose": base.t(), "step": base[:, ::3], "expand": base[:1].expand(7, 60)}[view]
    assert not x.is_contiguous()
    for dim in (0, 1):
        assert_matches_reference(scan_lib.cumsum(x, dim=dim), x, dim)


def test_input_is_not_modified():
    torch.manual_seed(6)
    x = torch.randn(3, 100, device=DEVICE)
    before = x.clone()
    scan_lib.cumsum(x)
    assert torch.equal(x, before)


@pytest.mark.parametrize("dim", [0, 1])
def test_gradcheck(dim):
    torch.manual_seed(7)
    x = torch.randn(4, 5, device=DEVICE, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda t: scan_lib.cumsum(t, dim=dim), (x,), fast_mode=False)


def test_gradient_matches_torch_in_float32():
    torch.manual_seed(8)
    x = torch.randn(3, 200, device=DEVICE, requires_grad=True)
    weights = torch.randn(3, 200, device=DEVICE)
    (ours,) = torch.autograd.grad((scan_lib.cumsum(x, dim=1) * weights).sum(), x)
    (theirs,) = torch.autograd.grad((torch.cumsum(x, dim=1) * weights).sum(), x)
    assert torch.allclose(ours, theirs, atol=1e-4)


@pytest.mark.parametrize("call,error,words", [
    (lambda: scan_lib.cumsum([1.0, 2.0]), TypeError, "x must be a torch.Tensor"),
    (lambda: scan_lib.cumsum(torch.ones(4, device=DEVICE, dtype=torch.complex64)), TypeError, "x must be a floating"),
    (lambda: scan_lib.cumsum(torch.ones(2, 3, device=DEVICE), dim=2), IndexError, r"range of \[-2, 1\], but got 2"),
    (lambda: scan_lib.cumsum(torch.ones(2, 3, device=DEVICE), dim=-3), IndexError, "Dimension out of range"),
    (lambda: scan_lib.cumsum(torch.tensor(1.0, device=DEVICE), dim=1), IndexError, r"range of \[-1, 0\]"),
    (lambda: scan_lib.cumsum(torch.ones(2, 3, device=DEVICE), dim=1.0), TypeError, "dim must be an int"),
    (lambda: scan_lib.cumsum(torch.ones(2, 3, device=DEVICE), dim=True), TypeError, "dim must be an int"),
    (lambda: scan_lib.cumsum(torch.ones(3, device=DEVICE), dtype=torch.bool), TypeError, "dtype must be None or one of"),
    (lambda: scan_lib.cumsum(torch.ones(3, device=DEVICE), dtype="float32"), TypeError, "dtype must be None or one of"),
    (lambda: scan_lib.cumsum(torch.ones(3, device=DEVICE), 0, torch.float64), TypeError, "positional"),
    (lambda: scan_lib.cumsum(torch.ones(2, 3, device="meta")), ValueError, "x must be"),
    (lambda: scan_rows(torch.ones(2, 3, device=DEVICE), block=24), ValueError, "block must be a power of two"),
    (lambda: scan_rows(torch.ones(2, 3, device=DEVICE), block=8), ValueError, "block must be a power of two"),
    (lambda: scan_rows(torch.ones(2, 3, device=DEVICE), window=3), ValueError, "window must be a power of two"),
    (lambda: scan_rows(torch.ones(2, 3, device=DEVICE), algorithm="chained"), ValueError, "algorithm must be"),
    (lambda: scan_rows(torch.ones(2, 3, device=DEVICE), max_block=16), TypeError, "unknown scan option"),
    (lambda: cs.scan_columns(torch.ones(2, 3, 4, device=DEVICE), tile=24), ValueError, "tile must be a power of two"),
    (lambda: cs.scan_columns(torch.ones(2, 3, 4, device=DEVICE), tile=8), ValueError, "tile must be a power of two"),
])
def test_bad_input(call, error, words):
    with pytest.raises(error, match=words):
        call()


@pytest.mark.skipif(not ON_GPU, reason="needs a GPU: on the CPU interpreter, CPU tensors are the right ones")
def test_cpu_tensor_rejected_on_gpu():
    with pytest.raises(ValueError, match="x must be CUDA"):
        scan_lib.cumsum(torch.ones(8))


# The interpreter folds tl.associative_scan left to right, so a non-associative combine function
# passes every kernel test on the CPU. Associativity is therefore checked here, in plain PyTorch,
# on the very Python function the kernels use (add_combine.fn).

def is_associative(op, samples: int = 1000, seed: int = 0) -> bool:
    """op(op(a, b), c) == op(a, op(b, c)) on random integer-valued float64 triples (exact, no rounding)."""
    generator = torch.Generator().manual_seed(seed)
    a, b, c = torch.randint(-1000, 1000, (3, samples), generator=generator).double()
    return torch.equal(op(op(a, b), c), op(a, op(b, c)))


def test_add_combine_is_associative_with_identity_zero():
    op = add_combine.fn
    assert is_associative(op)
    x = torch.randn(100, dtype=torch.float64)
    assert torch.equal(op(torch.zeros_like(x), x), x) and torch.equal(op(x, torch.zeros_like(x)), x)


@pytest.mark.parametrize("name,op", [
    ("subtraction", lambda a, b: a - b),
    ("average", lambda a, b: (a + b) / 2),
    ("right-weighted sum", lambda a, b: a + 2 * b),
])
def test_property_test_detects_non_associative_operators(name, op):
    assert not is_associative(op), name


# Autograd as users meet it: second derivatives, in-place edits of the output, NaN and inf.

@pytest.mark.parametrize("dim", [0, 1])
def test_second_derivative_matches_torch(dim):
    """The backward is the public cumsum, so a gradient of a gradient is a scan too (not silently zero)."""
    torch.manual_seed(12)
    x = torch.randn(4, 6, device=DEVICE, dtype=torch.float64, requires_grad=True)
    grads = []
    for fn in (scan_lib.cumsum, torch.cumsum):
        (g,) = torch.autograd.grad((fn(x, dim=dim) ** 3).sum(), x, create_graph=True)
        grads.append(torch.autograd.grad((g ** 2).sum(), x)[0])
    torch.testing.assert_close(*grads, rtol=1e-12, atol=1e-12)


def test_second_derivatives_through_torch_func_reverse_mode_only():
    """What the README promises: torch.func's reverse-mode transforms nest (grad of grad, jacrev of
    jacrev) and match torch.cumsum; forward mode (torch.func.jvp, and so torch.func.hessian, which is
    jacfwd of jacrev) has no rule and raises."""
    x = torch.randn(5, device=DEVICE, dtype=torch.float64)
    loss = lambda fn: lambda y: (fn(y, dim=0) ** 3).sum()  # noqa: E731
    ours, theirs = (torch.func.jacrev(torch.func.jacrev(loss(fn)))(x) for fn in (scan_lib.cumsum, torch.cumsum))
    torch.testing.assert_close(ours, theirs, rtol=1e-12, atol=1e-12)
    grad_of_grad = lambda fn: torch.func.grad(lambda y: torch.func.grad(loss(fn))(y).sum())(x)  # noqa: E731
    torch.testing.assert_close(grad_of_grad(scan_lib.cumsum), grad_of_grad(torch.cumsum), rtol=1e-12, atol=1e-12)
    with pytest.raises(NotImplementedError, match="jvp"):
        torch.func.hessian(loss(scan_lib.cumsum))(x)


@pytest.mark.parametrize("dim", [0, 1])
def test_output_may_be_modified_in_place_under_autograd(dim):
    x = torch.randn(3, 5, device=DEVICE, requires_grad=True)
    y = scan_lib.cumsum(x, dim=dim)
    y.mul_(2)
    y[0] = 0.0
    (ours,) = torch.autograd.grad(y.sum(), x)
    reference = torch.cumsum(x, dim=dim) * 2
    reference[0] = 0.0
    (theirs,) = torch.autograd.grad(reference.sum(), x)
    torch.testing.assert_close(y, reference)
    torch.testing.assert_close(ours, theirs)


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_nan_and_inf_propagate_like_torch(algorithm):
    """NaN and +-inf pass through both algorithms' carries (state words, block totals) as in torch.cumsum."""
    torch.manual_seed(13)
    x = torch.randn(4, 200, device=DEVICE)
    inf, nan = float("inf"), float("nan")
    x[0, 5], x[1, 100], x[2, 10], x[2, 150], x[3, 199] = nan, inf, inf, -inf, nan   # row 2: inf - inf = nan
    y, reference = scan_rows(x, algorithm=algorithm, block=16), torch.cumsum(x.double(), dim=1)
    assert torch.equal(y.isnan(), reference.isnan()) and torch.equal(y.isinf(), reference.isinf())
    infinite, finite = reference.isinf(), reference.isfinite()
    assert torch.equal(y[infinite].sign().double(), reference[infinite].sign())
    torch.testing.assert_close(y[finite].double(), reference[finite], rtol=1e-5, atol=1e-4)


def test_no_graph_under_no_grad_and_inference_mode():
    x = torch.randn(2, 9, device=DEVICE, requires_grad=True)
    with torch.no_grad():
        assert not scan_lib.cumsum(x).requires_grad
    with torch.inference_mode():
        y = scan_lib.cumsum(x, dim=0)
    assert y.is_inference() and not y.requires_grad
    assert_matches_reference(y, x.detach(), 0)


# Behaving like torch.cumsum: dtypes, shapes, layout.

@pytest.mark.parametrize("dtype", [torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64])
@pytest.mark.parametrize("dim", [0, 1, -1])
def test_integer_and_bool_inputs_sum_to_int64_like_torch(dtype, dim):
    torch.manual_seed(20)
    if dtype == torch.bool:
        x = torch.rand(3, 1000, device=DEVICE) < 0.5
    else:
        info = torch.iinfo(dtype)
        x = torch.randint(max(info.min, -2**40), min(info.max, 2**40), (3, 1000), device=DEVICE, dtype=dtype)
    y = scan_lib.cumsum(x, dim=dim)
    assert y.dtype == torch.int64 and torch.equal(y, torch.cumsum(x, dim))


def test_int64_sums_are_exact_and_wrap_like_torch():
    """int64 totals beyond 2^53 (inexact in float64) and beyond 2^63 (wrapping), through many blocks."""
    x = torch.full((2, 600), 2**61 + 1, device=DEVICE, dtype=torch.int64)
    for algorithm in ALGORITHMS:                       # int64 always takes reduce_then_scan on long rows
        assert torch.equal(scan_rows(x, algorithm=algorithm, block=16), torch.cumsum(x, 1))


@pytest.mark.parametrize("source,dtype", [
    (torch.float16, torch.float32), (torch.float32, torch.float64), (torch.float64, torch.float16),
    (torch.int32, torch.float32), (torch.float32, torch.int32), (torch.int64, torch.int8), (torch.bool, torch.int16),
])
def test_dtype_argument_casts_first_like_torch(source, dtype):
    torch.manual_seed(21)
    x = (torch.randn(4, 300, device=DEVICE) * 50).to(source)
    y, expected = scan_lib.cumsum(x, dim=1, dtype=dtype), torch.cumsum(x, 1, dtype=dtype)
    assert y.dtype == dtype
    if dtype.is_floating_point:
        assert_matches_reference(y, x.to(dtype), 1)
    else:
        assert torch.equal(y, expected)


@pytest.mark.parametrize("dim", [0, -1])
@pytest.mark.parametrize("dtype", [torch.float32, torch.int32, torch.bool])
def test_zero_dim_tensor_gives_a_copy_like_torch(dim, dtype):
    x = torch.tensor(3, device=DEVICE).to(dtype)
    y = scan_lib.cumsum(x, dim=dim)
    expected = torch.cumsum(x, dim)
    assert y.shape == () and y.dtype == expected.dtype and torch.equal(y, expected)
    assert y.data_ptr() != x.data_ptr()


@pytest.mark.parametrize("shape,dim", [((6, 7), 0), ((2, 3, 4), 1), ((5, 1, 3), 0), ((3, 0, 2), 0)])
def test_result_is_contiguous_with_the_input_shape(shape, dim):
    torch.manual_seed(22)
    x = torch.randn(shape, device=DEVICE)
    y = scan_lib.cumsum(x, dim=dim)
    assert y.shape == x.shape and y.is_contiguous()
    assert y.view(-1).shape == (x.numel(),)
    assert_matches_reference(y, x, dim) if x.numel() else None


def test_result_is_not_a_view_of_the_input():
    x = torch.randn(4, 1, device=DEVICE)
    y = scan_lib.cumsum(x, dim=1)
    y.add_(1.0)
    assert not torch.equal(x, y)


# Autograd, torch.func and torch.compile.

def test_gradcheck_and_gradgradcheck_in_full_mode():
    torch.manual_seed(23)
    x = torch.randn(2, 3, 2, device=DEVICE, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda t: scan_lib.cumsum(t, dim=1), (x,), fast_mode=False)
    assert torch.autograd.gradgradcheck(lambda t: scan_lib.cumsum(t, dim=2), (x,), fast_mode=False)


def test_hessian_matches_torch():
    torch.manual_seed(24)
    x = torch.randn(2, 5, device=DEVICE, dtype=torch.float64)
    hessians = [torch.autograd.functional.hessian(lambda t: (fn(t, dim=1) ** 3).sum(), x)
                for fn in (scan_lib.cumsum, torch.cumsum)]
    assert hessians[1].abs().max() > 0
    torch.testing.assert_close(*hessians, rtol=1e-12, atol=1e-12)


def test_dtype_argument_keeps_the_gradient():
    x = torch.randn(3, 20, device=DEVICE, dtype=torch.float32, requires_grad=True)
    (ours,) = torch.autograd.grad(scan_lib.cumsum(x, dim=1, dtype=torch.float64).pow(2).sum(), x)
    (theirs,) = torch.autograd.grad(torch.cumsum(x, 1, dtype=torch.float64).pow(2).sum(), x)
    torch.testing.assert_close(ours, theirs)


def test_torch_func_grad_and_vmap():
    torch.manual_seed(25)
    x = torch.randn(4, 6, device=DEVICE, dtype=torch.float64)
    loss = lambda fn: (lambda t: (fn(t, dim=0) ** 2).sum())  # noqa: E731
    torch.testing.assert_close(torch.func.grad(loss(scan_lib.cumsum))(x), torch.func.grad(loss(torch.cumsum))(x))
    for in_dims in (0, 1):
        ours = torch.func.vmap(lambda t: scan_lib.cumsum(t, dim=0), in_dims=in_dims)(x)
        theirs = torch.func.vmap(lambda t: torch.cumsum(t, 0), in_dims=in_dims)(x)
        torch.testing.assert_close(ours, theirs)
    per_row = torch.func.vmap(torch.func.grad(loss(scan_lib.cumsum)))(x)
    torch.testing.assert_close(per_row, torch.func.vmap(torch.func.grad(loss(torch.cumsum)))(x))


def check_compiled_along_dim_1(x):
    """torch.compile(fullgraph=True) of cumsum along dim 1: the values and the gradient against torch.cumsum's."""
    compiled = torch.compile(lambda t: scan_lib.cumsum(t, dim=1) * 2, fullgraph=True, backend="aot_eager")
    y = compiled(x)
    (ours,) = torch.autograd.grad(y.pow(2).sum(), x)
    (theirs,) = torch.autograd.grad((torch.cumsum(x, 1) * 2).pow(2).sum(), x)
    assert_matches_reference(y.detach() / 2, x.detach(), 1)
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-3)


def test_torch_compile_fullgraph():
    torch.manual_seed(26)
    check_compiled_along_dim_1(torch.randn(3, 40, device=DEVICE, requires_grad=True))
    integers = torch.randint(0, 9, (2, 30), device=DEVICE)
    compiled_int = torch.compile(lambda t: scan_lib.cumsum(t, dim=0), fullgraph=True, backend="aot_eager")
    assert torch.equal(compiled_int(integers), torch.cumsum(integers, 0))


def test_fake_tensor_gives_shape_and_dtype():
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode():
        y = torch.ops.scan_lib.cumsum(torch.empty(3, 5, 2), -2)
    assert y.shape == (3, 5, 2) and y.dtype == torch.float32 and y.is_contiguous()


# Along a dim but the last: the column scan, which reads x in place (scan_columns), and the dispatch
# between it and the copy path (takes_columns, as_columns).

def assert_cumsum_like_torch(y: torch.Tensor, x: torch.Tensor, dim: int) -> None:
    """Integers (summed to int64) exactly, floats within the tolerance."""
    if x.is_floating_point():
        assert_matches_reference(y, x, dim)
    else:
        expected = torch.cumsum(x, dim)
        assert y.dtype == expected.dtype and torch.equal(y, expected)


def awkward_input(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Random values in dtype: about unit size for floats, up to 2^40 for int64, 0/1 for bool."""
    if dtype == torch.bool:
        return torch.rand(shape, device=DEVICE) < 0.5
    if dtype.is_floating_point:
        return torch.randn(shape, device=DEVICE).to(dtype)
    info = torch.iinfo(dtype)
    return torch.randint(max(info.min, -2**40), min(info.max, 2**40), shape, device=DEVICE, dtype=dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64])
@pytest.mark.parametrize("shape", [(3, 37, 5), (2, 3, 19, 17)])
def test_scan_columns_along_every_dim(shape, dtype):
    """Tiles of 64 values: up to 16 columns by 4 rows, so that 17 columns take two column blocks and 19
    or 37 rows several tiles, each adding the carry of those before."""
    torch.manual_seed(30)
    x = awkward_input(shape, dtype)
    for dim in range(len(shape)):
        y = cs.scan_columns(cs.as_columns(x, dim), tile=64).view(shape)
        assert y.is_contiguous()
        assert_cumsum_like_torch(y, x, dim)


@pytest.mark.parametrize("view", ["step", "expand", "outer transpose", "offset"])
def test_scan_columns_reads_views_at_their_strides(view):
    torch.manual_seed(31)
    base = torch.randn(6, 37, 40, device=DEVICE)
    x = {"step": base[::2, :, 3::7],                                      # strides (2960, 40, 7)
         "expand": base[:1, :, :5].expand(3, 37, 5),                      # strides (0, 40, 1)
         "outer transpose": base.transpose(0, 1),                         # (37, 6, 40), strides (40, 1480, 1)
         "offset": base[1:, 2:, 4:]}[view]                                # a storage offset
    columns = cs.as_columns(x, 1)
    assert columns is not None and not columns.is_contiguous()
    assert_matches_reference(cs.scan_columns(columns, tile=64).view(x.shape), x, 1)


def test_as_columns_needs_one_stride_on_each_side():
    x = torch.empty(4, 5, 6, 7, device=DEVICE)
    assert cs.as_columns(x, -2).stride() == (42, 7, 1)                    # 20 x 6 x 7
    assert cs.as_columns(x[::2], 1).stride() == (420, 42, 1)              # 2 x 5 x 42: a step before dim 1
    assert cs.as_columns(x.transpose(0, 1), 2) is None                    # before dim 2: (5, 4) in the wrong order
    assert cs.as_columns(x.transpose(2, 3), 0) is None                    # after dim 0: (7, 6) in the wrong order
    assert cs.as_columns(x[:, :, :, ::2], 1) is None                      # after dim 1: a step in the last dim


def test_as_columns_checks_strides_instead_of_letting_view_raise(monkeypatch):
    """as_columns agrees with x.view (None exactly where it raises) without calling a view that raises:
    the exception costs tens of microseconds of host time, more than a launch."""
    base = torch.empty(4, 5, 6, 7, device=DEVICE)
    views = [base, base[::2], base[1:3], base[:, ::2], base[:, :, 1:], base[..., ::3], base.transpose(0, 1),
             base.transpose(2, 3), base.permute(3, 2, 1, 0), base[:1].expand(3, 5, 6, 7),
             base[:, :1].expand(4, 2, 6, 7), base[..., :1].expand(4, 5, 6, 2),
             base[:, :1, :, :1].as_strided((4, 1, 6, 1), (210, 12345, 7, 999)),   # size-1 dims, odd strides
             torch.zeros(()).expand(3, 4, 5)]                                    # every stride 0
    expected = {}
    for i, x in enumerate(views):
        for dim in range(x.dim()):
            try:
                expected[i, dim] = x.view(x.shape[:dim].numel(), x.shape[dim], x.shape[dim + 1:].numel()).stride()
            except RuntimeError:
                expected[i, dim] = None
    raised = []

    def view(self, *args, _view=torch.Tensor.view):
        try:
            return _view(self, *args)
        except RuntimeError:
            raised.append(tuple(self.shape))
            raise
    monkeypatch.setattr(torch.Tensor, "view", view)
    for (i, dim), strides in expected.items():
        columns = cs.as_columns(views[i], dim)
        assert (None if columns is None else columns.stride()) == strides, (i, dim)
        assert columns is None or columns.data_ptr() == views[i].data_ptr()
    assert None in expected.values() and not raised, raised


def test_takes_columns_only_with_fewer_programs_than_a_grid_holds():
    """(2^31, 1, 2) along dim 1: one tile, but 2^31 programs, one past CUDA's grid limit of 2^31 - 1."""
    assert cs.takes_columns(2**31 - 1, 1, 2) and not cs.takes_columns(2**31, 1, 2)
    assert cs.takes_columns(2**29, 1, 32) and not cs.takes_columns(2**30, 1, 32)   # 2 column blocks each


@pytest.fixture
def paths(monkeypatch):
    """Records which launcher cumsum_op calls (scan_columns or scan_rows) and every Tensor.contiguous
    and Tensor.clone on the way: the copies of the copy path."""
    taken = []
    for name in ("scan_columns", "scan_rows"):
        launcher = getattr(cs, name)
        monkeypatch.setattr(cs, name, lambda *args, _name=name, _launcher=launcher, **kwargs:
                            taken.append(_name) or _launcher(*args, **kwargs))
    for name in ("contiguous", "clone"):
        method = getattr(torch.Tensor, name)
        monkeypatch.setattr(torch.Tensor, name, lambda self, *args, _name=name, _method=method, **kwargs:
                            taken.append(_name) or _method(self, *args, **kwargs))
    return taken


@pytest.mark.parametrize("dim", [0, 1, -2])
def test_column_scan_reads_in_place_with_no_copy(dim, paths):
    """A non-contiguous (4, 30, 24) view (every other slab of (8, 30, 24)) along a dim but the last: one
    launch of the column scan, and neither the copy into rows (contiguous) nor the copy back (clone) that
    the copy path makes."""
    torch.manual_seed(32)
    x = torch.randn(8, 30, 24, device=DEVICE)[::2]
    y = scan_lib.cumsum(x, dim=dim)
    assert paths == ["scan_columns"], paths
    assert y.is_contiguous()
    assert_matches_reference(y, x, dim)


@pytest.mark.parametrize("shape,dim,path", [
    ((2, 300, 32), 1, "scan_columns"),         # 64 columns, MIN_COLUMNS here: enough programs
    ((1, 300, 32), 1, "scan_rows"),            # 32 columns and 300 rows, more than one tile (256 rows)
    ((1, 256, 32), 1, "scan_columns"),         # 32 columns, but 256 rows: one tile, no program walks
    ((64, 300, 1), 1, "scan_rows"),            # inner == 1: rows already
    ((300, 64), -1, "scan_rows"),              # the last dim
])
def test_threshold_picks_the_path(shape, dim, path, paths, monkeypatch):
    monkeypatch.setattr(cs, "MIN_COLUMNS", 64)
    torch.manual_seed(33)
    x = torch.randn(shape, device=DEVICE)
    y = scan_lib.cumsum(x, dim=dim)
    assert path in paths and {"scan_columns", "scan_rows"} - {path} - set(paths), paths
    assert_matches_reference(y, x, dim)


@pytest.mark.parametrize("view", ["transpose, last dim", "no single stride"])
def test_copy_path_where_the_column_scan_cannot_read_the_view(view, paths):
    """The last dim of a transposed matrix (inner == 1), and dims after dim 0 that share no stride."""
    torch.manual_seed(34)
    x, dim = {"transpose, last dim": (torch.randn(40, 30, device=DEVICE).t(), 1),
              "no single stride": (torch.randn(3, 7, 5, device=DEVICE).transpose(1, 2), 0)}[view]
    y = scan_lib.cumsum(x, dim=dim)
    assert "scan_rows" in paths and "scan_columns" not in paths and "contiguous" in paths, paths
    assert y.is_contiguous()
    assert_matches_reference(y, x, dim)


@pytest.mark.parametrize("shape,dim,step", [((64, 300, 1), 1, 1), ((64, 300, 1), 1, 2),
                                             ((5, 3, 300, 1, 1), -3, 1), ((300, 1), 0, 1)])
def test_copy_path_copies_back_only_where_the_result_is_not_rows(shape, dim, step, paths):
    """With only size-1 dims after dim (inner == 1), the contiguous result in x's shape is rows already:
    the row kernels write it directly, with no copy back (clone). A strided x is still copied into rows."""
    torch.manual_seed(40)
    x = torch.randn((shape[0] * step,) + shape[1:], device=DEVICE)[::step]
    y = scan_lib.cumsum(x, dim=dim)
    assert "scan_rows" in paths and "scan_columns" not in paths and "clone" not in paths, paths
    assert y.is_contiguous() and y._base is None
    assert_matches_reference(y, x, dim)


@pytest.mark.parametrize("dtype", [torch.bool, torch.int8, torch.int32, torch.int64, torch.float16,
                                   torch.bfloat16, torch.float32, torch.float64])
def test_every_dim_of_awkward_views_like_torch(dtype):
    """The public function along every dim (column scan, copy path, rows) of a 4-D tensor, a permuted
    view of it and a view with steps."""
    torch.manual_seed(35)
    base = awkward_input((3, 5, 19, 4), dtype)
    for x in (base, base.permute(2, 0, 3, 1), base[:, ::2, 1::3]):
        for dim in range(4):
            assert_cumsum_like_torch(scan_lib.cumsum(x, dim=dim), x, dim)


@pytest.mark.parametrize("source,dtype", [(torch.float16, torch.float32), (torch.float32, torch.float64),
                                          (torch.int32, torch.int8), (torch.bool, torch.int16)])
def test_dtype_argument_along_a_middle_dim(source, dtype, paths):
    torch.manual_seed(36)
    x = (torch.randn(3, 37, 6, device=DEVICE) * 50).to(source)[:, :, ::2]
    y, expected = scan_lib.cumsum(x, dim=1, dtype=dtype), torch.cumsum(x, 1, dtype=dtype)
    assert y.dtype == dtype and "scan_columns" in paths
    if dtype.is_floating_point:
        assert_matches_reference(y, x.to(dtype), 1)
    else:
        assert torch.equal(y, expected)


def test_gradcheck_along_a_middle_dim(paths):
    """The backward scans the flipped gradient (a copy, so contiguous) along the same dim: the column scan too."""
    torch.manual_seed(37)
    x = torch.randn(2, 5, 3, device=DEVICE, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda t: scan_lib.cumsum(t, dim=1), (x,), fast_mode=False)
    assert torch.autograd.gradgradcheck(lambda t: scan_lib.cumsum(t, dim=-3), (x[:, :2].detach().requires_grad_(),))
    assert "scan_rows" not in paths


@pytest.mark.parametrize("in_dims", [0, 1, 2])
def test_vmap_along_a_middle_dim(in_dims):
    """The batch dim moved to the front by the vmap rule: a view the column scan reads in place, or not."""
    torch.manual_seed(38)
    x = torch.randn(4, 5, 6, device=DEVICE)
    ours = torch.func.vmap(lambda t: scan_lib.cumsum(t, dim=0), in_dims=in_dims)(x)
    theirs = torch.func.vmap(lambda t: torch.cumsum(t, 0), in_dims=in_dims)(x)
    torch.testing.assert_close(ours, theirs)


def test_compile_along_a_middle_dim():
    torch.manual_seed(39)
    check_compiled_along_dim_1(torch.randn(3, 20, 18, device=DEVICE, requires_grad=True))


@pytest.mark.skipif(not ON_GPU or torch.cuda.get_device_properties(0).total_memory < 24 * 2**30,
                    reason="a float16 tensor of 2^31 + 16384 values and its result need a GPU with 24 GB")
def test_columns_past_2_31_values_are_indexed_in_64_bits():
    """Position t of the column scan is at t * 16384 values: past 2^31 for the last row of (2^17 + 1, 16384).
    A 32-bit offset would write the last row's sums over the first rows."""
    x = torch.zeros(2**17 + 1, 16384, dtype=torch.float16, device=DEVICE)
    x[-1, 5] = 1.0
    x[0, 7] = 1.0
    assert cs.takes_columns(*cs.as_columns(x, 0).shape)
    y = scan_lib.cumsum(x, dim=0)
    assert y[-1, 5].item() == 1.0 and y[-2, 5].item() == 0.0 and y[-1, 7].item() == 1.0
    assert y[0].sum().item() == 1.0 and y[:, 5].sum().item() == 1.0


# Injected bugs: each check must fail on the bug it guards against.

class NoOpLaunch:
    """Stands in for a kernel: `kernel[grid](...)` runs `effect` on the arguments instead."""
    def __init__(self, effect):
        self.effect = effect

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.effect(*args)


def test_check_catches_a_skipped_carry(monkeypatch):
    """Pass 2 replaced by zeros: every block after the first misses its carry."""
    torch.manual_seed(27)
    x = torch.randn(2, 1000, device=DEVICE)
    monkeypatch.setattr(cs, "scan_totals_kernel", NoOpLaunch(lambda totals, *rest: totals.zero_()))
    y = scan_rows(x, algorithm="reduce_then_scan", block=64)
    with pytest.raises(AssertionError, match="scaled error"):
        assert_matches_reference(y, x, -1)


def test_check_catches_carries_that_are_not_scanned(monkeypatch):
    """Pass 2 skipped: block k adds only T_{k-1} instead of S_{k-1}."""
    torch.manual_seed(28)
    x = torch.rand(2, 1000, device=DEVICE)
    monkeypatch.setattr(cs, "scan_totals_kernel", NoOpLaunch(lambda totals, *rest: None))
    with pytest.raises(AssertionError, match="scaled error"):
        assert_matches_reference(scan_rows(x, algorithm="reduce_then_scan", block=64), x, -1)


def test_tolerance_catches_float16_accumulation(monkeypatch):
    """A kernel that adds float16 values in float16 (instead of float32) fails the float16 tolerance;
    the real kernels pass it on the same input."""
    torch.manual_seed(29)
    x = torch.rand(1, 2049, device=DEVICE).half()                 # positive: the partial sums grow
    assert_matches_reference(scan_rows(x, algorithm="reduce_then_scan", block=16), x, -1)
    monkeypatch.setattr(cs, "accumulator", lambda dtype: dtype)
    monkeypatch.setattr(cs, "tl_dtype", lambda dtype: {torch.float16: tl.float16}.get(dtype, tl.float32))
    with pytest.raises(AssertionError, match="scaled error"):
        assert_matches_reference(scan_rows(x, algorithm="reduce_then_scan", block=16), x, -1)


@triton.jit
def look_back_past_row_start_kernel(STATE, OUT, tile, first, WINDOW: tl.constexpr):
    """A look-back with the bug the row-start test guards against: it ignores `first` and walks to tile 0."""
    tl.store(OUT, look_back(STATE, tile, 0, WINDOW))


def test_snapshot_check_catches_a_look_back_past_its_row_start():
    totals = torch.arange(1.0, 51.0)
    words = pack_words(torch.ones(50, dtype=torch.int64), totals)           # all AGGREGATE
    out = torch.empty(1, device=DEVICE)
    look_back_past_row_start_kernel[(1,)](words.to(DEVICE), out, 30, 10, WINDOW=8)
    assert out.item() != totals[10:30].sum().item()
    assert probe_look_back(words, 30, 10, 8) == totals[10:30].sum().item()


@triton.jit
def subtract_combine(a, b):
    return a - b


@triton.jit
def scan_block_with_subtraction_kernel(X, Y, BLOCK: tl.constexpr):
    offsets = tl.arange(0, BLOCK)
    tl.store(Y + offsets, tl.associative_scan(tl.load(X + offsets), 0, subtract_combine))


@pytest.mark.skipif(not INTERPRET, reason="shows what the interpreter hides")
def test_property_test_catches_what_a_kernel_test_under_the_interpreter_cannot():
    """With a non-associative combine (subtraction), the interpreter's left fold gives exactly the
    sequential answer, so a kernel-against-reference check passes; only the property test fails."""
    x = torch.randn(64, dtype=torch.float64)
    y = torch.empty_like(x)
    scan_block_with_subtraction_kernel[(1,)](x, y, BLOCK=64)
    fold, expected = x[0].item(), [x[0].item()]
    for value in x[1:].tolist():
        fold = fold - value
        expected.append(fold)
    assert torch.allclose(y, torch.tensor(expected, dtype=torch.float64), rtol=0, atol=1e-12)
    assert not is_associative(subtract_combine.fn)


@pytest.mark.skipif(not ON_GPU or torch.cuda.get_device_properties(0).total_memory < 64 * 2**30,
                    reason="a row of 2^31 + 37 values and its int64 sums need a GPU with 64 GB")
def test_a_row_past_2_31_values_is_indexed_in_64_bits():
    """The long-row paths' column indices are 64-bit (reduce-then-scan for integers, the look-back for float32): a 32-bit one would wrap past position 2^31 and write
    the sums there over the row's start."""
    length = 2**31 + 37
    y = scan_lib.cumsum(torch.ones(1, length, dtype=torch.int8, device=DEVICE))   # int64 sums: reduce-then-scan
    for t in (0, 2**31 - 1, 2**31, length - 1):
        assert y[0, t].item() == t + 1, t
    del y
    x = torch.zeros(1, length, device=DEVICE)                                       # float32: the look-back path
    x[0, 2**31 + 5] = 1.0
    y = scan_lib.cumsum(x)
    assert y[0, 2**31 + 4].item() == 0.0 and y[0, 2**31 + 5].item() == 1.0 and y[0, -1].item() == 1.0
    assert y[0, :2**31].abs().max().item() == 0.0

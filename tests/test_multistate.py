"""scan_lib.multistate_scan against the float64 loop reference: random shapes and dtypes, initial and
last states, block sizes, every gradient (autograd through the loop, and gradcheck), bad input."""
import random

import pytest
import torch

import scan_lib
from scan_lib.multistate import MAX_STATES, multistate_scan_ref
from scan_lib.runtime import DEVICE

# Largest error allowed, relative to the largest |reference|. Accumulation is in fp32 (fp64 for fp64),
# so half precision is limited by one rounding of the output: 2^-8 (bf16) and 2^-11 (fp16) relative,
# 2^-7 for bf16 under the CPU interpreter, which truncates float32 to bfloat16.
TOLERANCE = {torch.float64: 1e-12, torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}
GRAD_TOLERANCE = {torch.float64: 1e-12, torch.float32: 1e-5, torch.float16: 4e-3, torch.bfloat16: 2e-2}


def make_inputs(batch, n_states, length, dtype, seed, requires_grad=False):
    """a in (0.5, 1) (a decaying gate, like exp(delta*A)); b, c, x, initial state standard normal."""
    g = torch.Generator().manual_seed(seed)
    a = 0.5 + 0.5 * torch.rand(batch, n_states, length, generator=g, dtype=torch.float64)
    b, c = (torch.randn(batch, n_states, length, generator=g, dtype=torch.float64) for _ in range(2))
    x = torch.randn(batch, length, generator=g, dtype=torch.float64)
    h0 = torch.randn(batch, n_states, generator=g, dtype=torch.float64)
    return [t.to(device=DEVICE, dtype=dtype).requires_grad_(requires_grad) for t in (a, b, c, x, h0)]


def rel_err(got, want):
    return ((got.double() - want.double()).abs().max() / want.double().abs().max().clamp_min(1e-30)).item()


def random_case(seed):
    rng = random.Random(seed)
    return rng.choice((1, 2, 3)), rng.choice((1, 3, 16, 17)), rng.choice((1, 7, 129, 1000)), rng.random() < 0.5


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("seed", range(3))
def test_random_shapes_and_dtypes(dtype, seed):
    batch, n_states, length, with_h0 = random_case(seed)
    a, b, c, x, h0 = make_inputs(batch, n_states, length, dtype, seed)
    h0 = h0 if with_h0 else None
    y, last = scan_lib.multistate_scan(a, b, c, x, initial_state=h0, return_last_state=True)
    y_ref, last_ref = multistate_scan_ref(*(t.double() for t in (a, b, c, x)), None if h0 is None else h0.double())
    assert y.shape == (batch, length) and last.shape == (batch, n_states)
    assert y.dtype == last.dtype == dtype and y.device == a.device
    assert rel_err(y, y_ref) < TOLERANCE[dtype], (batch, n_states, length)
    assert rel_err(last, last_ref) < TOLERANCE[dtype], (batch, n_states, length)


@pytest.mark.parametrize("block_l", [2, 16, 64])
def test_block_sizes_and_a_long_sequence(block_l):
    for length in (1, 7, 129, 4097 if block_l >= 16 else 258):  # 258: 129 chunks of 2
        a, b, c, x, h0 = make_inputs(1, 3, length, torch.float64, seed=length)
        y, last = scan_lib.multistate_scan(a, b, c, x, h0, return_last_state=True, block_l=block_l)
        y_ref, last_ref = multistate_scan_ref(a, b, c, x, h0)
        assert rel_err(y, y_ref) < 1e-12 and rel_err(last, last_ref) < 1e-12, length


def test_default_block_len_handles_many_states():
    a, b, c, x, h0 = make_inputs(1, MAX_STATES, 40, torch.float32, seed=7)
    y_ref, _ = multistate_scan_ref(*(t.double() for t in (a, b, c, x)))
    assert rel_err(scan_lib.multistate_scan(a, b, c, x), y_ref) < 1e-5


@pytest.mark.parametrize("block_l", [16, 64])
@pytest.mark.parametrize("length", [1, 7, 129, 1000])
def test_every_gradient_matches_autograd_in_float64(length, block_l):
    a, b, c, x, h0 = make_inputs(2, 5, length, torch.float64, seed=length + block_l, requires_grad=True)
    dy = torch.randn(2, length, dtype=torch.float64, device=DEVICE)
    dlast = torch.randn(2, 5, dtype=torch.float64, device=DEVICE)
    inputs = (a, b, c, x, h0)
    got = torch.autograd.grad(scan_lib.multistate_scan(*inputs, return_last_state=True, block_l=block_l), inputs, (dy, dlast))
    want = torch.autograd.grad(multistate_scan_ref(*inputs), inputs, (dy, dlast))
    for name, g, w in zip(("a", "b", "c", "x", "initial_state"), got, want):
        assert rel_err(g, w) < 1e-12, name


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_gradients_in_lower_precision(dtype):
    inputs = make_inputs(2, 4, 100, dtype, seed=11, requires_grad=True)
    dy = torch.randn(2, 100, device=DEVICE).to(dtype)
    got = torch.autograd.grad(scan_lib.multistate_scan(*inputs[:4], initial_state=inputs[4], block_l=32), inputs, dy)
    exact = [t.detach().double().requires_grad_() for t in inputs]
    want = torch.autograd.grad(multistate_scan_ref(*exact)[0], exact, dy.double())
    for name, g, w in zip(("a", "b", "c", "x", "initial_state"), got, want):
        assert g.dtype == dtype, name
        assert rel_err(g, w) < GRAD_TOLERANCE[dtype], name


def test_gradcheck_through_both_outputs():
    inputs = make_inputs(1, 2, 5, torch.float64, seed=3, requires_grad=True)  # block_l=2: 3 chunks, one partial
    assert torch.autograd.gradcheck(lambda *t: scan_lib.multistate_scan(*t, return_last_state=True, block_l=2), inputs)


def test_gradcheck_without_initial_state_through_y_only():
    a, b, c, x, _ = make_inputs(1, 2, 5, torch.float64, seed=4, requires_grad=True)
    assert torch.autograd.gradcheck(lambda *t: scan_lib.multistate_scan(*t, block_l=4), (a, b, c, x))


def test_gradient_through_the_last_state_only():
    a, b, c, x, h0 = make_inputs(2, 3, 20, torch.float64, seed=5, requires_grad=True)
    _, last = scan_lib.multistate_scan(a, b, c, x, h0, return_last_state=True, block_l=8)
    got = torch.autograd.grad(last.sum(), (a, b, x, h0))
    want = torch.autograd.grad(multistate_scan_ref(a, b, c, x, h0)[1].sum(), (a, b, x, h0))
    for g, w in zip(got, want):
        assert rel_err(g, w) < 1e-12


def test_no_grad_and_grad_paths_agree():
    a, b, c, x, h0 = make_inputs(2, 4, 33, torch.float32, seed=6)
    with torch.no_grad():
        plain = scan_lib.multistate_scan(a, b, c, x, h0, block_l=16)
    tracked = scan_lib.multistate_scan(a.requires_grad_(), b, c, x, h0, block_l=16)
    assert tracked.requires_grad and not plain.requires_grad
    assert torch.equal(plain, tracked.detach())



@pytest.mark.parametrize("loss", ["y", "y_squared"])
def test_double_backward_raises(loss):
    """create_graph=True must fail loudly: once_differentiable alone let autograd.grad return only the
    x**3 term's second derivative, silently dropping the scan's."""
    a, b, c, x, _ = make_inputs(2, 3, 9, torch.float64, seed=7)
    x.requires_grad_(True)
    y = scan_lib.multistate_scan(a, b, c, x)
    total = (y if loss == "y" else y ** 2).sum() + (x ** 3).sum()
    with pytest.raises(RuntimeError, match="multistate_scan has no double backward"):
        torch.autograd.grad(total, x, create_graph=True)

def _bad_calls():
    a, b, c, x, h0 = make_inputs(2, 4, 9, torch.float32, seed=8)
    non_contiguous = a.transpose(1, 2).contiguous().transpose(1, 2)
    return {
        "a not a tensor": (lambda: scan_lib.multistate_scan(a.tolist(), b, c, x), TypeError, "a"),
        "b int64": (lambda: scan_lib.multistate_scan(a, b.long(), c, x), TypeError, "b"),
        "c float64": (lambda: scan_lib.multistate_scan(a, b, c.double(), x), TypeError, "c"),
        "initial_state float16": (lambda: scan_lib.multistate_scan(a, b, c, x, h0.half()), TypeError, "initial_state"),
        "a 2-D": (lambda: scan_lib.multistate_scan(a[0], b, c, x), ValueError, "a"),
        "b wrong N": (lambda: scan_lib.multistate_scan(a, b[:, :3].contiguous(), c, x), ValueError, "b"),
        "x wrong length": (lambda: scan_lib.multistate_scan(a, b, c, x[:, :4].contiguous()), ValueError, "x"),
        "x 3-D": (lambda: scan_lib.multistate_scan(a, b, c, x[..., None]), ValueError, "x"),
        "initial_state wrong shape": (lambda: scan_lib.multistate_scan(a, b, c, x, h0[:1]), ValueError, "initial_state"),
        "empty": (lambda: scan_lib.multistate_scan(a[..., :0], b[..., :0], c[..., :0], x[:, :0]), ValueError, "a"),
        "non-contiguous a": (lambda: scan_lib.multistate_scan(non_contiguous, b, c, x), ValueError, "a"),
        "block_l 24": (lambda: scan_lib.multistate_scan(a, b, c, x, block_l=24), ValueError, "block_l"),
        "block_l 1": (lambda: scan_lib.multistate_scan(a, b, c, x, block_l=1), ValueError, "block_l"),
        "block_l x N too big": (lambda: scan_lib.multistate_scan(*make_inputs(1, 16, 3, torch.float32, 0)[:4], block_l=4096),
                                ValueError, "block_l"),
        "block_l float": (lambda: scan_lib.multistate_scan(a, b, c, x, block_l=16.0), TypeError, "block_l"),
        "too many states": (lambda: scan_lib.multistate_scan(*make_inputs(1, MAX_STATES + 1, 3, torch.float32, 0)[:4]),
                            ValueError, "a"),
    }


@pytest.mark.parametrize("case", list(_bad_calls()))
def test_bad_input_names_the_argument(case):
    call, error, name = _bad_calls()[case]
    with pytest.raises(error) as info:
        call()
    assert str(info.value).startswith(name + " "), str(info.value)


def test_tensors_on_two_devices_are_refused_naming_them():
    a, b, c, x, _ = make_inputs(1, 2, 5, torch.float32, seed=9)
    with pytest.raises(ValueError, match="one device, got a on .*, x on meta"):
        scan_lib.multistate_scan(a, b, c, x.to("meta"))


def test_cpu_and_gpu_tensors_are_refused():
    if DEVICE.type != "cuda":
        pytest.skip("needs a GPU: on the CPU there is only one device")
    a, b, c, x, _ = make_inputs(1, 2, 5, torch.float32, seed=9)
    with pytest.raises(ValueError, match="one device"):
        scan_lib.multistate_scan(a, b, c, x.cpu())

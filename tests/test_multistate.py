"""scan_lib.multistate_scan against the float64 loop reference: random shapes and dtypes, initial and
last states, block sizes, every gradient (autograd through the loop, and gradcheck), torch.func and
torch.compile, second derivatives refused, bad input; and the notebook's checks shown to catch the bugs
they guard against (a skipped carry, half-precision accumulation, states kept or written)."""
import math
import random

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import scan_lib  # first: without a GPU it switches Triton to its interpreter before triton is imported
import triton
import triton.language as tl
from scan_lib.multistate import (MAX_STATES, multistate_backward, multistate_forward, multistate_fwd_kernel,
                                 multistate_scan_ref, num_warps_for, tolerance)
from scan_lib.runtime import DEVICE


def make_inputs(batch, n_states, length, dtype, seed, requires_grad=False):
    """a in (0.9, 1) (a decaying gate with a long memory, like exp(delta*A)); b, c, x, initial state
    standard normal."""
    g = torch.Generator().manual_seed(seed)
    a = 0.9 + 0.1 * torch.rand(batch, n_states, length, generator=g, dtype=torch.float64)
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
    assert rel_err(y, y_ref) < tolerance(dtype, length), (batch, n_states, length)
    assert rel_err(last, last_ref) < tolerance(dtype, length), (batch, n_states, length)


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
        assert rel_err(g, w) < tolerance(dtype, 100), name


def test_gradcheck_through_both_outputs():
    inputs = make_inputs(1, 2, 5, torch.float64, seed=3, requires_grad=True)  # block_l=2: 3 chunks, one partial
    assert torch.autograd.gradcheck(lambda *t: scan_lib.multistate_scan(*t, return_last_state=True, block_l=2), inputs,
                                    fast_mode=False)


def test_gradcheck_without_initial_state_through_y_only():
    a, b, c, x, _ = make_inputs(1, 2, 5, torch.float64, seed=4, requires_grad=True)
    assert torch.autograd.gradcheck(lambda *t: scan_lib.multistate_scan(*t, block_l=4), (a, b, c, x), fast_mode=False)


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
def test_second_derivatives_raise(loss):
    """The first derivative with create_graph=True works (torch.func.grad needs it); differentiating it
    again must fail loudly, naming the op, not return a Hessian that silently misses the scan."""
    a, b, c, x, _ = make_inputs(2, 3, 9, torch.float64, seed=7)
    x.requires_grad_(True)
    y = scan_lib.multistate_scan(a, b, c, x)
    total = (y if loss == "y" else y ** 2).sum() + (x ** 3).sum()
    (dx,) = torch.autograd.grad(total, x, create_graph=True)
    with pytest.raises(RuntimeError, match="multistate_scan supports first derivatives only"):
        torch.autograd.grad(dx.sum(), x, allow_unused=True)


def test_hessian_and_gradgradcheck_raise():
    a, b, c, x, h0 = make_inputs(1, 2, 6, torch.float64, seed=8)
    f = lambda x: (scan_lib.multistate_scan(a, b, c, x, h0, block_l=2) ** 2).sum()
    with pytest.raises(RuntimeError, match="multistate_scan"):
        torch.autograd.functional.hessian(f, x)
    with pytest.raises(RuntimeError, match="multistate_scan"):
        torch.func.grad(lambda x: torch.func.grad(f)(x).sum())(x)
    a, b, c, x, _ = make_inputs(1, 1, 3, torch.float64, seed=8)  # gradgradcheck differentiates numerically first
    with pytest.raises(RuntimeError, match="multistate_scan"):
        torch.autograd.gradgradcheck(lambda *t: scan_lib.multistate_scan(*t, block_l=2),
                                     [t.requires_grad_() for t in (a, b, c, x)])


def test_func_grad_matches_autograd():
    a, b, c, x, h0 = make_inputs(2, 3, 20, torch.float64, seed=9)
    loss = lambda *t: (scan_lib.multistate_scan(*t, block_l=8, return_last_state=True)[0] ** 2).sum()
    got = torch.func.grad(loss, argnums=(0, 1, 2, 3, 4))(a, b, c, x, h0)
    inputs = [t.clone().requires_grad_() for t in (a, b, c, x, h0)]
    want = torch.autograd.grad(loss(*inputs), inputs)
    for g, w in zip(got, want):
        assert rel_err(g, w) < 1e-14


def test_vmap_matches_a_loop():
    a, b, c, x, h0 = make_inputs(2, 3, 20, torch.float64, seed=10)
    stacked = [torch.stack([t, 0.5 * t, -t]) for t in (a, b, c, x)]       # vmap over a leading dim of 3
    f = lambda a, b, c, x, h0: scan_lib.multistate_scan(a, b, c, x, h0, block_l=8, return_last_state=True)
    y, last = torch.func.vmap(f, in_dims=(0, 0, 0, 0, None))(*stacked, h0)
    for i in range(3):
        y_i, last_i = f(*(s[i] for s in stacked), h0)
        assert torch.equal(y[i], y_i) and torch.equal(last[i], last_i)
    # per-example gradients: vmap of grad
    grads = torch.func.vmap(torch.func.grad(lambda *t: f(*t)[0].sum(), argnums=(0, 1, 2, 3)),
                           in_dims=(0, 0, 0, 0, None))(*stacked, h0)
    for i in range(3):
        inputs = [s[i].clone().requires_grad_() for s in stacked]
        want = torch.autograd.grad(f(*inputs, h0)[0].sum(), inputs)
        for g, w in zip(grads, want):
            assert rel_err(g[i], w) < 1e-14


def test_compile_fullgraph_forward_and_backward():
    torch._dynamo.reset()
    inputs = [t.requires_grad_() for t in make_inputs(2, 3, 20, torch.float64, seed=11)]
    f = lambda a, b, c, x, h0: scan_lib.multistate_scan(a, b, c, x, h0, block_l=8, return_last_state=True)
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    y, last = compiled(*inputs)
    y_eager, last_eager = f(*inputs)
    assert torch.equal(y, y_eager) and torch.equal(last, last_eager)
    dy = torch.randn_like(y)
    got = torch.autograd.grad((y, last), inputs, (dy, torch.ones_like(last)))
    want = torch.autograd.grad((y_eager, last_eager), inputs, (dy, torch.ones_like(last)))
    for g, w in zip(got, want):
        assert torch.equal(g, w)
    with torch.no_grad():                                   # the inference path compiles too
        assert torch.equal(compiled(*inputs)[0], y_eager)


# ---- the notebook's checks catch the bugs they guard against ----

def skipped_carry_forward(a, b, c, x, block_l):
    """A forward with the bug of dropping the carry: every chunk starts from the zero state."""
    chunks = [multistate_forward(a[..., s:s + block_l].contiguous(), b[..., s:s + block_l].contiguous(),
                                 c[..., s:s + block_l].contiguous(), x[..., s:s + block_l].contiguous(),
                                 None, block_l, save_chunks=False)[0] for s in range(0, a.shape[-1], block_l)]
    return torch.cat(chunks, dim=-1)


def test_check_catches_a_skipped_carry():
    a, b, c, x, _ = make_inputs(2, 5, 100, torch.float32, seed=12)
    y_ref, _ = multistate_scan_ref(*(t.double() for t in (a, b, c, x)))
    correct, _, _ = multistate_forward(a, b, c, x, None, 16, save_chunks=False)
    assert rel_err(correct, y_ref) < tolerance(torch.float32, 100)
    assert rel_err(skipped_carry_forward(a, b, c, x, 16), y_ref) > 100 * tolerance(torch.float32, 100)


def test_gradient_check_catches_a_skipped_adjoint_carry():
    """The backward with the adjoint carry dropped: each chunk's backward run on its own, from zero."""
    a, b, c, x, h0 = make_inputs(2, 5, 100, torch.float64, seed=13)
    dy = torch.randn(2, 100, dtype=torch.float64, device=DEVICE)
    _, _, h_chunks = multistate_forward(a, b, c, x, h0, 16, save_chunks=True)
    zeros = torch.zeros_like(h0)
    pieces = [multistate_backward(*(t[..., s:s + 16].contiguous() for t in (a, b, c, x)), h_chunks[:, k:k + 1].contiguous(),
                                  dy[:, s:s + 16].contiguous(), zeros, 16) for k, s in enumerate(range(0, 100, 16))]
    da_buggy = torch.cat([p[0] for p in pieces], dim=-1)
    inputs = [t.requires_grad_() for t in (a, b, c, x, h0)]
    da_ref = torch.autograd.grad(multistate_scan_ref(*inputs)[0], inputs[0], dy)[0]
    da = multistate_backward(a, b, c, x, h_chunks, dy, zeros, 16)[0]
    assert rel_err(da, da_ref) < 1e-12
    assert rel_err(da_buggy, da_ref) > 1e-3


def half_accumulating_forward(a, b, c, x, block_l=64):
    """The forward kernel launched with a float16 accumulator instead of float32 (the bug)."""
    batch, n_states, length = a.shape
    y, h_last = torch.empty_like(x), torch.empty(batch, n_states, device=a.device, dtype=a.dtype)
    multistate_fwd_kernel[(batch,)](a, b, c, x, h_last, y, h_last, h_last, length, n_states,
                                    triton.cdiv(length, block_l),
                                    HAS_H0=False, SAVE_CHUNKS=False, ACC=tl.float16, BLOCK_L=block_l,
                                    BLOCK_N=triton.next_power_of_2(n_states), num_warps=num_warps_for(block_l, n_states))
    return y


def test_tolerance_catches_half_precision_accumulation():
    """A float16 accumulator fails the float32 tolerance; and for float16 inputs, where the output's own
    rounding is most of the tolerance, it still lands above it."""
    for dtype in (torch.float32, torch.float16):
        a, b, c, x, _ = make_inputs(3, 16, 1000, dtype, seed=2)
        y_ref, _ = multistate_scan_ref(*(t.double() for t in (a, b, c, x)))
        assert rel_err(scan_lib.multistate_scan(a, b, c, x), y_ref) < tolerance(dtype, 1000)
        margin = 4 if dtype == torch.float32 else 1.3
        assert rel_err(half_accumulating_forward(a, b, c, x), y_ref) > margin * tolerance(dtype, 1000), dtype


def test_reference_check_catches_coupled_states():
    """The notebook checks the loop reference against N separate linear_scans: a reference that couples
    the states (here: each state also receives its neighbour's previous value) fails it."""
    a, b, c, x, _ = make_inputs(2, 4, 30, torch.float64, seed=14)
    h_rows = scan_lib.linear_scan(a, b * x[:, None, :])
    independent = (c * h_rows).sum(dim=1)
    assert rel_err(multistate_scan_ref(a, b, c, x)[0], independent) < 1e-12
    h, ys = torch.zeros_like(a[..., 0]), []
    for t in range(a.shape[-1]):
        h = a[..., t] * h + 0.01 * h.roll(1, dims=1) + b[..., t] * x[:, None, t]
        ys.append((c[..., t] * h).sum(dim=1))
    assert rel_err(torch.stack(ys, dim=1), independent) > 1e-3


class BytesMoved(TorchDispatchMode):
    """The notebook's counter: bytes of the tensor inputs and outputs of every operator call, views excepted."""
    def __init__(self):
        super().__init__()
        self.total = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not func.is_view:
            self.total += sum(t.numel() * t.element_size() for t in tree_leaves((args, kwargs, out)) if isinstance(t, torch.Tensor))
        return out


def bytes_moved(fn):
    with BytesMoved() as counter:
        fn()
    return counter.total


def saved_bytes(fn, *inputs):
    """The notebook's measure: bytes kept alive by the tensors autograd saves, inputs excluded."""
    inputs_at = {t.untyped_storage().data_ptr() for t in inputs}
    saved = {}

    def pack(t):
        if t.untyped_storage().data_ptr() not in inputs_at:
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(*inputs)
    return sum(saved.values())


def test_memory_checks_catch_states_written_or_kept():
    batch, n_states, length, block_l = 3, 5, 100, 16
    a, b, c, x, _ = make_inputs(batch, n_states, length, torch.float32, seed=15)
    fused = (3 * batch * n_states * length + 2 * batch * length + batch * n_states) * 4
    boundary = batch * math.ceil(length / block_l) * n_states * 4
    assert bytes_moved(lambda: scan_lib.multistate_scan(a, b, c, x)) == fused
    assert bytes_moved(lambda: scan_lib.multistate_scan(a.requires_grad_(), b, c, x, block_l=block_l)) == fused + boundary
    a.requires_grad_(False)
    # the bug: a design that writes the states (here, with the loop reference) moves more
    assert bytes_moved(lambda: multistate_scan_ref(a, b, c, x)) > fused + batch * n_states * length * 4
    inputs = [t.requires_grad_() for t in (a, b, c, x)]
    assert saved_bytes(lambda *t: scan_lib.multistate_scan(*t, block_l=block_l), *inputs) == boundary
    # the bug: keeping every state for the backward (autograd through the loop does)
    assert saved_bytes(lambda *t: multistate_scan_ref(*t), *inputs) >= batch * n_states * length * 4


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


@pytest.mark.parametrize("shape", [(2, 3, 0), (0, 3, 5), (2, 0, 5)], ids=["L0", "batch0", "N0"])
def test_empty_inputs_give_torch_like_results(shape):
    """As torch's ops do: y of x's shape (zeros: a sum over no states), the last state the initial
    state, gradients of every input's shape, the initial state's through the last state."""
    batch, n_states, length = shape
    a, b, c = (torch.rand(shape, device=DEVICE, requires_grad=True) for _ in range(3))
    x = torch.randn(batch, length, device=DEVICE, requires_grad=True)
    h0 = torch.randn(batch, n_states, device=DEVICE, requires_grad=True)
    y, last = scan_lib.multistate_scan(a, b, c, x, h0, return_last_state=True)
    assert y.shape == x.shape and not y.any() and torch.equal(last, h0)
    grads = torch.autograd.grad(y.sum() + 2 * last.sum(), [a, b, c, x, h0])
    assert [g.shape for g in grads] == [t.shape for t in (a, b, c, x, h0)]
    assert torch.equal(grads[4], torch.full_like(h0, 2.0))
    y_only = scan_lib.multistate_scan(a, b, c, x, h0)             # without the last state: zero gradients
    assert not any(g.any() for g in torch.autograd.grad(y_only.sum(), [a, b, c, x, h0]))

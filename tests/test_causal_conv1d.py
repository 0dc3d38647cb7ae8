"""scan_lib.causal_conv1d against float64 F.conv1d references (every option, width and gradient, awkward
lengths, strided inputs), gradcheck, half precision, bad input, torch.func / torch.compile, a bug injected
into the kernels, causal_conv1d_update, seq_idx (several sequences packed in a row) against a reference that
cuts the rows, and (on a GPU, where it is installed) the causal-conv1d package."""
import sys
import types

import pytest
import torch

import scan_lib  # first: without a GPU it switches Triton to its interpreter, before triton.language loads
import triton
import triton.language as tl
from scan_lib.runtime import DEVICE, INTERPRET, ON_GPU
from scan_lib.causal_conv1d import causal_conv1d, causal_conv1d_ref, causal_conv1d_update

MODULE = sys.modules["scan_lib.causal_conv1d"]
CONFIG = "CPU_CONFIG" if INTERPRET else "GPU_CONFIG"


def make(batch, dim, length, width, dtype=torch.float64, seed=0):
    """x, weight, bias, initial_states, dout, dfinal: float64 values representable in dtype."""
    g = torch.Generator().manual_seed(seed)
    shapes = [(batch, dim, length), (dim, width), (dim,), (batch, dim, width - 1), (batch, dim, length),
              (batch, dim, width - 1)]
    return [torch.randn(*s, generator=g, dtype=torch.float64).to(dtype).double().to(DEVICE) for s in shapes]


def rel_err(x, ref):
    """Max abs error relative to the reference's largest magnitude; an all-zero reference must be matched exactly."""
    scale, err = ref.double().abs().max().item(), (x.double() - ref.double()).abs().max().item()
    return (0.0 if err == 0.0 else float("inf")) if scale == 0.0 else err / scale


def results(fn, x, weight, bias, h0, dout, dfinal, activation="silu", dtype=None, layout=None):
    """out, final states and the gradients of every given input, of sum(out * dout) + sum(final * dfinal).
    layout(t) may return a strided view of a 3-D leaf; the gradient is taken w.r.t. the leaf."""
    leaves = [None if t is None else t.detach().to(dtype or t.dtype).requires_grad_(True) for t in (x, weight, bias, h0)]
    used = [t for t in leaves if t is not None]
    args = [t if t is None or layout is None else layout(t) for t in leaves]
    out, final = fn(args[0], args[1], args[2], initial_states=args[3], return_final_states=True, activation=activation)
    loss = (out.double() * dout).sum() + (final.double() * dfinal).sum()
    return [out, final, *torch.autograd.grad(loss, used)]


def compare(problem, activation="silu", tol=1e-12, dtype=None, **options):
    ours = results(causal_conv1d, *problem, activation=activation, dtype=dtype, **options)
    ref = results(causal_conv1d_ref, *problem, activation=activation)
    assert len(ours) == len(ref)
    for a, r in zip(ours, ref):
        assert a.shape == r.shape
    errors = [rel_err(a, r) for a, r in zip(ours, ref)]
    assert max(errors) <= tol, errors
    return ours


@pytest.mark.parametrize("width,length", [(2, 1), (2, 7), (2, 129), (3, 1), (3, 7), (3, 129), (4, 1), (4, 7), (4, 129),
                                          (4, 1000)])
def test_matches_reference(width, length):
    compare(make(2, 3, length, width, seed=width + length))


@pytest.mark.parametrize("bias,h0,activation", [(False, False, None), (True, False, None), (False, True, None),
                                                (False, False, "silu"), (True, True, "swish")])
def test_options(bias, h0, activation):
    x, weight, b, h, dout, dfinal = make(2, 3, 7, 3, seed=3)
    compare([x, weight, b if bias else None, h if h0 else None, dout, dfinal], activation=activation)


def test_blocks_cross_boundaries(monkeypatch):
    """Blocks of 2 channels and 16 positions, forward and backward: the shifted loads and dx's reads of g
    cross block edges, at every width."""
    small = {"block_d": 2, "block_l": 16}
    monkeypatch.setattr(MODULE, CONFIG, {**getattr(MODULE, CONFIG), **small})
    monkeypatch.setattr(MODULE, "GPU_BWD_CONFIG", {size: {**config, **small} for size, config in MODULE.GPU_BWD_CONFIG.items()})
    for width in (2, 3, 4):
        compare(make(1, 3, 40, width, seed=5))


def test_strided_inputs():
    """A slice of a bigger tensor along dim, and a channel-last (transposed) view, read in place."""
    problem = make(2, 4, 17, 4, seed=8)
    every_other = lambda t: torch.stack([t, torch.zeros_like(t)], 2).flatten(1, 2)[:, ::2]   # stride 2L along dim
    assert every_other(problem[0]).stride()[1] == 2 * 17
    sliced = compare(problem, layout=lambda t: every_other(t) if t.dim() == 3 else t)
    channel_last = compare(problem, layout=lambda t: t.transpose(1, 2).contiguous().transpose(1, 2) if t.dim() == 3 else t)
    x_cl = problem[0].transpose(1, 2).contiguous().transpose(1, 2)
    out = causal_conv1d(x_cl, problem[1])
    assert out.stride() == x_cl.stride()           # out keeps x's layout
    for a, b in zip(sliced, channel_last):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-13)
    weight_t = problem[1].t().contiguous().t()     # a transposed weight
    torch.testing.assert_close(causal_conv1d(problem[0], weight_t, problem[2][::1]),
                               causal_conv1d_ref(problem[0], problem[1], problem[2]), rtol=0, atol=1e-13)


def test_final_states_out_and_return_types():
    x, weight, bias, h0, _, _ = make(2, 3, 2, 4, seed=2)     # L = 2 < width - 1: final states use h0
    out = causal_conv1d(x, weight, bias)
    assert isinstance(out, torch.Tensor) and out.shape == x.shape
    buffer = torch.full((2, 3, 3), float("nan"), dtype=torch.float64, device=DEVICE)
    out2, final = causal_conv1d(x, weight, bias, initial_states=h0, return_final_states=True, final_states_out=buffer)
    assert final is buffer
    torch.testing.assert_close(buffer, torch.cat([h0, x], -1)[..., -3:], rtol=0, atol=0)
    with pytest.raises(ValueError, match="final_states_out is only written with return_final_states=True"):
        causal_conv1d(x, weight, final_states_out=buffer)


def test_gradcheck():
    """Every input's Jacobian column by column, through out and the final states (L = 2 < width - 1 = 3:
    the final states come from initial_states and x)."""
    leaves = [t.requires_grad_(True) for t in make(1, 1, 2, 4, seed=11)[:4]]

    def f(x, weight, bias, h0):
        return causal_conv1d(x, weight, bias, initial_states=h0, return_final_states=True, activation="silu")

    assert torch.autograd.gradcheck(f, leaves, fast_mode=False)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision(dtype):
    """Inputs representable in dtype, float32 sums: the error is the final rounding to dtype (2^-11, 2^-8;
    the interpreter truncates to bfloat16: 2^-7) plus float32 sums of batch x L terms."""
    length = 129
    unit = {torch.float16: 2**-11, torch.bfloat16: 2**-7 if INTERPRET else 2**-8}[dtype]
    ours = compare(make(2, 8, length, 4, dtype=dtype, seed=4), dtype=dtype,
                   tol=unit + 32 * (2 * length) ** 0.5 * 2**-24)
    assert all(t.dtype == dtype for t in ours)


def test_weight_in_another_dtype():
    """weight and bias in float32 with bfloat16 x (the package allows it): out and dx in bfloat16,
    dweight and dbias in float32."""
    x, weight, bias, h0, dout, dfinal = make(1, 4, 9, 4, dtype=torch.bfloat16, seed=6)
    xb = x.to(torch.bfloat16).requires_grad_(True)
    w32, b32 = weight.float().requires_grad_(True), bias.float().requires_grad_(True)
    out = causal_conv1d(xb, w32, b32, activation="silu")
    assert out.dtype == torch.bfloat16
    dx, dw, db = torch.autograd.grad((out.double() * dout).sum(), [xb, w32, b32])
    assert (dx.dtype, dw.dtype, db.dtype) == (torch.bfloat16, torch.float32, torch.float32)
    ref = causal_conv1d_ref(x, weight, bias, activation="silu")
    assert rel_err(out, ref) <= 2**-7


def test_gradients_are_deterministic():
    problem = make(2, 3, 40, 4, seed=12)
    first, second = results(causal_conv1d, *problem), results(causal_conv1d, *problem)
    for a, b in zip(first, second):
        assert torch.equal(a, b)


def test_second_derivative_raises():
    x, weight, bias = (t.requires_grad_(True) for t in make(1, 2, 5, 3, seed=1)[:3])
    (gx,) = torch.autograd.grad((causal_conv1d(x, weight, bias, activation="silu") ** 2).sum(), x, create_graph=True)
    with pytest.raises(RuntimeError, match="causal_conv1d has no second derivative"):
        torch.autograd.grad(gx.sum(), [x, weight])


def test_func_grad_matches_autograd():
    x, weight, bias, h0 = make(2, 3, 11, 4, seed=13)[:4]

    def loss(x, weight, bias, h0):
        out, final = causal_conv1d(x, weight, bias, initial_states=h0, return_final_states=True, activation="silu")
        return (out ** 2).sum() + (final ** 2).sum()

    grads = torch.func.grad(loss, argnums=(0, 1, 2, 3))(x, weight, bias, h0)
    leaves = [t.detach().requires_grad_(True) for t in (x, weight, bias, h0)]
    for g, e in zip(grads, torch.autograd.grad(loss(*leaves), leaves)):
        torch.testing.assert_close(g, e, rtol=0, atol=1e-13)


def test_vmap_matches_a_loop():
    xs = torch.randn(3, 1, 2, 9, dtype=torch.float64, device=DEVICE)
    weights = torch.randn(3, 2, 4, dtype=torch.float64, device=DEVICE)
    f = lambda x, w: causal_conv1d(x, w, activation="silu")
    batched = torch.func.vmap(f)(xs, weights)
    for i in range(3):
        torch.testing.assert_close(batched[i], causal_conv1d_ref(xs[i], weights[i], activation="silu"), rtol=0, atol=1e-13)
    grads = torch.func.vmap(torch.func.grad(lambda x, w: f(x, w).sum()))(xs, weights)
    for i in range(3):
        leaf = xs[i].clone().requires_grad_(True)
        (expected,) = torch.autograd.grad(causal_conv1d_ref(leaf, weights[i], activation="silu").sum(), leaf)
        torch.testing.assert_close(grads[i], expected, rtol=0, atol=1e-13)


def test_compile_fullgraph():
    torch._dynamo.reset()
    x, weight, bias, h0 = (t.float().requires_grad_(True) for t in make(2, 3, 12, 4, seed=14)[:4])

    def f(x, weight, bias, h0):
        out, final = causal_conv1d(x, weight, bias, initial_states=h0, return_final_states=True, activation="silu")
        return 2 * out, final

    out, final = torch.compile(f, fullgraph=True, backend="aot_eager")(x, weight, bias, h0)
    out_e, final_e = f(x, weight, bias, h0)
    torch.testing.assert_close(out, out_e, rtol=0, atol=0)
    torch.testing.assert_close(final, final_e, rtol=0, atol=0)
    leaves = [x, weight, bias, h0]
    for g, e in zip(torch.autograd.grad(out.sum() + final.sum(), leaves),
                    torch.autograd.grad(out_e.sum() + final_e.sum(), leaves)):
        torch.testing.assert_close(g, e, rtol=1e-6, atol=1e-6)


def test_fake_tensors_give_shapes():
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode(allow_non_fake_inputs=True):
        x, weight = torch.empty(2, 5, 7, device=DEVICE), torch.empty(5, 3, device=DEVICE)
        out, final = causal_conv1d(x, weight, return_final_states=True)
    assert out.shape == (2, 5, 7) and final.shape == (2, 5, 2)


# A bug injected into the kernels: the interpreter looks the kernels' helpers up at run time, so replacing
# one in the module changes what the kernels compute (a compiled GPU kernel would not see it).
def _x_at(X_ROW, H0_ROW, s, d_ok, length, stride_xl, stride_hl,
                    WIDTH: tl.constexpr, HAS_H0: tl.constexpr, ACC: tl.constexpr):
    """_x_at, broken: reads position s + 1, so the output at t sees x[t + 1] (off by one, not causal).
    Named like the helper it replaces: the interpreter re-executes a helper's source and looks it up by name."""
    s = s + 1
    val = tl.load(X_ROW + s * stride_xl, d_ok & (s >= 0) & (s < length), other=0.0).to(ACC)
    if HAS_H0:
        val += tl.load(H0_ROW + (s + WIDTH - 1) * stride_hl, d_ok & (s < 0) & (s >= 1 - WIDTH), other=0.0).to(ACC)
    return val


@pytest.mark.skipif(not INTERPRET, reason="injects the bug through the interpreter")
def test_check_catches_an_injected_off_by_one(monkeypatch):
    problem = make(1, 2, 9, 3, seed=15)
    monkeypatch.setattr(MODULE, "_x_at", triton.jit(types.FunctionType(
        _x_at.__code__, MODULE.__dict__, "_x_at")))
    with pytest.raises(AssertionError):
        compare(problem)
    monkeypatch.undo()
    compare(problem)                 # and the same check passes without the bug


def _good():
    x, weight, bias, h0 = make(2, 4, 9, 4)[:4]
    return dict(x=x, weight=weight, bias=bias, initial_states=h0)


@pytest.mark.parametrize("change,error,message", [
    (dict(x=torch.randn(4, 9)), ValueError, "x must have shape (batch, dim, L)"),
    (dict(weight=torch.randn(5, 4)), ValueError, "weight must have shape (dim=4, width)"),
    (dict(weight=torch.randn(4, 1)), ValueError, "with width 2, 3 or 4"),
    (dict(weight=torch.randn(4, 5)), ValueError, "with width 2, 3 or 4"),
    (dict(weight=torch.randn(4, 4, 1)), ValueError, "weight must have shape"),
    (dict(bias=torch.randn(3)), ValueError, "bias must have shape (4,)"),
    (dict(initial_states=torch.randn(2, 4, 2)), ValueError, "initial_states must have shape (2, 4, 3)"),
    (dict(initial_states=torch.randn(2, 4, 3, dtype=torch.float32)), TypeError, "initial_states must have x's dtype"),
    (dict(bias=torch.randn(4, dtype=torch.float32)), TypeError, "bias must have weight's dtype"),
    (dict(x=torch.ones(2, 4, 9, dtype=torch.int32)), TypeError, "x must be float16"),
    (dict(weight=[1.0]), TypeError, "weight must be a torch.Tensor"),
    (dict(bias=torch.randn(4, dtype=torch.float64, device="meta")), ValueError, "all tensors must be on one device"),
    (dict(activation="relu"), ValueError, "activation must be None, 'silu' or 'swish'"),
    (dict(return_final_states=True, final_states_out=torch.empty(2, 4, 2, dtype=torch.float64)), ValueError,
     "final_states_out must have shape (2, 4, 3)"),
])
def test_bad_input(change, error, message):
    change = {k: (v.to(DEVICE) if isinstance(v, torch.Tensor) and v.device.type != "meta" else v)
              for k, v in change.items()}
    with pytest.raises(error) as info:
        causal_conv1d(**{**_good(), **change})
    assert message in str(info.value)


@pytest.mark.parametrize("width,state_len,bias,activation", [(4, 3, True, "silu"), (3, 5, False, None), (2, 1, True, "swish")])
def test_update_steps_equal_one_call(width, state_len, bias, activation):
    """L calls of causal_conv1d_update give the outputs and final state of one causal_conv1d call."""
    x, weight, b, h0 = make(2, 5, 6, width, seed=16)[:4]
    b = b if bias else None
    whole, final = causal_conv1d_ref(x, weight, b, h0, return_final_states=True, activation=activation)
    state = torch.cat([torch.zeros(2, 5, state_len - width + 1, dtype=torch.float64, device=DEVICE), h0], -1)
    steps = torch.stack([causal_conv1d_update(x[..., t], state, weight, b, activation) for t in range(6)], -1)
    torch.testing.assert_close(steps, whole, rtol=0, atol=1e-12)
    torch.testing.assert_close(state[..., -(width - 1):], final, rtol=0, atol=0)
    if state_len > width - 1:   # the older columns hold the inputs before, in order
        torch.testing.assert_close(state[..., :state_len - width + 1], x[..., 6 - state_len:6 - width + 1], rtol=0, atol=0)


def test_update_half_precision_and_bad_input():
    x, weight, b, h0 = make(3, 4, 1, 4, dtype=torch.bfloat16, seed=17)[:4]
    state = h0.to(torch.bfloat16)
    out = causal_conv1d_update(x[..., 0].to(torch.bfloat16), state, weight.to(torch.bfloat16), b.to(torch.bfloat16), "silu")
    ref = causal_conv1d_ref(x, weight, b, h0, activation="silu")[..., 0]
    assert out.dtype == torch.bfloat16 and rel_err(out, ref) <= (2**-7 if INTERPRET else 2**-8) + 1e-6
    good = dict(x=x[..., 0], conv_state=h0.clone(), weight=weight, bias=b)
    for change, error, message in [
        (dict(conv_state=h0[..., :2].clone()), ValueError, "conv_state must have shape (batch=3, dim=4, state_len >= 3)"),
        (dict(x=x[..., None]), ValueError, "x must have shape (batch, dim) or (batch, dim, L)"),
        (dict(weight=weight[:, :1]), ValueError, "width 2, 3 or 4"),
        (dict(conv_state=h0.float()), TypeError, "conv_state must have x's dtype"),
        (dict(activation="gelu"), ValueError, "activation must be None"),
    ]:
        with pytest.raises(error) as info:
            causal_conv1d_update(**{**good, **change})
        assert message in str(info.value)


def test_against_the_causal_conv1d_package():
    try:
        from causal_conv1d import causal_conv1d_fn
    except ImportError as exc:
        pytest.skip(f"causal_conv1d not importable: {exc}")
    if not ON_GPU:
        pytest.skip("the package's kernel needs a GPU")
    x, weight, bias, _, dout, _ = make(4, 64, 1000, 4, dtype=torch.float32, seed=18)
    theirs = [causal_conv1d_fn, causal_conv1d]
    for dtype, tol in ((torch.float32, 1e-4), (torch.bfloat16, 2**-6)):
        got = []
        for fn in theirs:
            leaves = [t.to(dtype).requires_grad_(True) for t in (x, weight, bias)]
            out = fn(*leaves, activation="silu")
            got.append([out, *torch.autograd.grad((out.double() * dout).sum(), leaves)])
        for a, b in zip(*got):
            assert rel_err(a, b) <= tol


def test_offsets_past_32_bits_are_refused():
    x = torch.empty(1, 2, 2**30 + 2, device="meta")   # shapes only: the check comes before any kernel
    with pytest.raises(ValueError, match="32-bit offsets"):
        causal_conv1d(x, torch.empty(2, 4, device="meta"))


def test_update_under_compile():
    torch._dynamo.reset()
    x, weight, b, h0 = make(2, 5, 3, 4, seed=19)[:4]

    def steps(x, state):
        return torch.stack([causal_conv1d_update(x[..., t], state, weight, b, "silu") for t in range(3)], -1)

    state_eager, state_compiled = h0.clone(), h0.clone()
    expected = steps(x, state_eager)
    got = torch.compile(steps, fullgraph=True, backend="aot_eager")(x, state_compiled)
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    torch.testing.assert_close(state_compiled, state_eager, rtol=0, atol=0)


@pytest.mark.parametrize("shape", [(2, 4, 0), (0, 4, 5), (2, 0, 5)], ids=["L0", "batch0", "dim0"])
def test_empty_x_gives_an_empty_result(shape):
    """As torch's ops do: an empty out, the final states the initial states (nothing moved them) or the
    last columns of x, and gradients of the right shapes, the initial states' through the final states."""
    batch, dim, length = shape
    x = torch.randn(shape, device=DEVICE, requires_grad=True)
    weight = torch.randn(dim, 4, device=DEVICE, requires_grad=True)
    bias = torch.randn(dim, device=DEVICE, requires_grad=True)
    h0 = torch.randn(batch, dim, 3, device=DEVICE, requires_grad=True)
    out, final = causal_conv1d(x, weight, bias, initial_states=h0, return_final_states=True, activation="silu")
    assert out.shape == shape and out.dtype == x.dtype
    want = torch.cat([h0, x], dim=-1)[..., -3:]
    assert torch.equal(final, want)
    grads = torch.autograd.grad(out.sum() + 2 * final.sum(), [x, weight, bias, h0])
    assert [g.shape for g in grads] == [t.shape for t in (x, weight, bias, h0)]
    assert not grads[1].any() and not grads[2].any()
    if length == 0:
        assert torch.equal(grads[3], torch.full_like(h0, 2.0))
    out_only = causal_conv1d(x, weight, bias, initial_states=h0)     # without the final states: zero gradients
    assert not any(g.any() for g in torch.autograd.grad(out_only.sum(), [x, weight, bias, h0]))


@pytest.mark.parametrize("length", [1, 3])
def test_update_takes_several_positions_as_the_package_does(length):
    """x of shape (batch, dim, L): L steps in one call, the same outputs and state as L calls."""
    torch.manual_seed(0)
    x = torch.randn(2, 5, length, dtype=torch.float64, device=DEVICE)
    weight, bias = torch.randn(5, 4, dtype=torch.float64, device=DEVICE), torch.randn(5, dtype=torch.float64, device=DEVICE)
    state = torch.randn(2, 5, 4, dtype=torch.float64, device=DEVICE)
    state_before, state_by_steps = state.clone(), state.clone()
    out = causal_conv1d_update(x, state, weight, bias, "silu")
    by_steps = torch.stack([causal_conv1d_update(x[..., t], state_by_steps, weight, bias, "silu")
                            for t in range(length)], dim=-1)
    assert out.shape == x.shape
    torch.testing.assert_close(out, by_steps, rtol=0, atol=0)
    torch.testing.assert_close(state, state_by_steps, rtol=0, atol=0)
    # and against the sequence's reference, which shares no code with the update: the outputs of one
    # causal_conv1d from the state's last width - 1 columns, the window slid by L positions
    want = causal_conv1d_ref(x, weight, bias, state_before[..., -3:], activation="silu")
    torch.testing.assert_close(out, want, rtol=0, atol=1e-12)
    torch.testing.assert_close(state, torch.cat([state_before, x], dim=-1)[..., -4:], rtol=0, atol=0)


@pytest.mark.parametrize("batch, dim", [(0, 4), (2, 0)], ids=["batch0", "dim0"])
def test_update_of_an_empty_step_launches_nothing(batch, dim, monkeypatch):
    """An empty out and the state as it was, without a kernel launch (whose host work would be most of
    the call: issue 21's host-time target is for empty calls)."""
    module = sys.modules["scan_lib.causal_conv1d"]   # (scan_lib.causal_conv1d is the function)
    monkeypatch.setattr(module, "causal_conv1d_update_kernel", None)   # a launch would raise TypeError
    state = torch.randn(batch, dim, 3, device=DEVICE)
    state_before = state.clone()
    out = causal_conv1d_update(torch.randn(batch, dim, device=DEVICE), state, torch.randn(dim, 4, device=DEVICE))
    assert out.shape == (batch, dim) and torch.equal(state, state_before)


def test_update_with_no_positions_still_checks_its_inputs():
    with pytest.raises(ValueError, match="conv_state must have shape"):
        causal_conv1d_update(torch.randn(2, 4, 0, device=DEVICE), torch.randn(9, 9, 9, device=DEVICE),
                             torch.randn(4, 4, device=DEVICE))


# seq_idx: several sequences packed in one row. The reference cuts each row into its sequences (runs of
# equal ids) and convolves each alone, from zeros, with causal_conv1d_ref; padding (ids < 0) gives zeros.

def packed_ref(x, weight, bias, seq_idx, activation=None):
    rows = []
    for b in range(x.shape[0]):
        ids = seq_idx[b].tolist()
        starts = [t for t in range(len(ids)) if t == 0 or ids[t] != ids[t - 1]] + [len(ids)]
        pieces = []
        for start, end in zip(starts, starts[1:]):
            piece = x[b:b + 1, :, start:end]
            if ids[start] >= 0:
                pieces.append(causal_conv1d_ref(piece, weight, bias, activation=activation))
            else:
                pieces.append(torch.zeros_like(piece))
        rows.append(torch.cat(pieces, dim=-1))
    return torch.cat(rows, dim=0)


def packing(*rows):
    """seq_idx (len(rows), L) from each row's sequence lengths, numbered 0, 1, ... along the row; a
    negative length -n is n padding positions (id -1)."""
    def row(lengths):
        ids, n = [], 0
        for length in lengths:
            ids += [n] * length if length > 0 else [-1] * -length
            n += length > 0
        return ids
    return torch.tensor([row(r) for r in rows], dtype=torch.int32, device=DEVICE)


def packed_results(fn, x, weight, bias, seq_idx, dout, activation, dtype=None):
    """out and the gradients of x, weight and bias (those given) of sum(out * dout)."""
    leaves = [None if t is None else t.detach().to(dtype or t.dtype).requires_grad_(True) for t in (x, weight, bias)]
    if fn is causal_conv1d:
        out = causal_conv1d(*leaves, seq_idx=seq_idx, activation=activation)
    else:
        out = packed_ref(*leaves, seq_idx, activation=activation)
    return [out, *torch.autograd.grad((out.double() * dout).sum(), [t for t in leaves if t is not None])]


def compare_packed(seq_idx, width, activation="silu", bias=True, dim=3, dtype=None, tol=1e-12, seed=0):
    batch, length = seq_idx.shape
    x, weight, b, _, dout, _ = make(batch, dim, length, width, dtype=dtype or torch.float64, seed=seed)
    b = b if bias else None
    ours = packed_results(causal_conv1d, x, weight, b, seq_idx, dout, activation, dtype)
    ref = packed_results(packed_ref, x, weight, b, seq_idx, dout, activation)
    errors = [rel_err(a, r) for a, r in zip(ours, ref)]
    assert all(a.shape == r.shape for a, r in zip(ours, ref)) and max(errors) <= tol, errors
    return ours


PACKINGS = {
    "one sequence": ([13], [13]),
    "many": ([5, 1, 2, 3, 2], [1, 6, 6]),
    "length 1": ([1] * 13, [12, 1]),
    "shorter than the width": ([2, 1, 3, 2, 3, 1, 1], [3, 3, 3, 3, 1]),
    "padding": ([7, -3, 3], [-2, 5, 4, -2]),
}


@pytest.mark.parametrize("width", [2, 3, 4])
@pytest.mark.parametrize("packed", list(PACKINGS))
def test_seq_idx_matches_the_cut_rows(packed, width):
    """out, dx, dweight and dbias, with SiLU and bias, at every width and packing."""
    compare_packed(packing(*PACKINGS[packed]), width, seed=width)


@pytest.mark.parametrize("bias,activation", [(False, None), (True, None), (False, "swish")])
def test_seq_idx_options(bias, activation):
    compare_packed(packing([2, 4, 1, -2, 4], [4, 1, 3, 5]), 4, activation=activation, bias=bias, seed=1)


def test_seq_idx_of_one_sequence_changes_nothing():
    """Every position in one sequence (ids 0, or all 7): the same result as without seq_idx. The same
    bits under the interpreter. On a GPU the compiler may fuse a multiply and an add into one FMA in
    one kernel and not in the other, which changes the last bits, nothing more. The kernels mask a
    tap's input, not its product, so that the FMAs stay: compiled for sm_90, the fp32 forward's PTX
    has 128 fma.rn.f32 with seq_idx and without, the backward's 268 with and 284 without (masking
    the product gave 32 and 100, and differed in the last bits on an H200)."""
    x, weight, bias, _, dout, _ = make(2, 3, 21, 4, seed=2)
    plain = packed_results(causal_conv1d, x, weight, bias, None, dout, "silu")
    for value in (0, 7):
        same = packed_results(causal_conv1d, x, weight, bias, torch.full((2, 21), value, dtype=torch.int32, device=DEVICE),
                              dout, "silu")
        for got, want in zip(same, plain):
            if INTERPRET:
                assert torch.equal(got, want)
            else:
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_seq_idx_across_blocks(monkeypatch):
    """Blocks of 2 channels and 16 positions: sequences that start and end across runs and blocks."""
    small = {"block_d": 2, "block_l": 16}
    monkeypatch.setattr(MODULE, CONFIG, {**getattr(MODULE, CONFIG), **small})
    monkeypatch.setattr(MODULE, "GPU_BWD_CONFIG", {size: {**config, **small} for size, config in MODULE.GPU_BWD_CONFIG.items()})
    compare_packed(packing([15, 2, 1, 14, 3, -5, 5]), 4, seed=8)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_seq_idx_in_every_dtype(dtype):
    """As test_half_precision: inputs representable in dtype, sums in float32."""
    length = 40
    unit = {torch.float32: 2**-24, torch.float16: 2**-11, torch.bfloat16: 2**-7 if INTERPRET else 2**-8}[dtype]
    ours = compare_packed(packing([9, 1, 3, 20, -7]), 4, dim=8, dtype=dtype, seed=3,
                          tol=unit + 32 * (2 * length) ** 0.5 * 2**-24)
    assert all(t.dtype == dtype for t in ours)


def test_seq_idx_compares_ids_as_the_package_does():
    """A tap counts where its id equals its output's, as in causal-conv1d: an id that comes back after
    another one (0 0 1 0) is read across it. out[t] = bias + sum_k w[k] x[s] over s = t - 3 + k with
    seq_idx[s] == seq_idx[t]; 0 where seq_idx[t] < 0."""
    x, weight, bias = make(1, 2, 7, 4, seed=4)[:3]
    seq_idx = torch.tensor([[0, 0, 1, 0, -1, 0, 1]], dtype=torch.int32, device=DEVICE)
    want = torch.zeros_like(x)
    for t in range(7):
        if seq_idx[0, t] >= 0:
            want[0, :, t] = bias + sum(weight[:, k] * x[0, :, s] for k, s in enumerate(range(t - 3, t + 1))
                                       if s >= 0 and seq_idx[0, s] == seq_idx[0, t])
    torch.testing.assert_close(causal_conv1d(x, weight, bias, seq_idx=seq_idx), want, rtol=0, atol=1e-14)


def test_seq_idx_gradients_are_the_forwards_derivative():
    """Our backward against a central difference of our own forward along a random direction, padding
    included (its outputs are constant zeros: no gradient flows through them). gradcheck would take
    tens of interpreted calls; this takes three."""
    x, weight, bias, _, dout, _ = make(2, 2, 8, 4, seed=5)
    seq_idx = packing([2, -1, 1, 3, -1], [-2, 1, 5])
    loss = lambda x, w, b: (causal_conv1d(x, w, b, seq_idx=seq_idx, activation="silu") * dout).sum()
    leaves = [t.requires_grad_(True) for t in (x, weight, bias)]
    grads = torch.autograd.grad(loss(*leaves), leaves)
    g = torch.Generator().manual_seed(6)
    directions = [torch.randn(t.shape, generator=g, dtype=t.dtype).to(DEVICE) for t in leaves]
    eps = 1e-6
    with torch.no_grad():
        numeric = (loss(*[t + eps * v for t, v in zip(leaves, directions)])
                   - loss(*[t - eps * v for t, v in zip(leaves, directions)])) / (2 * eps)
    analytic = sum((gr * v).sum() for gr, v in zip(grads, directions))
    assert abs(numeric - analytic).item() <= 1e-7 * max(1.0, abs(analytic).item()), (numeric, analytic)


def test_seq_idx_layouts_and_empty_rows():
    """A channel-last x (the package's only layout for seq_idx) and a strided seq_idx, read in place;
    an empty x with its empty seq_idx."""
    seq_idx = packing([4, 3, 6], [1, 8, 4])
    x, weight, bias = make(2, 3, 13, 4, seed=6)[:3]
    want = packed_ref(x, weight, bias, seq_idx)
    x_cl = x.transpose(1, 2).contiguous().transpose(1, 2)
    seq_strided = torch.stack([seq_idx, -seq_idx], dim=-1)[..., 0]            # stride 2 along L
    assert seq_strided.stride() == (26, 2)
    torch.testing.assert_close(causal_conv1d(x_cl, weight, bias, seq_idx=seq_strided), want, rtol=0, atol=1e-13)
    empty = causal_conv1d(x[..., :0], weight, bias, seq_idx=seq_idx[:, :0])
    assert empty.shape == (2, 3, 0)


def test_seq_idx_under_compile():
    torch._dynamo.reset()
    seq_idx = packing([3, 5, -1, 3], [12])
    x, weight, bias = (t.requires_grad_(True) for t in make(2, 3, 12, 4, seed=7)[:3])
    f = lambda x, weight, bias, seq_idx: causal_conv1d(x, weight, bias, seq_idx=seq_idx, activation="silu")
    out = torch.compile(f, fullgraph=True, backend="aot_eager")(x, weight, bias, seq_idx)
    expected = f(x, weight, bias, seq_idx)
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    for g, e in zip(torch.autograd.grad(out.sum(), [x, weight, bias]), torch.autograd.grad(expected.sum(), [x, weight, bias])):
        torch.testing.assert_close(g, e, rtol=0, atol=1e-13)


@pytest.mark.parametrize("change,error,message", [
    (dict(seq_idx=torch.zeros(2, 9, dtype=torch.int64)), TypeError, "seq_idx must be a torch.int32 tensor, got torch.int64"),
    (dict(seq_idx=torch.zeros(2, 9)), TypeError, "seq_idx must be a torch.int32 tensor, got torch.float32"),
    (dict(seq_idx=[[0] * 9] * 2), TypeError, "seq_idx must be a torch.int32 tensor, got list"),
    (dict(seq_idx=torch.zeros(2, 8, dtype=torch.int32)), ValueError, "seq_idx must have shape (batch, L) = (2, 9), got (2, 8)"),
    (dict(seq_idx=torch.zeros(2, 9, 1, dtype=torch.int32)), ValueError, "seq_idx must have shape (batch, L) = (2, 9)"),
    (dict(seq_idx=torch.zeros(9, dtype=torch.int32)), ValueError, "seq_idx must have shape (batch, L) = (2, 9)"),
    (dict(seq_idx=torch.zeros(2, 9, dtype=torch.int32, device="meta")), ValueError, "all tensors must be on one device"),
    (dict(initial_states=torch.zeros(2, 4, 3, dtype=torch.float64)), ValueError,
     "initial_states must be None when seq_idx is given"),
    (dict(return_final_states=True), ValueError, "return_final_states must be False when seq_idx is given"),
])
def test_seq_idx_bad_input(change, error, message):
    x, weight, bias = make(2, 4, 9, 4)[:3]
    good = dict(x=x, weight=weight, bias=bias, seq_idx=torch.zeros(2, 9, dtype=torch.int32, device=DEVICE))
    change = {k: (v.to(DEVICE) if isinstance(v, torch.Tensor) and v.device.type != "meta" else v)
              for k, v in change.items()}
    with pytest.raises(error) as info:
        causal_conv1d(**{**good, **change})
    assert message in str(info.value)

"""scan_lib.linear_scan: h_t = gates_t * h_{t-1} + tokens_t, against a float64 loop and autograd."""
import sys

import pytest
import torch

import scan_lib
from scan_lib import linear_scan
from scan_lib.runtime import DEVICE, ON_GPU


def reference(gates, tokens, initial_state=None, reverse=False):
    """The recurrence as a float64 loop along the last dim (differentiable by autograd)."""
    if reverse:
        return reference(gates.flip(-1), tokens.flip(-1), initial_state).flip(-1)
    gates, tokens = gates.double(), tokens.double()
    h = torch.zeros_like(tokens[..., 0]) if initial_state is None else initial_state.double()
    states = []
    for t in range(tokens.shape[-1]):
        h = gates[..., t] * h + tokens[..., t]
        states.append(h)
    return torch.stack(states, -1)


def make_inputs(shape, dtype=torch.float32, seed=0, with_init=True):
    gen = torch.Generator().manual_seed(seed)
    gates = torch.rand(shape, generator=gen, dtype=torch.float64).to(DEVICE, dtype)
    tokens = torch.randn(shape, generator=gen, dtype=torch.float64).to(DEVICE, dtype)
    init = torch.randn(shape[:-1], generator=gen, dtype=torch.float64).to(DEVICE, dtype) if with_init else None
    return gates, tokens, init


def test_exported_in_package():
    assert scan_lib.linear_scan is linear_scan
    assert "linear_scan" in scan_lib.__all__


@pytest.mark.parametrize("shape", [(1,), (3, 7), (2, 3, 129), (2, 1000), (1, 4097)])
@pytest.mark.parametrize("reverse", [False, True])
@pytest.mark.parametrize("with_init", [False, True])
def test_forward_matches_loop(shape, reverse, with_init):
    gates, tokens, init = make_inputs(shape, seed=len(shape) + shape[-1], with_init=with_init)
    h = linear_scan(gates, tokens, init, reverse)
    assert h.shape == tokens.shape and h.dtype == tokens.dtype
    torch.testing.assert_close(h.double(), reference(gates, tokens, init, reverse), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("chunk", [16, 64, 1024])
@pytest.mark.parametrize("length", [1, 33, 300])
@pytest.mark.parametrize("reverse", [False, True])
def test_every_gradient_float64(chunk, length, reverse):
    gates, tokens, init = make_inputs((2, length), torch.float64, seed=chunk + length)
    grad = torch.randn(2, length, dtype=torch.float64, device=DEVICE)
    ours = [t.clone().requires_grad_() for t in (gates, tokens, init)]
    theirs = [t.clone().requires_grad_() for t in (gates, tokens, init)]
    h_ours = linear_scan(*ours, reverse, chunk=chunk)
    h_ref = reference(*theirs, reverse)
    torch.testing.assert_close(h_ours, h_ref, rtol=1e-12, atol=1e-12)
    for got, want in zip(torch.autograd.grad(h_ours, ours, grad), torch.autograd.grad(h_ref, theirs, grad)):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("reversed_loads", [False, True])
@pytest.mark.parametrize("reverse", [False, True])
def test_both_ways_of_scanning_against_memory_order(reverse, reversed_loads, monkeypatch):
    """Descending loads or tl.associative_scan(reverse=True): the same h and gradients, in both kernels."""
    ema, ls = sys.modules["scan_lib.ema"], sys.modules["scan_lib.linear_scan"]
    monkeypatch.setitem(ema.FWD_CONFIG, "reversed_loads", reversed_loads)
    monkeypatch.setitem(ls.BWD_CONFIG, "reversed_loads", reversed_loads)
    gates, tokens, init = make_inputs((2, 300), torch.float64, seed=11)
    grad = torch.randn(2, 300, dtype=torch.float64, device=DEVICE)
    ours = [t.clone().requires_grad_() for t in (gates, tokens, init)]
    theirs = [t.clone().requires_grad_() for t in (gates, tokens, init)]
    h_ours = linear_scan(*ours, reverse, chunk=64)
    h_ref = reference(*theirs, reverse)
    torch.testing.assert_close(h_ours, h_ref, rtol=1e-12, atol=1e-12)
    for got, want in zip(torch.autograd.grad(h_ours, ours, grad), torch.autograd.grad(h_ref, theirs, grad)):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)


def test_launch_options():
    ema = sys.modules["scan_lib.ema"]
    config = {"max_chunk": 2048, "elements_per_thread": 8, "stages": 2, "reversed_loads": True}
    assert ema.launch_options(4096, config) == {"CHUNK": 2048, "STAGES": 2, "REVERSED_LOADS": True, "num_warps": 8}
    assert ema.launch_options(5, config)["CHUNK"] == 16 and ema.launch_options(5, config)["num_warps"] == 1
    assert ema.launch_options(300, config, chunk=64)["CHUNK"] == 64
    assert ema.launch_options(10**6, {**config, "max_chunk": 8192, "elements_per_thread": 4})["num_warps"] == 16


@pytest.mark.parametrize("reverse", [False, True])
def test_gradcheck_full_jacobian(reverse):
    """Every column of the Jacobian (fast_mode=False), on a shape small enough for the interpreter."""
    gates, tokens, init = make_inputs((2, 7), torch.float64, seed=5)
    leaves = [t.requires_grad_() for t in (gates, tokens, init)]
    assert torch.autograd.gradcheck(lambda g, u, h: linear_scan(g, u, h, reverse, chunk=16), leaves, fast_mode=False)


def test_gradient_without_initial_state_and_unused_inputs():
    gates, tokens, _ = make_inputs((3, 50), torch.float64, seed=6, with_init=False)
    tokens.requires_grad_()
    h = linear_scan(gates, tokens, chunk=16)
    (d_tokens,) = torch.autograd.grad(h.sum(), tokens)
    expected = torch.autograd.grad(reference(gates, tokens).sum(), tokens)[0]
    torch.testing.assert_close(d_tokens, expected)


def low_precision_tolerance(dtype, length):
    """Relative error allowed for h and the gradients of `dtype` inputs, computed in float32: the stored
    values are rounded to dtype (h, which the backward reads again, and the gradient: about 2 ulps), plus
    float32 rounding accumulated along the length."""
    return 2 * torch.finfo(dtype).eps + length * torch.finfo(torch.float32).eps


def low_precision_errors(scan, dtype, length=700):
    """Relative errors of h and of the three gradients from `scan` on dtype inputs, against float64."""
    gates, tokens, init = make_inputs((4, length), dtype, seed=7)
    gates = 0.98 + 0.02 * gates  # long memory (about 100 steps): errors would grow if each step were rounded
    leaves = [t.clone().requires_grad_() for t in (gates, tokens, init)]
    h = scan(*leaves)
    grads = torch.autograd.grad(h, leaves, torch.ones_like(h))
    assert h.dtype == dtype and all(g.dtype == dtype for g in grads)
    leaves64 = [t.double().requires_grad_() for t in (gates, tokens, init)]
    h64 = reference(*leaves64)
    grads64 = torch.autograd.grad(h64, leaves64, torch.ones_like(h64))
    return [((got.double() - want).abs().max() / want.abs().max()).item()
            for got, want in zip([h, *grads], [h64, *grads64])]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_low_precision_accumulates_in_float32(dtype):
    assert max(low_precision_errors(linear_scan, dtype)) < low_precision_tolerance(dtype, 700)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_the_low_precision_check_catches_accumulation_in_the_input_dtype(dtype):
    """The bug the tolerance guards against: a scan that rounds its state to the input dtype at every
    step (what accumulating in float16 or bfloat16 does) fails it."""
    def rounding_scan(gates, tokens, init):
        h, states = init, []
        for t in range(tokens.shape[-1]):
            h = (gates[..., t].float() * h.float() + tokens[..., t].float()).to(tokens.dtype)
            states.append(h)
        return torch.stack(states, -1)
    assert max(low_precision_errors(rounding_scan, dtype)) > low_precision_tolerance(dtype, 700)


def test_the_gradient_checks_catch_an_unshifted_gate():
    """The derivation's easy slip, the adjoint scanned with a_t instead of a_{t+1} (or h_t instead of
    h_{t-1} in d_gates), gives gradients the float64 comparison of test_every_gradient_float64 rejects."""
    gates, tokens, _ = make_inputs((2, 33), torch.float64, seed=21, with_init=False)
    grad = torch.randn(2, 33, dtype=torch.float64, device=DEVICE)
    leaves = [t.clone().requires_grad_() for t in (gates, tokens)]
    want = torch.autograd.grad(reference(*leaves), leaves, grad)
    h = linear_scan(gates, tokens)
    delta_unshifted = linear_scan(gates, grad, reverse=True)  # wrong: gates not shifted
    h_prev = torch.cat([torch.zeros_like(h[:, :1]), h[:, :-1]], -1)
    for got, expected in [(delta_unshifted, want[1]), (h * delta_unshifted, want[0]), (h * grad, want[0])]:
        with pytest.raises(AssertionError):
            torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-10)
    delta = linear_scan(torch.cat([gates[:, 1:], torch.zeros_like(gates[:, :1])], -1), grad, reverse=True)
    torch.testing.assert_close(delta, want[1], rtol=1e-10, atol=1e-10)  # the shifted one is right
    torch.testing.assert_close(h_prev * delta, want[0], rtol=1e-10, atol=1e-10)


def test_non_contiguous_inputs():
    gates, tokens, init = make_inputs((40, 3), seed=8)
    gates_t, tokens_t = gates.t(), tokens.t()  # (3, 40), not contiguous
    init = init[:3]
    assert not tokens_t.is_contiguous()
    torch.testing.assert_close(linear_scan(gates_t, tokens_t, init).double(), reference(gates_t, tokens_t, init),
                               rtol=1e-5, atol=1e-5)


def test_reverse_is_flipped_forward():
    gates, tokens, init = make_inputs((3, 77), seed=9)
    flipped = linear_scan(gates.flip(-1), tokens.flip(-1), init).flip(-1)
    torch.testing.assert_close(linear_scan(gates, tokens, init, reverse=True), flipped)


@pytest.mark.parametrize("shape", [(3, 0), (0, 5), (0,)])
def test_empty(shape):
    gates = torch.rand(shape, device=DEVICE, requires_grad=True)
    init = torch.zeros(shape[:-1], device=DEVICE, requires_grad=True)
    h = linear_scan(gates, torch.randn(shape, device=DEVICE), init)
    assert h.shape == shape
    h.sum().backward()
    assert gates.grad.shape == shape and init.grad.shape == shape[:-1]
    assert not init.grad.any()


def _bad_calls():
    g, u = torch.rand(2, 5, device=DEVICE), torch.randn(2, 5, device=DEVICE)
    calls = [
        (ValueError, "broadcastable", lambda: linear_scan(g, u[:, :4])),
        (ValueError, "broadcastable", lambda: linear_scan(torch.rand(3, 5, device=DEVICE), u)),
        (TypeError, "tokens", lambda: linear_scan(g, u.long())),
        (TypeError, "tokens", lambda: linear_scan(g, u.tolist())),
        (TypeError, "gates", lambda: linear_scan(g.to(torch.int32), u.to(torch.int32))),
        (TypeError, "gates", lambda: linear_scan(g.tolist(), u)),
        (TypeError, "gates", lambda: linear_scan(True, u)),
        (TypeError, "gates", lambda: linear_scan(g.to(torch.complex64), u)),
        (ValueError, "at least one dimension", lambda: linear_scan(g[0, 0], u[0, 0])),
        (ValueError, "initial_state", lambda: linear_scan(g, u, torch.zeros(5, device=DEVICE))),
        (ValueError, "initial_state", lambda: linear_scan(g, u, torch.zeros(2, 1, device=DEVICE))),
        (TypeError, "initial_state", lambda: linear_scan(g, u, torch.zeros(2, device=DEVICE, dtype=torch.int64))),
        (TypeError, "initial_state", lambda: linear_scan(g, u, [0.0, 0.0])),
        (TypeError, "reverse", lambda: linear_scan(g, u, reverse="yes")),
        (ValueError, "chunk", lambda: linear_scan(g, u, chunk=48)),
    ]
    if ON_GPU:
        calls.append((ValueError, "device", lambda: linear_scan(g, u.cpu())))
        calls.append((ValueError, "CUDA", lambda: linear_scan(g.cpu(), u.cpu())))
    return calls


@pytest.mark.parametrize("error, words, call", _bad_calls())
def test_bad_input(error, words, call):
    with pytest.raises(error, match=words):
        call()


# Autograd as users meet it: version counters, in-place edits, second derivatives, 0-dim states, NaN.

def test_in_place_change_of_a_saved_input_is_reported_at_backward():
    """The saved gates and initial state share the caller's version counters: editing them after the
    call (and before backward) raises autograd's usual error instead of giving a wrong gradient."""
    for edited in ("gates", "initial_state"):
        gates, tokens, init = make_inputs((2, 9), seed=12)
        gates, init = gates.requires_grad_() * 1, init.requires_grad_() * 1   # non-leaf, require grad
        h = linear_scan(gates, tokens, init)
        {"gates": gates, "initial_state": init}[edited].mul_(3)
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            h.sum().backward()


def test_output_may_be_modified_in_place_when_no_backward_follows():
    gates, tokens, init = make_inputs((2, 9), seed=13)
    tokens.requires_grad_()
    h = linear_scan(gates, tokens, init)
    h.mul_(2)
    torch.testing.assert_close(h.detach().double(), 2 * reference(gates, tokens.detach(), init), rtol=1e-5, atol=1e-5)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        h.sum().backward()   # the backward needs h as the forward wrote it


@pytest.mark.parametrize("reverse", [False, True])
def test_gradgradcheck(reverse):
    gates, tokens, init = make_inputs((2, 5), torch.float64, seed=14)
    leaves = [t.requires_grad_() for t in (gates, tokens, init)]
    assert torch.autograd.gradgradcheck(lambda g, u, h: linear_scan(g, u, h, reverse, chunk=16), leaves)


def test_second_derivatives_through_torch_func_reverse_mode_only():
    """What the README promises: jacrev of jacrev matches the loop's; forward mode (torch.func.jvp, and
    so torch.func.hessian) has no rule and raises."""
    gates, tokens, init = make_inputs((6,), torch.float64, seed=19)
    loss = lambda scan: lambda u: (scan(gates, u, init, False) ** 2).sum()  # noqa: E731
    ours, theirs = (torch.func.jacrev(torch.func.jacrev(loss(scan)))(tokens) for scan in (linear_scan, reference))
    torch.testing.assert_close(ours, theirs, rtol=1e-10, atol=1e-10)
    with pytest.raises(NotImplementedError, match="jvp"):
        torch.func.jvp(loss(linear_scan), (tokens,), (torch.ones_like(tokens),))


@pytest.mark.parametrize("reverse", [False, True])
def test_hessian_matches_the_loop(reverse):
    """h is linear in the tokens and in the initial state, multilinear in the gates (a product of up to L of
    them): the true Hessian is not zero."""
    gates, tokens, init = make_inputs((6,), torch.float64, seed=18)
    def loss(scan):
        return lambda g, u, h0: (scan(g, u, h0, reverse) ** 2).sum() + scan(g, u, h0, reverse)[-1]
    ours = torch.autograd.functional.hessian(loss(linear_scan), (gates, tokens, init))
    theirs = torch.autograd.functional.hessian(loss(reference), (gates, tokens, init))
    for row_ours, row_theirs in zip(ours, theirs):
        for block_ours, block_theirs in zip(row_ours, row_theirs):
            torch.testing.assert_close(block_ours, block_theirs, rtol=1e-10, atol=1e-10)
    assert ours[0][1].abs().max() > 0.1


def test_second_derivative_with_allow_unused():
    """d(d_tokens)/d(gates) exists (d_tokens is the adjoint, a scan of the gates): never None, never zeros."""
    gates, tokens, _ = make_inputs((2, 9), torch.float64, seed=19, with_init=False)
    def second(scan):
        g, u = gates.clone().requires_grad_(), tokens.clone().requires_grad_()
        (d_tokens,) = torch.autograd.grad(scan(g, u).sum(), u, create_graph=True)
        return torch.autograd.grad(d_tokens.pow(2).sum(), g, allow_unused=True)[0]
    ours, theirs = second(linear_scan), second(reference)
    assert ours is not None and theirs.abs().max() > 0
    torch.testing.assert_close(ours, theirs, rtol=1e-10, atol=1e-10)


# The torch.func transforms and torch.compile: the kernels are custom ops with fake impls and vmap rules.

def test_func_grad():
    gates, tokens, init = make_inputs((3, 20), torch.float64, seed=22)
    for reverse in (False, True):
        ours = torch.func.grad(lambda g, u, h: (linear_scan(g, u, h, reverse) ** 2).sum(), argnums=(0, 1, 2))(
            gates, tokens, init)
        leaves = [t.clone().requires_grad_() for t in (gates, tokens, init)]
        theirs = torch.autograd.grad((reference(*leaves, reverse) ** 2).sum(), leaves)
        for got, want in zip(ours, theirs):
            torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)


def test_vmap_and_vmap_of_grad():
    gates, tokens, init = make_inputs((4, 3, 17), torch.float64, seed=23)
    # batch dim 1 of gates, 0 of tokens, unbatched initial state (3,) shared by every sample
    batched = torch.func.vmap(lambda g, u: linear_scan(g, u, init[0], reverse=True), in_dims=(1, 0))(
        gates.transpose(0, 1), tokens)
    torch.testing.assert_close(batched, linear_scan(gates, tokens, init[0].expand(4, 3), reverse=True))
    grads = torch.func.vmap(torch.func.grad(lambda g, u: linear_scan(g, u).pow(2).sum(), argnums=(0, 1)))(gates, tokens)
    leaves = [t.clone().requires_grad_() for t in (gates, tokens)]
    theirs = torch.autograd.grad(reference(*leaves).pow(2).sum(), leaves)
    for got, want in zip(grads, theirs):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)


def test_compile_fullgraph():
    gates, tokens, init = make_inputs((2, 3, 40), torch.float32, seed=24)
    leaves = [t.clone().requires_grad_() for t in (gates, tokens, init)]
    compiled = torch.compile(lambda g, u, h: linear_scan(0.5 * g + 0.5, u, h, chunk=16) * 2, fullgraph=True,
                             backend="aot_eager")
    out = compiled(*leaves)
    ours = torch.autograd.grad(out.sum(), leaves)
    plain = [t.clone().requires_grad_() for t in (gates, tokens, init)]
    expected = linear_scan(0.5 * plain[0] + 0.5, plain[1], plain[2], chunk=16) * 2
    torch.testing.assert_close(out, expected)
    for got, want in zip(ours, torch.autograd.grad(expected.sum(), plain)):
        torch.testing.assert_close(got, want)


# Broadcasting and type promotion, as gates * tokens would do.

@pytest.mark.parametrize("gate_shape", [(), (3, 1), (1, 1), (20,), (2, 3, 20)])
def test_gates_broadcast_against_tokens(gate_shape):
    """A scalar or per-channel EMA gate needs no manual expand; its gradient is summed back to its shape."""
    gen = torch.Generator().manual_seed(25)
    gates = (0.5 + 0.5 * torch.rand(gate_shape, generator=gen, dtype=torch.float64)).to(DEVICE).requires_grad_()
    tokens = torch.randn(2, 3, 20, generator=gen, dtype=torch.float64).to(DEVICE).requires_grad_()
    init = torch.randn((), generator=gen, dtype=torch.float64).to(DEVICE).requires_grad_()  # one state for all rows
    grad = torch.randn(2, 3, 20, dtype=torch.float64, device=DEVICE)
    h = linear_scan(gates, tokens, init)
    want_h = reference(gates.expand(2, 3, 20), tokens, init.expand(2, 3))
    torch.testing.assert_close(h, want_h, rtol=1e-12, atol=1e-12)
    ours = torch.autograd.grad(h, (gates, tokens, init), grad)
    theirs = torch.autograd.grad(want_h, (gates, tokens, init), grad)
    for got, want, leaf in zip(ours, theirs, (gates, tokens, init)):
        assert got.shape == leaf.shape
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)


def test_python_number_gate():
    tokens = make_inputs((3, 30), seed=26)[1]
    torch.testing.assert_close(linear_scan(0.9, tokens), linear_scan(torch.full_like(tokens, 0.9), tokens))


@pytest.mark.parametrize("gate_dtype, token_dtype, init_dtype, expected", [
    (torch.float16, torch.float32, None, torch.float32),
    (torch.float32, torch.bfloat16, None, torch.float32),
    (torch.bfloat16, torch.float16, None, torch.float32),
    (torch.float64, torch.float32, torch.float16, torch.float64),
    (torch.float16, torch.float16, torch.float32, torch.float32),
])
def test_dtypes_promote_like_torch(gate_dtype, token_dtype, init_dtype, expected):
    gates, tokens, init = make_inputs((2, 3, 25), torch.float64, seed=27)
    gates, tokens = gates.to(gate_dtype).requires_grad_(), tokens.to(token_dtype).requires_grad_()
    init = None if init_dtype is None else init.to(init_dtype)
    h = linear_scan(gates, tokens, init)
    assert h.dtype == expected == torch.promote_types(torch.promote_types(gate_dtype, token_dtype), init_dtype or gate_dtype)
    torch.testing.assert_close(h.double(), reference(gates, tokens, init), rtol=1e-5, atol=1e-5)
    d_gates, d_tokens = torch.autograd.grad(h.sum(), (gates, tokens))
    assert d_gates.dtype == gate_dtype and d_tokens.dtype == token_dtype


def test_zero_dim_gate_does_not_promote_tokens():
    """As in torch arithmetic, a 0-dim tensor (or a Python number) does not raise the dtype of a tensor with dims."""
    tokens = make_inputs((2, 10), torch.float16, seed=28)[1]
    assert linear_scan(torch.tensor(0.5, dtype=torch.float64, device=DEVICE), tokens).dtype == torch.float16
    assert linear_scan(0.5, tokens).dtype == torch.float16
    assert linear_scan(torch.full((10,), 0.5, dtype=torch.float32, device=DEVICE), tokens[0, 0]).dtype == torch.float32


def test_zero_dim_initial_state_of_a_single_row():
    gates, tokens, _ = make_inputs((11,), torch.float64, seed=15, with_init=False)
    init = torch.tensor(0.7, dtype=torch.float64, device=DEVICE, requires_grad=True)
    for reverse in (False, True):
        torch.testing.assert_close(linear_scan(gates, tokens, init, reverse), reference(gates, tokens, init, reverse))
        (d_init,) = torch.autograd.grad(linear_scan(gates, tokens, init, reverse).sum(), init)
        (expected,) = torch.autograd.grad(reference(gates, tokens, init, reverse).sum(), init)
        assert d_init.shape == () and torch.allclose(d_init, expected)


def test_expanded_inputs_and_gradient_in_one_argument_only():
    gates, tokens, _ = make_inputs((1, 40), torch.float64, seed=16)
    shared = tokens[0].clone().requires_grad_()
    h = linear_scan(gates.expand(3, 40), shared.expand(3, 40))   # stride-0 rows
    (ours,) = torch.autograd.grad(h.sum(), shared)
    (theirs,) = torch.autograd.grad(reference(gates.expand(3, 40), shared.expand(3, 40)).sum(), shared)
    torch.testing.assert_close(ours, theirs)


def test_nan_and_inf_propagate_like_the_loop():
    gates, tokens, init = make_inputs((3, 40), torch.float64, seed=17)
    gates[0, 7], tokens[1, 20], init[2] = float("nan"), float("inf"), float("nan")
    for reverse in (False, True):
        h, expected = linear_scan(gates, tokens, init, reverse), reference(gates, tokens, init, reverse)
        assert torch.equal(h.isnan(), expected.isnan()) and torch.equal(h.isinf(), expected.isinf())
        assert h.isnan().any() and h.isfinite().any()
        torch.testing.assert_close(h[expected.isfinite()], expected[expected.isfinite()])


# The interpreter folds tl.associative_scan left to right, so a non-associative combine would pass every
# kernel test on the CPU: check the property itself, on the very Python function the kernels trace.
def test_first_order_op_is_associative_with_identity():
    op = sys.modules["scan_lib.ema"].first_order_op.fn
    gen = torch.Generator().manual_seed(0)
    p, q, r = (torch.randn(2, 10_000, dtype=torch.float64, generator=gen) for _ in range(3))
    for left, right in zip(op(*op(*p, *q), *r), op(*p, *op(*q, *r))):
        torch.testing.assert_close(left, right, rtol=1e-12, atol=1e-12)
    one, zero = torch.ones_like(p[0]), torch.zeros_like(p[1])
    assert all(torch.equal(x, y) for x, y in zip(op(one, zero, *p), p))
    assert all(torch.equal(x, y) for x, y in zip(op(*p, one, zero), p))


def test_the_associativity_check_can_fail():
    def later_gate_only(a_left, b_left, a_right, b_right):  # forgets the earlier gate: not associative
        return a_right, a_right * b_left + b_right
    gen = torch.Generator().manual_seed(1)
    p, q, r = (torch.randn(2, 1000, dtype=torch.float64, generator=gen) for _ in range(3))
    left, right = later_gate_only(*later_gate_only(*p, *q), *r), later_gate_only(*p, *later_gate_only(*q, *r))
    assert not all(torch.allclose(x, y) for x, y in zip(left, right))

"""scan_lib.selective_scan (chapter 07's kernels) against the float64 reference, the chunking identity,
gradcheck, bad input, torch.func / torch.compile, bugs injected into the kernels, and (where mamba_ssm is
importable, on a GPU) against mamba_ssm's selective_scan_fn. Chapter 05's teaching kernels
(scan_lib.selective_scan.selective_scan) are checked against the reference too, with their launch
configurations and injected bugs."""
import functools
import math
import sys
import types

import pytest
import torch

import scan_lib  # first: without a GPU it switches Triton to its interpreter, before triton.language loads
import triton
import triton.language as tl
from scan_lib.mamba import features_first, positions_last
from scan_lib.multistate import tolerance   # chapter 04's error model, as chapter 05 checks with it
from scan_lib.runtime import DEVICE, INTERPRET, ON_GPU
from scan_lib.selective_scan import selective_scan_ref

MODULE = sys.modules["scan_lib.selective_scan"]  # chapter 05's module: scan_lib.selective_scan is a function
FAST = sys.modules["scan_lib.fast_selective_scan"]  # chapter 07's: the public scan_lib.selective_scan

NAMES = ["u", "delta", "A", "B", "C", "D", "z", "delta_bias", "initial_state"]


def make_inputs(batch, dim, N, L, groups=None, D=True, z=True, bias=True, h0=True, dtype=torch.float32, seed=0,
                time_invariant=""):
    g = torch.Generator().manual_seed(seed)

    def rand(*shape, scale=1.0, shift=0.0, dt=dtype):
        return (torch.randn(*shape, generator=g) * scale + shift).to(device=DEVICE, dtype=dt)

    wide = torch.float64 if dtype == torch.float64 else torch.float32
    bc = (batch, N, L) if groups is None else (batch, groups, N, L)
    inputs = dict(u=rand(batch, dim, L), delta=rand(batch, dim, L, scale=0.5, shift=-1.0),
                  A=(-torch.rand(dim, N, generator=g) - 0.2).to(device=DEVICE, dtype=wide), B=rand(*bc), C=rand(*bc),
                  D=rand(dim, dt=wide) if D else None, z=rand(batch, dim, L) if z else None,
                  delta_bias=rand(dim, scale=0.3, dt=wide) if bias else None,
                  initial_state=rand(batch, dim, N, dt=wide) if h0 else None)
    for name in time_invariant:  # B and/or C of shape (dim, N)
        inputs[name] = rand(dim, N)
    return inputs


def run(fn, inputs, dout, dlast, softplus, cast=None):
    leaves = {k: (v if cast is None else v.to(cast)).detach().requires_grad_(True)
              for k, v in inputs.items() if v is not None}
    out, last = fn(**{k: leaves.get(k) for k in inputs}, delta_softplus=softplus, return_last_state=True)
    loss = (out.double() * dout).sum() + (last.double() * dlast).sum()
    return out, last, dict(zip(leaves, torch.autograd.grad(loss, list(leaves.values()))))


def rel_err(x, ref):
    """Max abs error relative to the reference's scale; an exactly-zero reference must be matched exactly."""
    scale, err = ref.double().abs().max().item(), (x.double() - ref.double()).abs().max().item()
    if scale == 0.0:
        return 0.0 if err == 0.0 else float("inf")
    return err / scale


def compare(inputs, softplus=True, tol=None, scan=None):
    scan = scan or scan_lib.selective_scan
    torch.manual_seed(1)
    u = inputs["u"]
    tol = tolerance(u.dtype, u.shape[2]) if tol is None else tol
    # dout representable in u's dtype: autograd hands our backward dout in out's dtype, the reference's in
    # float64; rounding it for both keeps bf16's 3 significant digits out of sums such as dD.
    dout = torch.randn(u.shape, dtype=torch.float64, device=DEVICE).to(u.dtype).double()
    dlast = torch.randn(*u.shape[:2], inputs["A"].shape[1], dtype=torch.float64, device=DEVICE)
    out, last, grads = run(scan, inputs, dout, dlast, softplus)
    out_r, last_r, grads_r = run(selective_scan_ref, inputs, dout, dlast, softplus, cast=torch.float64)
    assert out.dtype == u.dtype and out.shape == u.shape
    assert last.dtype == (torch.float64 if u.dtype == torch.float64 else torch.float32)
    errors = {"out": rel_err(out, out_r), "last": rel_err(last, last_r)}
    assert set(grads) == {k for k, v in inputs.items() if v is not None}
    for name, grad in grads.items():
        assert grad.dtype == inputs[name].dtype and grad.shape == inputs[name].shape, name
        errors["d" + name] = rel_err(grad, grads_r[name])
    with torch.no_grad():  # the inference path: the forward's own chunk, nothing kept
        out_ng, last_ng = scan(**inputs, delta_softplus=softplus, return_last_state=True)
    errors.update(out_no_grad=rel_err(out_ng, out_r), last_no_grad=rel_err(last_ng, last_r))
    assert all(e < tol for e in errors.values()), errors


@pytest.mark.parametrize("batch,dim,N,L,options", [
    (2, 4, 3, 1, dict()),
    (2, 4, 3, 1, dict(h0=False)),  # dA is exactly 0 in the reference, so must be ours
    (1, 6, 4, 7, dict(groups=3, bias=False)),
    (1, 4, 2, 129, dict(groups=2, z=False, h0=False)),
    (1, 3, 5, 50, dict(D=False, z=False, bias=False)),
    (1, 2, 2, 1000 if ON_GPU else 400, dict(groups=1)),
])
@pytest.mark.parametrize("scan", [MODULE.selective_scan, FAST.selective_scan], ids=["05", "07"])
def test_matches_reference(batch, dim, N, L, options, scan):
    if scan is MODULE.selective_scan and L > 200 and not ON_GPU:
        pytest.skip("chapter 05 at long lengths on the interpreter: CI time (the case runs for chapter 07, and for both on a GPU)")
    compare(make_inputs(batch, dim, N, L, seed=L, **options), scan=scan)


def test_length_one_dA_is_exactly_zero():
    """At L=1 with no initial state, h_{-1} = 0: dA = sum delta G a h_{-1} is exactly 0, not rounding noise."""
    inputs = make_inputs(2, 8, 4, 1, h0=False, seed=5)
    inputs["delta"] = inputs["delta"] * 0 - 8.0  # tiny steps: a close to 1, |b| >> |a h_{-1}| would cancel
    A = inputs["A"].detach().requires_grad_(True)
    out = scan_lib.selective_scan(**{**inputs, "A": A}, delta_softplus=True)
    (dA,) = torch.autograd.grad(out.sum(), [A])
    assert torch.equal(dA, torch.zeros_like(dA))


CONFIGS = "GPU" if ON_GPU else "CPU"


@pytest.mark.parametrize("fwd,bwd,groups", [
    (dict(block_d=4), dict(block_d=4), 2),     # 2 groups of 4 channels: a block of 4 fits a group
    (dict(block_d=4), dict(block_d=8), None),  # no groups: all 8 channels in one program (backward)
    (dict(chunk=64), dict(chunk=16), 2),   # inference with a larger chunk than training (which uses the backward's)
    (dict(chunk=4), dict(chunk=2), 2),     # tiny chunks: many carries, first and last positions adjacent
])
def test_launch_configs_agree(monkeypatch, fwd, bwd, groups):
    monkeypatch.setattr(MODULE, f"{CONFIGS}_FWD_CONFIG", {**getattr(MODULE, f"{CONFIGS}_FWD_CONFIG"), **fwd})
    monkeypatch.setattr(MODULE, f"{CONFIGS}_BWD_CONFIG", {**getattr(MODULE, f"{CONFIGS}_BWD_CONFIG"), **bwd})
    dim, L, g = 8, 30, groups or 1
    for kind, wanted in (("fwd", fwd), ("bwd", bwd)):  # the block size asked for really runs
        if "block_d" in wanted:
            assert MODULE._launch_config(kind, dim, g, g, L)["block_d"] == wanted["block_d"]
    compare(make_inputs(1, dim, 2, L, groups=groups, h0=False, seed=8), scan=MODULE.selective_scan)


def test_block_never_straddles_a_group(monkeypatch):
    """Channels of one program share one B row: with 4 groups of 2 channels a block of 4 is cut to 2."""
    monkeypatch.setattr(MODULE, f"{CONFIGS}_FWD_CONFIG", {**getattr(MODULE, f"{CONFIGS}_FWD_CONFIG"), "block_d": 4})
    assert MODULE._launch_config("fwd", 8, 4, 1, 40)["block_d"] == 2
    assert MODULE._launch_config("fwd", 8, 1, 1, 40)["block_d"] == 4
    compare(make_inputs(1, 8, 2, 20, groups=4, h0=False, seed=3), scan=MODULE.selective_scan)


def test_boundary_states_kept_only_for_grad(monkeypatch):
    """Inference (no input needs a gradient) keeps nothing; training keeps one float32 state per backward
    chunk, (batch, dim, N, ceil(L / CHUNK_bwd)), and ybar (before the gate) (batch, dim, L) in float32, and
    no more; the output is the same up to rounding (the two may scan in different chunks)."""
    module = MODULE
    save_chunks, kept = [], []

    def recording_forward(*args):
        save_chunks.append(args[-1])
        result = forward(*args)
        kept.append(result[2:])
        return result

    forward = module.selective_scan_fwd
    monkeypatch.setattr(module, "selective_scan_fwd", recording_forward)
    batch, dim, N, L = 1, 4, 3, 40
    inputs = make_inputs(batch, dim, N, L, seed=2)
    with torch.no_grad():
        out_ng = module.selective_scan(**inputs, delta_softplus=True)
    leaves = {k: v.detach().requires_grad_(True) for k, v in inputs.items()}
    out = module.selective_scan(**leaves, delta_softplus=True)
    chunk_bwd = module._launch_config("bwd", dim, 1, 1, L)["chunk"]   # the configured chunk, capped by L
    assert save_chunks == [0, chunk_bwd] and kept[0][0].numel() == 0 and kept[0][1].numel() == 0
    states, y = kept[1]
    assert states.shape == (batch, dim, N, -(-L // chunk_bwd)) and states.dtype == torch.float32
    assert y.shape == (batch, dim, L) and y.dtype == torch.float32
    torch.testing.assert_close(out.detach(), out_ng, rtol=1e-6, atol=1e-6)


def test_softplus_keeps_tiny_steps():
    """softplus(x) for x around -20 is about 2e-9: log(1 + e^x) in float32 would round it to 0 (and with
    no D, z the output to 0); the kernel's log1p trick keeps it to full relative precision."""
    inputs = make_inputs(2, 4, 3, 33, D=False, z=False, bias=False, h0=False, seed=10)
    inputs["delta"] = inputs["delta"] - 19.0   # pre-activations around -20
    compare(inputs, softplus=True)


def test_softplus_large_steps():
    """Large pre-activations: softplus(x) = x to rounding, the state forgets almost at once."""
    inputs = make_inputs(2, 4, 3, 33, bias=False, seed=11)
    inputs["delta"] = inputs["delta"] + 26.0   # pre-activations around 25
    compare(inputs, softplus=True)


def test_no_softplus_no_options():
    compare(make_inputs(1, 5, 3, 40, D=False, z=False, bias=False, h0=False, seed=3), softplus=False)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_inputs(dtype):
    compare(make_inputs(1, 4, 4, 40, groups=2, dtype=dtype, seed=4))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64])
def test_long_sequence_crosses_chunks(dtype):
    """Carries across several chunks of the GPU's default size (512), in every precision."""
    compare(make_inputs(1, 2, 5, 1300 if ON_GPU else 70, dtype=dtype, seed=6))


@pytest.mark.parametrize("time_invariant,groups,dtype", [
    ("BC", None, torch.float32),
    ("B", 2, torch.float32),
    ("C", None, torch.float32),
    ("BC", None, torch.bfloat16),
    ("BC", None, torch.float64),
])
def test_time_invariant_B_C(time_invariant, groups, dtype):
    """B and/or C of shape (dim, N), the same at every batch element and position (mamba_ssm accepts them):
    the output and every gradient, dB and dC of shape (dim, N) summed over the batch and positions."""
    compare(make_inputs(2, 4, 3, 20, groups=groups, dtype=dtype, time_invariant=time_invariant, seed=12))


def test_non_contiguous_inputs():
    inputs = make_inputs(2, 4, 3, 20, groups=2, seed=6)
    # u, delta, z as slices of wider (batch, L, 2*dim) tensors, transposed: L is not the inner dimension.
    for name in ("u", "delta", "z"):
        wide = torch.cat([inputs[name], inputs[name]], dim=1).transpose(1, 2).contiguous().transpose(1, 2)
        inputs[name] = wide[:, :4]
        assert not inputs[name].is_contiguous()
    compare(inputs)


def test_random_shapes_and_options():
    rng = torch.Generator().manual_seed(123)
    for trial in range(3):
        batch, groups, per_group, N = (int(torch.randint(1, 4, (1,), generator=rng)) for _ in range(4))
        L = int(torch.randint(1, 70, (1,), generator=rng))
        flags = torch.rand(4, generator=rng) < 0.5
        compare(make_inputs(batch, groups * per_group, N, L, groups=groups, D=bool(flags[0]), z=bool(flags[1]),
                            bias=bool(flags[2]), h0=bool(flags[3]), seed=trial),
                softplus=trial % 2 == 0)


def test_chunked_equals_whole():
    """Scanning in pieces, carrying last_state into initial_state, gives the same outputs and gradients."""
    inputs = {k: v.requires_grad_(True) for k, v in make_inputs(1, 4, 3, 25, groups=2, dtype=torch.float64).items()}
    dout = torch.randn(1, 4, 25, dtype=torch.float64, device=DEVICE)
    dlast = torch.randn(1, 4, 3, dtype=torch.float64, device=DEVICE)
    results = []
    for pieces in ([25], [10, 1, 14], [8, 8, 9]):
        outs, state, start = [], inputs["initial_state"], 0
        for length in pieces:
            sl = slice(start, start + length)
            part = {k: (v[..., sl] if k in ("u", "delta", "z", "B", "C") else v) for k, v in inputs.items()}
            out, state = scan_lib.selective_scan(**{**part, "initial_state": state}, delta_softplus=True,
                                                 return_last_state=True)
            outs.append(out)
            start += length
        out = torch.cat(outs, dim=-1)
        grads = torch.autograd.grad((out * dout).sum() + (state * dlast).sum(), list(inputs.values()))
        results.append((out, state, grads))
    for out, state, grads in results[1:]:
        assert torch.allclose(out, results[0][0], rtol=0, atol=1e-12)
        assert torch.allclose(state, results[0][1], rtol=0, atol=1e-12)
        for g, w in zip(grads, results[0][2]):
            assert torch.allclose(g, w, rtol=0, atol=1e-12)


@pytest.mark.parametrize("time_invariant", ["", "BC"])
def test_gradcheck_float64(monkeypatch, time_invariant):
    """Every input's Jacobian, column by column (fast_mode=False), on a small problem crossing chunks (of 2
    positions: training runs the forward with the backward's chunk) and ending in a partial one."""
    configs = getattr(FAST, f"{CONFIGS}_CONFIG")
    monkeypatch.setitem(configs, "bwd", {**configs["bwd"], "chunk": 2})
    inputs = make_inputs(1, 2, 2, 3, dtype=torch.float64, seed=9, time_invariant=time_invariant)
    leaves = [inputs[k].requires_grad_(True) for k in NAMES]

    def f(*args):
        return scan_lib.selective_scan(*args[:8], delta_softplus=True, return_last_state=True, initial_state=args[8])

    assert torch.autograd.gradcheck(f, leaves, eps=1e-6, atol=1e-7, rtol=1e-5, fast_mode=False)


def _small_float64(seed=4, shape=(1, 2, 3, 5)):
    inputs = make_inputs(*shape, dtype=torch.float64, seed=seed)
    u = inputs.pop("u")
    return u, (lambda u: scan_lib.selective_scan(u, **inputs, delta_softplus=True))


def test_hessian_raises():
    """A second derivative through selective_scan raises instead of silently leaving the scan out."""
    u, f = _small_float64()
    with pytest.raises(RuntimeError, match="selective_scan has no second derivative"):
        torch.autograd.functional.hessian(lambda u: (f(u) ** 2).sum() + (u ** 3).sum(), u)


@pytest.mark.parametrize("allow_unused", [False, True])
def test_double_backward_raises(allow_unused):
    """create_graph=True gives the first derivative; differentiating it again raises in every path,
    allow_unused included (where a gradient with no graph would come back as None)."""
    u, f = _small_float64()
    u.requires_grad_(True)
    (gu,) = torch.autograd.grad((f(u) ** 2).sum(), u, create_graph=True)
    (gu_plain,) = torch.autograd.grad((f(u) ** 2).sum(), u)
    assert torch.equal(gu.detach(), gu_plain)
    with pytest.raises(RuntimeError, match="selective_scan has no second derivative"):
        torch.autograd.grad(gu.sum(), u, allow_unused=allow_unused)


def test_gradgradcheck_raises():
    """gradgradcheck differentiates numerically before it reaches the second derivative: a tiny problem."""
    u, f = _small_float64(shape=(1, 1, 2, 2))
    with pytest.raises(RuntimeError, match="selective_scan has no second derivative"):
        torch.autograd.gradgradcheck(f, (u.requires_grad_(True),))


def test_func_grad_matches_autograd():
    inputs = make_inputs(2, 4, 3, 13, groups=2, dtype=torch.float64, seed=5)
    names = ["u", "delta", "A", "B", "initial_state"]

    def loss(*args):
        return (scan_lib.selective_scan(**{**inputs, **dict(zip(names, args))}, delta_softplus=True) ** 2).sum()

    grads = torch.func.grad(loss, argnums=tuple(range(len(names))))(*[inputs[k] for k in names])
    leaves = [inputs[k].detach().requires_grad_(True) for k in names]
    expected = torch.autograd.grad(loss(*leaves), leaves)
    for name, g, e in zip(names, grads, expected):
        torch.testing.assert_close(g, e, rtol=0, atol=1e-13, msg=name)


def test_vmap_matches_a_loop():
    """vmap over a leading dimension of u and of A (a per-element decay), and vmap of func.grad."""
    inputs = make_inputs(1, 2, 3, 9, dtype=torch.float64, seed=6)
    us = torch.randn(3, 1, 2, 9, dtype=torch.float64, device=DEVICE)
    As = -torch.rand(3, 2, 3, dtype=torch.float64, device=DEVICE) - 0.2
    rest = {k: v for k, v in inputs.items() if k not in ("u", "A")}

    def f(u, A):
        return scan_lib.selective_scan(u, A=A, **rest, delta_softplus=True)

    batched = torch.func.vmap(f)(us, As)
    for i in range(3):
        torch.testing.assert_close(batched[i], f(us[i], As[i]), rtol=0, atol=1e-13)
    grads = torch.func.vmap(torch.func.grad(lambda u, A: f(u, A).sum()))(us, As)
    for i in range(3):
        leaf = us[i].clone().requires_grad_(True)
        (expected,) = torch.autograd.grad(f(leaf, As[i]).sum(), leaf)
        torch.testing.assert_close(grads[i], expected, rtol=0, atol=1e-13)


def test_compile_fullgraph(monkeypatch):
    """torch.compile(fullgraph=True) traces through selective_scan (no graph break), forward and backward,
    after eager calls have filled the host's caches, and without reading them while it traces (Dynamo
    cannot hash a GPU Triton kernel among their keys, and would guard on them): with only the plans
    (which the ops' implementations use when the compiled graph runs) left, tracing still works."""
    torch._dynamo.reset()
    inputs = make_inputs(2, 4, 3, 12, groups=2, seed=7)
    leaves = {k: v.detach().requires_grad_(True) for k, v in inputs.items()}

    def f(**kw):
        out, last = scan_lib.selective_scan(**kw, delta_softplus=True, return_last_state=True)
        return 2 * out, last

    out_e, last_e = f(**leaves)
    with monkeypatch.context() as patch:
        patch.setattr(FAST, "CACHES", {"plans": FAST.CACHES["plans"]})
        compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
        out, last = compiled(**leaves)
    torch.testing.assert_close(out, out_e, rtol=0, atol=0)
    torch.testing.assert_close(last, last_e, rtol=0, atol=0)
    grads = torch.autograd.grad(out.sum() + last.sum(), list(leaves.values()))
    expected = torch.autograd.grad(out_e.sum() + last_e.sum(), list(leaves.values()))
    for g, e in zip(grads, expected):
        torch.testing.assert_close(g, e, rtol=1e-6, atol=1e-6)


def test_compile_and_make_fx_with_symbolic_sizes():
    """torch.compile with dynamic shapes (what a second sequence length turns on), forward and backward,
    and make_fx's symbolic tracing: the host's Python meets symbolic sizes there, so nothing it keeps
    per signature may need them to be concrete (a cache keyed on sizes must step aside)."""
    from torch.fx.experimental.proxy_tensor import make_fx
    torch._dynamo.reset()
    inputs = make_inputs(2, 4, 3, 12, groups=2, seed=7, time_invariant="C")
    leaves = {k: v.detach().requires_grad_(True) for k, v in inputs.items()}

    def f(**kw):
        out, last = scan_lib.selective_scan(**kw, delta_softplus=True, return_last_state=True)
        return out.sum() + last.sum()

    compiled = torch.compile(f, dynamic=True, backend="aot_eager")
    grads = torch.autograd.grad(compiled(**leaves), list(leaves.values()))
    expected = torch.autograd.grad(f(**leaves), list(leaves.values()))
    for g, e in zip(grads, expected):
        torch.testing.assert_close(g, e, rtol=1e-6, atol=1e-6)
    names = list(inputs)
    traced = make_fx(lambda *args: f(**dict(zip(names, args))), tracing_mode="symbolic")(*inputs.values())
    torch.testing.assert_close(traced(*inputs.values()), f(**inputs), rtol=1e-6, atol=1e-6)


def test_fake_tensors_give_shapes():
    from torch._subclasses.fake_tensor import FakeTensorMode
    inputs = make_inputs(2, 4, 3, 12, groups=2, seed=7, time_invariant="C")
    with FakeTensorMode(allow_non_fake_inputs=True):
        fake = {k: torch.empty_like(v) for k, v in inputs.items()}
        out, last = scan_lib.selective_scan(**fake, return_last_state=True)
    assert out.shape == (2, 4, 12) and last.shape == (2, 4, 3) and last.dtype == torch.float32


# Bugs injected into the kernels: the checks above must catch each. The interpreter looks the kernels'
# helpers up at run time, so replacing one in the module changes what the kernels compute; a compiled GPU
# kernel would not see the change, so these run under the interpreter only.
interpreter_only = pytest.mark.skipif(not INTERPRET, reason="injects bugs through the interpreter")


def _no_carry(tile, n, cols):
    """_column, broken: the carry (forward) and the adjoint carry (backward) between chunks read as 0."""
    return tl.sum(tl.where(cols[None, :] == n, tile, 0.0), axis=1) * 0.0


def _no_carry_in(CARRY, n, n_segments, d_ok):
    """Chapter 07's _carry_in, broken: the carries between chunks (forward and adjoint) read as 0."""
    return tl.load(CARRY + n * n_segments, d_ok, other=0.0) * 0.0


def _discretize_exp2_without_u(delta, rate2, B, step_u):
    """Chapter 07's discretize_exp2, broken: b = B, the step delta * u left out."""
    return tl.exp2(delta * rate2), B + 0.0 * step_u


def _discretize_without_u(delta, A, B, u):
    """discretize, broken: b = delta * B, the input u left out."""
    return tl.exp(delta * A), delta * B + 0.0 * u


def _half_combine(a_left, b_left, a_right, b_right):
    """first_order_op, broken: the scan's state rounded to float16 at every combine."""
    return a_left * a_right, (a_right * b_left + b_right).to(tl.float16).to(tl.float32)


def _as_kernel_helper(fn, module):
    """fn as a @triton.jit helper living in the kernels' module (the interpreter expects a kernel's helpers
    to share its globals)."""
    return triton.jit(types.FunctionType(fn.__code__, module.__dict__, fn.__name__))


@interpreter_only
@pytest.mark.parametrize("module,helper,bug", [
    (MODULE, "_column", _no_carry), (MODULE, "discretize", _discretize_without_u),
    (MODULE, "first_order_op", _half_combine), (FAST, "_carry_in", _no_carry_in),
    (FAST, "discretize_exp2", _discretize_exp2_without_u), (FAST, "first_order_op", _half_combine)],
    ids=["05-carry", "05-discretize", "05-combine", "07-carry", "07-discretize", "07-combine"])
def test_checks_catch_injected_bugs(monkeypatch, module, helper, bug):
    monkeypatch.setattr(module, helper, _as_kernel_helper(bug, module))
    inputs = make_inputs(1, 2, 3, 40, h0=False, seed=13)   # 40 positions: several chunks
    with pytest.raises(AssertionError):
        compare(inputs, scan=module.selective_scan)
    monkeypatch.undo()
    compare(inputs, scan=module.selective_scan)   # and the same check passes without the bug


def test_gradient_of_one_input_through_the_last_state_only():
    inputs = make_inputs(2, 4, 3, 11, groups=2, dtype=torch.float64, seed=6)
    for name in ("A", "initial_state", "u"):
        grads = []
        for fn in (scan_lib.selective_scan, selective_scan_ref):
            leaf = inputs[name].detach().requires_grad_(True)
            _, last = fn(**{**inputs, name: leaf}, delta_softplus=True, return_last_state=True)
            grads.append(torch.autograd.grad((last ** 2).sum(), leaf)[0])
        assert rel_err(*grads) < 1e-12, name

def test_return_types():
    inputs = make_inputs(1, 2, 2, 3, seed=1)
    out = scan_lib.selective_scan(**inputs)
    assert isinstance(out, torch.Tensor) and out.shape == (1, 2, 3)
    out2, last = scan_lib.selective_scan(**inputs, return_last_state=True)
    assert torch.equal(out, out2) and last.shape == (1, 2, 2)


@pytest.mark.parametrize("change,error,message", [
    (dict(u=torch.randn(4, 9)), ValueError, "u must have shape"),
    (dict(delta=torch.randn(2, 4, 5)), ValueError, "delta must have shape"),
    (dict(A=torch.randn(4, 3, dtype=torch.complex64)), TypeError, "A must be real: complex A"),
    (dict(B=torch.randn(4, 2)), ValueError, "B of 2 dimensions (time-invariant) must have shape (dim=4, N=3)"),
    (dict(C=torch.randn(3, 3)), ValueError, "C of 2 dimensions (time-invariant) must have shape (dim=4, N=3)"),
    (dict(A=torch.randn(5, 3)), ValueError, "A must have shape"),
    (dict(B=torch.randn(2, 3, 3, 9)), ValueError, "B: the number of groups (3) must divide dim (4)"),
    (dict(C=torch.randn(2, 3, 8)), ValueError, "C must have shape"),
    (dict(D=torch.randn(5)), ValueError, "D must have shape"),
    (dict(z=torch.randn(2, 4, 8)), ValueError, "z must have shape"),
    (dict(delta_bias=torch.randn(3)), ValueError, "delta_bias must have shape"),
    (dict(initial_state=torch.randn(2, 4, 2)), ValueError, "initial_state must have shape"),
    (dict(u=torch.ones(2, 4, 9, dtype=torch.int32)), TypeError, "u must be float16"),
    (dict(B=[1.0]), TypeError, "B must be a torch.Tensor"),
    (dict(D=torch.randn(4, device="meta")), ValueError, "all tensors must be on one device"),
])
def test_bad_input(change, error, message):
    good = make_inputs(2, 4, 3, 9, groups=2)
    change = {k: (v.to(DEVICE) if isinstance(v, torch.Tensor) and v.device.type != "meta" else v)
              for k, v in change.items()}
    with pytest.raises(error, match=None) as info:
        scan_lib.selective_scan(**{**good, **change})
    assert message in str(info.value)


def test_against_mamba_ssm():
    try:
        from mamba_ssm.ops.selective_scan_interface import selective_scan_fn
    except ImportError as exc:
        pytest.skip(f"mamba_ssm.ops.selective_scan_interface not importable: {exc}")
    if not ON_GPU:
        pytest.skip("mamba_ssm's selective_scan_fn needs a CUDA GPU")
    for groups, L, time_invariant in [(None, 1, ""), (None, 257, ""), (2, 1000, ""), (None, 300, "BC"), (2, 300, "C")]:
        inputs = make_inputs(2, 64, 16, L, groups=groups, h0=False, seed=L, time_invariant=time_invariant)
        inputs.pop("initial_state")
        dout = torch.randn(2, 64, L, dtype=torch.float64, device=DEVICE)
        dlast = torch.zeros(2, 64, 16, dtype=torch.float64, device=DEVICE)  # mamba_ssm ignores d last_state
        ours = run(scan_lib.selective_scan, inputs, dout, dlast, True)
        theirs = run(selective_scan_fn, inputs, dout, dlast, True)
        # Relative to each tensor's scale; where mamba_ssm gives exact zeros (dA at L=1: h_{-1} = 0),
        # rel_err demands exact zeros from us too.
        assert rel_err(ours[0], theirs[0]) < 1e-4
        # For a time-invariant B, mamba_ssm's CUDA kernel scans delta * u without B and folds B into C
        # for the output, so the last state it returns is h / B (its selective_scan_ref returns h, as we do).
        their_last = theirs[1] * inputs["B"] if "B" in time_invariant else theirs[1]
        assert rel_err(ours[1], their_last) < 1e-4, (L, time_invariant, "last_state")
        for name in ours[2]:
            assert rel_err(ours[2][name], theirs[2][name]) < 1e-4, (L, time_invariant, name)


def test_sizes_past_32_bit_offsets_are_refused():
    """Chapter 05's kernels use 32-bit offsets: an input whose (batch, dim, L) tensors hold 2^31 elements or
    more is refused with a clear error (stride-0 views: nothing that large is allocated)."""
    batch, dim, L, N = 8, 2**14, 2**14, 4
    u = torch.zeros(1, 1, 1, device=DEVICE).expand(batch, dim, L)
    A = -torch.ones(dim, N, device=DEVICE)
    B = torch.zeros(1, 1, 1, device=DEVICE).expand(batch, N, L)
    with pytest.raises(ValueError, match="64-bit offsets"):
        MODULE.selective_scan(u, u, A, B, B)


# Chapter 07's kernels: their own launch configurations, what training keeps, strided views, 64-bit offsets.

@pytest.mark.parametrize("fwd,bwd,groups", [
    (dict(block_d=4), dict(block_d=4), 2),
    (dict(block_d=8), dict(block_d=2), None),
    (dict(chunk=64), dict(chunk=16), 2),
    (dict(chunk=4), dict(chunk=2), None),
])
def test_fast_launch_configs_agree(monkeypatch, fwd, bwd, groups):
    configs = getattr(FAST, f"{CONFIGS}_CONFIG")
    monkeypatch.setitem(configs, "fwd", {**configs["fwd"], **fwd})
    monkeypatch.setitem(configs, "bwd", {**configs["bwd"], **bwd})
    per_group = 8 // (groups or 1)
    for kind, wanted in (("fwd", fwd), ("bwd", bwd)):
        if "block_d" in wanted:
            assert FAST.launch_config(kind, 8, per_group, per_group, 30)["block_d"] == min(wanted["block_d"], per_group)
    compare(make_inputs(1, 8, 2, 30, groups=groups, seed=8))


def test_states_per_step():
    """The forward's UNROLL: a config's own "unroll" first; all states with 4 or fewer; else the first
    row of FORWARD_STATES_PER_STEP that fits the chunk and the programs per multiprocessor, 1 where none
    does; always a divisor of N."""
    gpu, sms = dict(block_d=1, chunk=512, num_warps=1), 132
    assert FAST.FORWARD_STATES_PER_STEP == ((256, 16, 16), (256, math.inf, 2), (512, 24, 2))
    assert FAST.states_per_step(gpu, 256, 16, 16 * sms, sms) == 16       # few programs, chunks of 256
    assert FAST.states_per_step(gpu, 128, 16, 16 * sms + 1, sms) == 2
    assert FAST.states_per_step(gpu, 512, 16, sms, sms) == 2              # few programs, long chunk
    assert FAST.states_per_step(gpu, 512, 16, 24 * sms + 1, sms) == 1
    assert FAST.states_per_step(gpu, 1024, 16, sms, sms) == 1             # past every row's chunk
    assert FAST.states_per_step(gpu, 128, 4, 100 * sms, sms) == 4         # few states: all of them
    assert FAST.states_per_step(gpu, 128, 3, 100 * sms, sms) == 3
    assert FAST.states_per_step(gpu, 256, 12, sms, sms) == 4              # a divisor of N
    assert FAST.states_per_step(dict(gpu, unroll=4), 128, 16, sms, sms) == 4   # the config's own
    assert FAST.states_per_step(dict(gpu, unroll=4), 128, 6, sms, None) == 2


def test_fast_forward_refuses_a_save_chunk_that_does_not_divide_its_chunk():
    """The forward saves the state entering every save_chunk positions inside its own chunk, so one must
    divide the other (the public function passes powers of two); otherwise states would be missed."""
    x = make_inputs(1, 4, 2, 40, seed=11)
    chunk = FAST.launch_config("fwd", 4, 4, 4, 40)["chunk"]
    with pytest.raises(ValueError, match="save_chunk"):
        FAST.strided_fwd(x["u"], x["delta"], x["A"], x["B"][:, None], x["C"][:, None], None, None, None, None,
                         False, chunk - 1, 1)


@pytest.mark.parametrize("unroll", [1, 2, 4])
def test_fast_states_per_step_agree(monkeypatch, unroll):
    """Every number of the forward's states per step computes the same scan (N 4: 1, 2 or all per step;
    N 3: one)."""
    configs = getattr(FAST, f"{CONFIGS}_CONFIG")
    monkeypatch.setitem(configs, "fwd", {**configs["fwd"], "unroll": unroll})
    compare(make_inputs(1, 4, 4, 21, seed=9))
    compare(make_inputs(1, 4, 3, 21, seed=10))


@pytest.mark.parametrize("segments,case", [
    (2, dict(batch=1, dim=4, N=3, L=77)),                       # 10 backward chunks of 8 (interpreter)
    (3, dict(batch=2, dim=4, N=2, L=40, groups=2, h0=False)),   # uneven segments, no initial state
    (7, dict(batch=1, dim=3, N=4, L=33, D=False, z=False, bias=False, time_invariant="BC")),
    (50, dict(batch=1, dim=2, N=2, L=9)),                       # more segments asked than chunks
])
def test_fast_split_into_segments(segments, case):
    """Chapter 07's three-phase split along L (scan_in_segments): forward, last state and every gradient
    match the reference, whatever the number of segments."""
    sizes = {k: case.pop(k) for k in ("batch", "dim", "N", "L")}
    inputs = make_inputs(*sizes.values(), seed=segments, **case)
    compare(inputs, scan=functools.partial(FAST.scan_in_segments, segments=segments))


def test_fast_split_counts_segments():
    assert FAST.split(10, 1) == (1, 10) and FAST.split(10, 3) == (3, 4) and FAST.split(10, 4) == (4, 3)
    assert FAST.split(2, 5) == (2, 1) and FAST.split(1, 8) == (1, 1)


def test_fast_host_helpers_match_triton():
    for n in [0, 1, 2, 3, 7, 8, 9, 1000, 2**20 + 1]:
        assert FAST.next_power_of_2(n) == triton.next_power_of_2(n), n
        for d in [1, 2, 3, 16, 1000]:
            assert FAST.cdiv(n, d) == triton.cdiv(n, d), (n, d)


def test_fast_launcher_reuses_a_compiled_kernel_only_for_its_alignment_and_device(monkeypatch):
    """A Launcher's GPU path, with a stand-in for a @triton.jit kernel: the first call per (device,
    alignments) goes through the kernel (Triton compiles and returns the compiled kernel), a later call
    straight to the compiled kernel's runner for the plan's grid, every parameter in order; a tensor of
    another alignment, another current device, or `through_triton` goes through the kernel again."""
    calls = []

    class Compiled:
        def __getitem__(self, grid):
            return lambda *args: calls.append(("compiled", grid, args))

    class Kernel:
        arg_names = ["X", "Y", "n", "BLOCK"]

        def __getitem__(self, grid):
            def run(*args, **constexprs):
                calls.append(("jit", grid, args, constexprs))
                return Compiled()
            return run
    device = [0]
    monkeypatch.setattr(FAST, "INTERPRET", False)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: device[0])
    x = torch.zeros(64)
    launcher = FAST.Launcher(Kernel(), (2, 1, 1), (32,), dict(BLOCK=4, num_warps=1))
    launcher(x, None)
    launcher(x, None)
    assert calls == [("jit", (2, 1, 1), (x, None, 32), dict(BLOCK=4, num_warps=1)),
                     ("compiled", (2, 1, 1), (x, None, 32, 4))]
    device[0] = 1
    for tensors in [(x[1:], None), (x, None)]:        # misaligned; another device
        calls.clear()
        launcher(*tensors)
        assert [call[0] for call in calls] == ["jit"], tensors
    calls.clear()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(FAST.Launcher, "through_triton", True)
        launcher(x, None)
    launcher(x, None)
    assert [call[0] for call in calls] == ["jit", "compiled"]


def test_fast_caches_are_bounded_and_skip_symbolic_keys(monkeypatch):
    """remember empties a cache that holds KEPT entries; cached builds without keeping anything when
    the key cannot be hashed (a SymInt under make_fx's symbolic tracing)."""
    monkeypatch.setattr(FAST, "KEPT", 3)
    cache = {}
    for key in range(5):
        FAST.remember(cache, key, key)
    assert cache == {3: 3, 4: 4}
    monkeypatch.setitem(FAST.CACHES, "test", cache)
    built = []

    def traced(x):
        value = FAST.cached("test", lambda: (x.shape,), lambda: built.append(x.shape) or 7)
        assert value == 7
        return x + 1
    from torch.fx.experimental.proxy_tensor import make_fx
    make_fx(traced, tracing_mode="symbolic")(torch.zeros(3))
    assert len(built) == 1 and cache == {3: 3, 4: 4}
    assert FAST.cached("test", lambda: "key", lambda: 8) == 8 and FAST.cached("test", lambda: "key", lambda: 9) == 8


def test_fast_plans_follow_the_config_and_the_kernels(monkeypatch):
    """A plan made before a change of CPU_CONFIG or of a kernel is not used after it: the launches run
    with the new chunk, and a kernel defined again (a notebook cell, the grader's swap) is the one
    launched."""
    launched = []
    call = FAST.Launcher.__call__
    monkeypatch.setattr(FAST.Launcher, "__call__",
                        lambda self, *tensors: launched.append((self.kernel, self.constexprs["CHUNK"])) or call(self, *tensors))
    inputs = make_inputs(1, 4, 2, 40, seed=0)
    FAST.selective_scan(**inputs)
    assert launched[-1] == (FAST.strided_fwd_kernel, FAST.launch_config("fwd", 4, 4, 4, 40)["chunk"])
    configs = FAST.CPU_CONFIG if INTERPRET else FAST.GPU_CONFIG
    assert configs["fwd"]["chunk"] != 4
    monkeypatch.setitem(configs, "fwd", dict(configs["fwd"], chunk=4))
    FAST.selective_scan(**inputs)
    assert launched[-1] == (FAST.strided_fwd_kernel, 4)

    class StandIn:     # a @triton.jit kernel whose launch does nothing, compiled or not
        arg_names = FAST.strided_fwd_kernel.arg_names

        def __getitem__(self, grid):
            return lambda *args, **constexprs: self
    stand_in = StandIn()
    monkeypatch.setattr(FAST, "strided_fwd_kernel", stand_in)
    FAST.selective_scan(**inputs)
    assert launched[-1] == (stand_in, 4)


def test_fast_checks_each_signature_until_it_passes(monkeypatch):
    """A call runs chapter 05's checks once per signature that passed them (call_plan); a failing one
    raises every time."""
    inputs = make_inputs(1, 4, 2, 8, seed=0)
    runs = []
    check = FAST._check_inputs
    monkeypatch.setattr(FAST, "_check_inputs", lambda *args: runs.append(1) or check(*args))
    monkeypatch.setitem(FAST.CACHES, "calls", {})
    for _ in range(2):
        FAST.selective_scan(**inputs)
    assert len(runs) == 1
    for _ in range(2):
        with pytest.raises(ValueError, match="delta"):
            FAST.selective_scan(**dict(inputs, delta=inputs["delta"][..., :-1]))
    assert len(runs) == 3


def test_fast_eager_calls_plan_once_and_skip_the_ops(monkeypatch):
    """A plain eager training step works out one signature (its call's plan) and runs no custom op;
    under the profiler (which names ops) or saved-tensor hooks (save_on_cpu, activation checkpointing)
    the same step goes through the ops, with the same results."""
    inputs = make_inputs(1, 2, 3, 7, seed=3)
    leaves = {k: v.detach().requires_grad_(True) for k, v in inputs.items()}

    def step():
        out, last = scan_lib.selective_scan(**leaves, delta_softplus=True, return_last_state=True)
        return (out, last, *torch.autograd.grad((out * out).sum() + last.sum(), list(leaves.values())))
    step()
    signatures, ops = [], []
    signature, fwd_op, bwd_op = FAST.signature, FAST.strided_fwd, FAST.strided_bwd
    monkeypatch.setattr(FAST, "signature", lambda *t: signatures.append(1) or signature(*t))
    monkeypatch.setattr(FAST, "strided_fwd", lambda *a: ops.append("fwd") or fwd_op(*a))
    monkeypatch.setattr(FAST, "strided_bwd", lambda *a: ops.append("bwd") or bwd_op(*a))
    eager = step()
    assert (len(signatures), ops) == (1, [])
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]):
        profiled = step()
    assert ops == ["fwd", "bwd"]
    with torch.autograd.graph.save_on_cpu():
        hooked = step()
    assert ops == ["fwd", "bwd"] * 2
    for got, want in zip(eager, hooked):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    for got, want in zip(eager, profiled):   # the same kernels; the gradients' atomic sums may differ in order
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_fast_keeps_only_chunk_states(monkeypatch):
    """Inference keeps nothing; training keeps one state per backward chunk and no ybar (the backward
    recomputes it)."""
    kept = []
    forward = FAST.run_forward

    def recording_forward(*args):
        result = forward(*args)
        kept.append(result[2])   # the states kept
        return result
    monkeypatch.setattr(FAST, "run_forward", recording_forward)
    inputs = make_inputs(1, 4, 3, 40, seed=2)
    with torch.no_grad():
        out_ng = scan_lib.selective_scan(**inputs, delta_softplus=True)
    out = scan_lib.selective_scan(**{k: v.detach().requires_grad_(True) for k, v in inputs.items()}, delta_softplus=True)
    chunk = FAST.launch_config("bwd", 4, 4, 4, 40)["chunk"]
    assert len(kept) == 2 and kept[0].numel() == 0
    assert kept[1].shape == (1, 4, 3, -(-40 // chunk)) and kept[1].dtype == torch.float32
    torch.testing.assert_close(out.detach(), out_ng, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fast_reads_views_in_place(monkeypatch, dtype):
    """Slices of one projection (stride 1 along L, not contiguous) and B, C transposed from (batch, L, 2N)
    give the reference's results; u, delta and z are read in place (never copied), and only B and C are
    copied, so that their positions are adjacent (positions_adjacent)."""
    batch, dim, N, L = 2, 2, 4, 37
    inputs = make_inputs(batch, dim, N, L, dtype=dtype, seed=4)
    projected = torch.cat([inputs["u"], inputs["delta"], inputs["z"]], dim=1)       # batch x 3 dim x L
    inputs.update(u=projected[:, :dim], delta=projected[:, dim:2 * dim], z=projected[:, 2 * dim:])
    coefficients = torch.cat([inputs["B"], inputs["C"]], dim=1).transpose(1, 2).contiguous().transpose(1, 2)
    inputs.update(B=coefficients[:, :N], C=coefficients[:, N:])                     # stride 1 along N
    assert not inputs["u"].is_contiguous() and not inputs["B"].is_contiguous()
    copied = []
    contiguous = torch.Tensor.contiguous

    def recording_contiguous(self, *args, **kwargs):
        if self.shape[-1] == L and not self.is_contiguous():
            copied.append(tuple(self.shape))
        return contiguous(self, *args, **kwargs)
    monkeypatch.setattr(torch.Tensor, "contiguous", recording_contiguous)
    compare(inputs)
    assert set(copied) == {(batch, 1, N, L)}, copied   # B and C (each scan call copies both), nothing else


def block_layout(inputs):
    """inputs with u, delta, z, B, C as chapter 06's block passes them: (batch, C, L) views of (C, batch L)
    matrices (positions_last), B and C rows of one matrix."""
    batch, dim, length = inputs["u"].shape
    as_block = lambda m: positions_last(features_first(m).clone(), batch, length)  # noqa: E731
    x_dbl = as_block(torch.cat([inputs["B"], inputs["C"]], dim=1))
    n = inputs["B"].shape[1]
    return dict(inputs, u=as_block(inputs["u"]), delta=as_block(inputs["delta"]), z=as_block(inputs["z"]),
                B=x_dbl[:, :n], C=x_dbl[:, n:])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fast_outputs_and_gradients_take_u_layout(dtype):
    """In the block's layout, out, du, d delta and dz come back with u's strides (like_u), with the
    reference's values: the kernels write them at those strides, and nothing copies them."""
    batch, dim, N, L = 2, 4, 3, 21
    inputs = block_layout(make_inputs(batch, dim, N, L, dtype=dtype, seed=6))
    u = inputs["u"]
    assert not u.is_contiguous() and u.stride() == (L, batch * L, 1)
    leaves = {k: v.detach().requires_grad_() if v is not None else None for k, v in inputs.items()}
    out = scan_lib.selective_scan(**leaves, delta_softplus=True)
    assert out.stride() == u.stride()
    dout = positions_last(torch.randn(dim, batch * L, dtype=dtype).to(DEVICE), batch, L)
    grads = torch.autograd.grad(out, [leaves["u"], leaves["delta"], leaves["z"]], dout)
    assert all(g.stride() == u.stride() for g in grads), [g.stride() for g in grads]
    compare(inputs)


@pytest.mark.skipif(not ON_GPU, reason="allocates an 8 GiB output: GPU only")
def test_fast_sizes_past_32_bit_offsets():
    """Chapter 07's kernels use 64-bit offsets: 2^31 outputs and more are right to the last element."""
    batch, dim, L, N = 8, 2**14, 2**14 + 3, 2
    u = torch.ones(1, 1, 1, device=DEVICE).expand(batch, dim, L)                    # nothing allocated
    B = torch.ones(1, 1, 1, device=DEVICE).expand(batch, N, L)
    with torch.no_grad():
        out = scan_lib.selective_scan(u, u * 0.1, -torch.ones(dim, N, device=DEVICE), B, B)
    want = scan_lib.selective_scan(u[:1, :1], u[:1, :1] * 0.1, -torch.ones(1, N, device=DEVICE), B[:1], B[:1])
    assert out.numel() >= 2**31
    assert torch.equal(out[-1, -1], want[0, 0]) and torch.equal(out[0, 0], want[0, 0])
    del out


@pytest.mark.parametrize("shape", [(2, 4, 0), (0, 4, 5), (2, 0, 5)], ids=["L0", "batch0", "dim0"])
@pytest.mark.parametrize("scan", [scan_lib.selective_scan, sys.modules["scan_lib.selective_scan"].selective_scan],
                         ids=["chapter07", "chapter05"])
def test_empty_u_gives_an_empty_result(scan, shape):
    """As torch's ops do: an empty out in u's dtype, the last state the initial state (no position moved
    it), and every gradient of its input's shape, the initial state's through the last state."""
    batch, dim, length = shape
    rand = lambda *s: torch.randn(*s, device=DEVICE, requires_grad=True)  # noqa: E731
    u, delta, B, C, h0 = rand(*shape), rand(*shape), rand(batch, 3, length), rand(batch, 3, length), rand(batch, dim, 3)
    A = (-torch.rand(dim, 3, device=DEVICE)).requires_grad_()
    out, last = scan(u, delta, A, B, C, return_last_state=True, initial_state=h0)
    assert out.shape == shape and out.dtype == u.dtype and torch.equal(last, h0)
    leaves = [u, delta, A, B, C, h0]
    grads = torch.autograd.grad(out.sum() + 2 * last.sum(), leaves)
    assert [g.shape for g in grads] == [t.shape for t in leaves]
    assert torch.equal(grads[5], torch.full_like(h0, 2.0)) and not grads[2].any()
    out_only = scan(u, delta, A, B, C, initial_state=h0)          # without the last state: zero gradients
    assert not any(g.any() for g in torch.autograd.grad(out_only.sum(), leaves))

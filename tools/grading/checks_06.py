"""Hidden checks of chapter 06's exercises (tools/grade.py runs them in a process of its own).

One function `exercise_K(nb)` per exercise 06.K, its docstring's first line the exercise's title: it
returns when the exercise is solved and raises (an AssertionError saying why) when it is not. `nb.name`
is what the student's notebook defined. Inputs are drawn here (odd channel counts and state sizes,
lengths 1, 7, 129, ...) and compared in float64 with scan_lib's references (`causal_conv1d_ref` on
F.conv1d, `selective_scan_ref`) or with PyTorch written out here, never with the notebook's code;
the convolution's gradients (x, weight, bias, initial states) are checked too.

06.1 runs the student's conv kernels through the library's launchers: the chapter's own cells import
scan_lib's `causal_conv1d`, and the notebook defines its launchers only at its end, so the check
swaps the notebook's two kernels into scan_lib.causal_conv1d for its duration (and needs only the
cells up to the kernels: `grade.py --needed-only` stops there).
"""
import contextlib
import importlib

import torch

from scan_lib.causal_conv1d import causal_conv1d_ref   # the float64 references (the library's, not the notebook's)
from scan_lib.selective_scan import selective_scan_ref

SEED = 20_06
library_conv = importlib.import_module("scan_lib.causal_conv1d")   # the module (scan_lib.causal_conv1d is also a function)


def _rel_err(x, ref):
    x, ref = x.double().cpu(), ref.double().cpu()
    scale = ref.abs().max().item()
    err = (x - ref).abs().nan_to_num(float("inf")).max().item() if x.numel() else 0.0
    return err / scale if scale else err


def _close(x, ref, what, tol):
    assert tuple(x.shape) == tuple(ref.shape), f"{what}: shape {tuple(x.shape)}, expected {tuple(ref.shape)}"
    err = _rel_err(x, ref)
    assert err <= tol, f"{what}: relative error {err:.3g} (tolerance {tol:.0e})"


def _randint(gen, low, high):
    return int(torch.randint(low, high, (1,), generator=gen))


# ---- 06.1 ---------------------------------------------------------------------------------------

@contextlib.contextmanager
def _notebook_kernels(nb):
    """scan_lib's causal_conv1d (launchers, autograd) running the notebook's forward and backward kernels."""
    saved = library_conv.causal_conv1d_fwd_kernel, library_conv.causal_conv1d_bwd_kernel
    library_conv.causal_conv1d_fwd_kernel = nb.causal_conv1d_fwd_kernel
    library_conv.causal_conv1d_bwd_kernel = nb.causal_conv1d_bwd_kernel
    try:
        yield library_conv.causal_conv1d
    finally:
        library_conv.causal_conv1d_fwd_kernel, library_conv.causal_conv1d_bwd_kernel = saved


def _conv_run(fn, x, weight, bias, h0, dout, dfinal, silu):
    """out, final states and the gradients of sum(out * dout) + sum(final * dfinal) for the given leaves."""
    leaves = [t.detach().clone().requires_grad_(True) if t is not None else None for t in (x, weight, bias, h0)]
    out, final = fn(leaves[0], leaves[1], leaves[2], initial_states=leaves[3], return_final_states=True,
                    activation="silu" if silu else None)
    loss = (out.double() * dout).sum() + (final.double() * dfinal).sum()
    given = [t for t in leaves if t is not None]
    grads = iter(torch.autograd.grad(loss, given))
    return [out, final] + [next(grads) if t is not None else None for t in leaves]


def exercise_1(nb):
    """the causal convolution's window sum in _window_sum (forward and backward kernels)"""
    gen = torch.Generator().manual_seed(SEED + 1)
    names = ["out", "final states", "dx", "dweight", "dbias", "dinitial_states"]
    cases = [(2, 1, True, False, True), (4, 1, False, True, True), (3, 7, True, True, False), (4, 7, False, False, True),
             (2, 129, True, True, True), (3, 129, True, False, True), (4, _randint(gen, 30, 100), True, True, True)]
    with _notebook_kernels(nb) as conv:
        for width, length, with_bias, with_h0, silu in cases:
            batch, dim = _randint(gen, 1, 3), _randint(gen, 1, 12)
            rand = lambda *shape: torch.randn(*shape, generator=gen, dtype=torch.float64).to(nb.DEVICE)
            x, weight, dout = rand(batch, dim, length), rand(dim, width), rand(batch, dim, length)
            bias = rand(dim) if with_bias else None
            h0 = rand(batch, dim, width - 1) if with_h0 else None
            dfinal = rand(batch, dim, width - 1)
            ours = _conv_run(conv, x, weight, bias, h0, dout, dfinal, silu)
            ref = _conv_run(causal_conv1d_ref, x, weight, bias, h0, dout, dfinal, silu)
            what = (f"width {width}, L = {length}, {dim} channels, {'with' if with_bias else 'no'} bias, "
                    f"{'with' if with_h0 else 'no'} initial states, {'silu' if silu else 'no activation'}")
            for name, a, r in zip(names, ours, ref):
                if r is not None:
                    _close(a, r, f"{name} ({what})", 1e-10)


# ---- 06.2 ---------------------------------------------------------------------------------------

def exercise_2(nb):
    """the recurrent step in selective_state_update_kernel (state update and read-out)"""
    gen = torch.Generator().manual_seed(SEED + 2)
    cases = [(1, 1, 1, torch.float64, True), (2, 7, 5, torch.float64, True), (3, 37, 16, torch.float64, False),
             (1, _randint(gen, 2, 70), _randint(gen, 2, 20), torch.float64, True), (2, 19, 8, torch.float32, True)]
    for batch, dim, n_states, dtype, full in cases:
        length = _randint(gen, 2, 6)
        rand = lambda *shape: torch.randn(*shape, generator=gen, dtype=torch.float64)
        # the inputs of every step, position first: step t reads contiguous (batch, dim) and (batch, N) rows
        u, z, B, C = rand(length, batch, dim), rand(length, batch, dim), rand(length, batch, n_states), rand(length, batch, n_states)
        A = -0.5 - torch.rand(dim, n_states, generator=gen, dtype=torch.float64)
        D, bias = rand(dim), rand(dim) - 1.0
        delta = rand(length, batch, dim) if full else 0.05 + torch.rand(length, batch, dim, generator=gen, dtype=torch.float64)
        h0 = rand(batch, dim, n_states)
        options = dict(D=D, z=z.permute(1, 2, 0), delta_bias=bias, delta_softplus=True) if full else {}
        want, want_state = selective_scan_ref(*(t.permute(1, 2, 0) for t in (u, delta)), A, *(t.permute(1, 2, 0) for t in (B, C)),
                                              return_last_state=True, initial_state=h0, **options)
        move = lambda t: t.to(dtype).to(nb.DEVICE)
        state = move(h0).contiguous()
        ys = []
        with torch.no_grad():
            for t in range(length):
                step = dict(D=move(D), z=move(z[t]), dt_bias=move(bias), dt_softplus=True) if full else {}
                ys.append(nb.selective_state_update(state, move(u[t]), move(delta[t]), move(A), move(B[t]), move(C[t]), **step))
        tol = 1e-10 if dtype == torch.float64 else 1e-4
        what = (f"{str(dtype)[6:]}, batch {batch}, dim {dim}, N {n_states}, "
                f"{'with D, z, dt_bias and softplus' if full else 'plain'}")
        for t, y in enumerate(ys):
            if _rel_err(y, want[..., t]) > tol and t > 0 and _rel_err(ys[0], want[..., 0]) <= tol:
                raise AssertionError(f"y is right at the first step but not at step {t + 1} ({what}): "
                                     "is the new state stored back in place?")
            _close(y, want[..., t], f"y at step {t + 1} of {length} ({what})", tol)
        _close(state, want_state, f"the state after {length} steps ({what})", tol)


# ---- 06.3 ---------------------------------------------------------------------------------------

def _ssm_parameters_ref(x, x_proj_weight, dt_proj_weight, rank, n):
    """delta (before dt_proj.bias), B, C in float64, the projections written out as sums."""
    x_dbl = torch.einsum("bdl,kd->blk", x.double(), x_proj_weight.double())             # batch x L x (R + 2N)
    dt, B, C = x_dbl[..., :rank], x_dbl[..., rank:rank + n], x_dbl[..., rank + n:]
    delta = torch.einsum("dr,blr->bdl", dt_proj_weight.double(), dt)                    # batch x d_inner x L
    return delta, B.transpose(1, 2), C.transpose(1, 2)


def exercise_3(nb):
    """Mamba.ssm_parameters: x -> delta, B, C through x_proj and dt_proj"""
    import scan_lib.mamba
    nb.s4d_real_A, nb.init_dt_proj   # the constructor's helpers, defined after the class (grade.py --needed-only runs their cell)
    gen = torch.Generator().manual_seed(SEED + 3)
    for d_model, d_state, dt_rank, length, batch in [(4, 3, "auto", 1, 1), (12, 5, 3, 7, 2),
                                                      (_randint(gen, 5, 40), _randint(gen, 2, 17), _randint(gen, 1, 6), 29, 3)]:
        torch.manual_seed(_randint(gen, 0, 2**31))
        block = nb.Mamba(d_model, d_state=d_state, dt_rank=dt_rank, backend="torch", device=nb.DEVICE, dtype=torch.float64)
        what = f"d_model {d_model}, d_inner {block.d_inner}, N {d_state}, dt_rank {block.dt_rank}, L = {length}"
        x = torch.randn(batch, block.d_inner, length, generator=gen, dtype=torch.float64).to(nb.DEVICE).requires_grad_(True)
        got = block.ssm_parameters(x)
        assert isinstance(got, (tuple, list)) and len(got) == 3, \
            f"ssm_parameters must return (delta, B, C), it returned {type(got).__name__}"
        leaves = [x, block.x_proj.weight, block.dt_proj.weight]
        want = _ssm_parameters_ref(*[t.detach() for t in leaves], block.dt_rank, d_state)
        shapes = [(batch, block.d_inner, length), (batch, d_state, length), (batch, d_state, length)]
        for name, g, w, shape in zip(("delta", "B", "C"), got, want, shapes):
            assert tuple(g.shape) == shape, f"{name}: shape {tuple(g.shape)}, expected {shape} ({what})"
        with_bias = want[0] + block.dt_proj.bias.double()[:, None]
        if _rel_err(got[0], with_bias) < 1e-9 < _rel_err(got[0], want[0]):
            raise AssertionError(f"delta includes dt_proj.bias ({what}): the scan adds it (delta_bias), so it would count twice")
        if torch.allclose(got[1].double(), got[2].double()) and not torch.allclose(want[1], want[2]):
            raise AssertionError(f"C equals B ({what}): they come from disjoint slices of x_proj's output")
        for name, g, w in zip(("delta", "B", "C"), got, want):
            _close(g, w, f"{name} ({what})", 1e-12)
        weights = [torch.randn(w.shape, generator=gen, dtype=torch.float64).to(nb.DEVICE) for w in want]
        grads = torch.autograd.grad(sum((g * w).sum() for g, w in zip(got, weights)), leaves, allow_unused=True)
        ref_leaves = [t.detach().clone().requires_grad_(True) for t in leaves]
        ref_out = _ssm_parameters_ref(*ref_leaves, block.dt_rank, d_state)
        ref_grads = torch.autograd.grad(sum((g * w).sum() for g, w in zip(ref_out, weights)), ref_leaves)
        for name, g, r in zip(("x", "x_proj.weight", "dt_proj.weight"), grads, ref_grads):
            assert g is not None, f"no gradient reaches {name} ({what}): is the selection computed from the parameters?"
            _close(g, r, f"the gradient of {name} through ssm_parameters ({what})", 1e-12)
        # the whole block, with the student's selection, against scan_lib's block with the same weights
        library = scan_lib.mamba.Mamba(d_model, d_state=d_state, dt_rank=dt_rank, backend="torch", device=nb.DEVICE,
                                       dtype=torch.float64)
        library.load_state_dict(block.state_dict())
        hidden = torch.randn(batch, length, d_model, generator=gen, dtype=torch.float64).to(nb.DEVICE)
        with torch.no_grad():
            _close(block(hidden), library(hidden), f"the block's output with this ssm_parameters ({what})", 1e-10)

"""Hidden checks of chapter 06's exercises (tools/grade.py runs them in a process of its own).

One function `exercise_K(nb)` per exercise 06.K, its docstring's first line the exercise's title: it
returns when the exercise is solved and raises (an AssertionError saying why) when it is not. `nb.name`
is what the student's notebook defined. Inputs are drawn here (odd channel counts and state sizes,
lengths 1, 7, 129, ...) and compared in float64 with scan_lib's references (`causal_conv1d_ref` on
F.conv1d, `selective_scan_ref`) or with PyTorch written out here, never with the notebook's code.

06.1 launches the student's `conv_shifted_kernel` (section 2's kernel of K shifted, masked loads)
itself, at several block sizes, on x placed inside a NaN-filled buffer: a load that is not masked to
0 <= s < L reads a NaN (or a neighbouring channel) and shows. It needs only the cells up to the
Initialisation's (06.3's helpers): `grade.py --needed-only` stops there, before the training.
"""
import torch
import triton

from scan_lib.causal_conv1d import causal_conv1d_ref   # the float64 references (the library's, not the notebook's)
from scan_lib.selective_scan import selective_scan_ref

SEED = 20_06


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

def _inside_nan(gen, shape, before, after, device):
    """A float64 tensor of random values, contiguous, inside a buffer with `before` and `after` NaNs around it:
    a load outside the tensor reads NaN, never memory the test does not own."""
    n = 1
    for size in shape:
        n *= size
    buffer = torch.full((before + n + after,), float("nan"), dtype=torch.float64)
    buffer[before:before + n] = torch.randn(n, generator=gen, dtype=torch.float64)
    return buffer.to(device)[before:before + n].view(*shape)


def exercise_1(nb):
    """the causal convolution's window sum in conv_shifted_kernel (K shifted, masked loads)"""
    gen = torch.Generator().manual_seed(SEED + 1)
    cases = [(2, 1, 16, 64), (4, 1, 16, 64), (4, 3, 4, 8), (3, 7, 16, 64), (4, 7, 4, 8), (2, 129, 16, 64),
             (3, 129, 8, 32), (4, 129, 4, 16), (4, _randint(gen, 30, 100), 8, 16)]
    for width, length, block_d, block_l in cases:
        batch, dim = _randint(gen, 1, 4), _randint(gen, 1, 12)
        # the chapter's launch, with these blocks: x, weight and bias inside NaNs (room for a whole block
        # past the end), out NaN where the kernel stores nothing
        x = _inside_nan(gen, (batch, dim, length), 2 * width, block_d * (length + block_l), nb.DEVICE)
        weight = _inside_nan(gen, (dim, width), width, block_d * width, nb.DEVICE)
        bias = _inside_nan(gen, (dim,), 1, block_d, nb.DEVICE)
        out = torch.full_like(x, float("nan"))
        grid = (batch, triton.cdiv(dim, block_d), triton.cdiv(length, block_l))
        with torch.no_grad():
            nb.conv_shifted_kernel[grid](x, weight, bias, out, dim, length, WIDTH=width, BLOCK_D=block_d,
                                         BLOCK_L=block_l)
        want = causal_conv1d_ref(x, weight, bias, activation="silu")
        what = f"width {width}, L = {length}, {dim} channels, batch {batch}, BLOCK_D {block_d}, BLOCK_L {block_l}"
        if out.isnan().any():
            raise AssertionError(f"out ({what}) has NaNs: does a load of x read outside 0 <= s < length "
                                 "(it must be masked there, reading zero)?")
        _close(out, want, f"out ({what})", 1e-10)


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

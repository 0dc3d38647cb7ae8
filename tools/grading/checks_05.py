"""Hidden checks of chapter 05's exercises (tools/grade.py runs them in a process of its own).

One function `exercise_K(nb)` per exercise 05.K, its docstring's first line the exercise's title: it
returns when the exercise is solved and raises (an AssertionError saying why) when it is not. `nb.name`
is what the student's notebook defined. Inputs are drawn here (shapes and awkward lengths the notebook
does not use, float64) and compared with scan_lib's float64 reference `selective_scan_ref` and its
gradients by autograd, never with the notebook's code.

05.1 is plain PyTorch; 05.2 runs the notebook's one-sequence kernel; 05.3 runs the notebook's forward
kernel, which calls `discretize`: tools/grade.py runs each check with the chapter's solutions of the
other exercises, so a stub in 05.2 does not fail 05.3.
"""
import torch
import triton

from scan_lib.ema import accumulator_dtype
from scan_lib.selective_scan import selective_scan_ref   # the float64 oracle (the library's)

SEED = 20_05
F64 = torch.float64
GRADIENT_ORDER = ("delta", "A", "B", "C", "u", "D", "z", "delta_bias", "initial_state")


def _relative_error(x, ref):
    x, ref = x.detach().double().cpu(), ref.detach().double().cpu()
    scale = ref.abs().max().item() if ref.numel() else 0.0
    err = (x - ref).abs().nan_to_num(float("inf")).max().item() if ref.numel() else 0.0
    return err / scale if scale > 0 else (0.0 if err == 0 else float("inf"))


def _compare(x, ref, what, tol=1e-9):
    assert torch.is_tensor(x), f"{what}: expected a tensor, got {type(x).__name__}"
    assert tuple(x.shape) == tuple(ref.shape), f"{what}: shape {tuple(x.shape)}, expected {tuple(ref.shape)}"
    err = _relative_error(x, ref)
    assert err <= tol, f"{what}: relative error {err:.3g} (max abs err / largest reference value), tolerance {tol:g}"


def exercise_1(nb):
    """the backward pass by hand: the gradients of selective_scan_backward_by_hand"""
    gen = torch.Generator().manual_seed(SEED + 1)
    odd_length = int(torch.randint(20, 60, (1,), generator=gen))
    for batch, dim, N, L in [(1, 1, 1, 1), (2, 3, 4, 1), (1, 2, 3, 7), (2, 1, 5, 13), (2, 3, 2, odd_length)]:
        def draw(*shape, scale=1.0):
            return torch.randn(*shape, generator=gen, dtype=F64) * scale
        inputs = dict(u=draw(batch, dim, L), delta=draw(batch, dim, L, scale=0.5) - 1.0,
                      A=-torch.rand(dim, N, generator=gen, dtype=F64) - 0.2, B=draw(batch, N, L), C=draw(batch, N, L),
                      D=draw(dim), z=draw(batch, dim, L), delta_bias=draw(dim, scale=0.3),
                      initial_state=draw(batch, dim, N))
        leaves = {k: v.clone().requires_grad_(True) for k, v in inputs.items()}
        out, last = selective_scan_ref(**leaves, delta_softplus=True, return_last_state=True)
        dout, dlast = draw(*out.shape), draw(*last.shape)
        grads = torch.autograd.grad((out * dout).sum() + (last * dlast).sum(), list(leaves.values()))
        expected = dict(zip(leaves, grads))
        args = {k: v for k, v in inputs.items() if k != "initial_state"}
        with torch.no_grad():
            got = nb.selective_scan_backward_by_hand(**args, h0=inputs["initial_state"], dout=dout, dlast=dlast)
        shape = f"batch {batch}, dim {dim}, N {N}, L = {L}"
        assert isinstance(got, dict), \
            f"selective_scan_backward_by_hand must return a dict of gradients by input name, it returned {type(got).__name__}"
        missing = [k for k in GRADIENT_ORDER if k not in got]
        assert not missing, f"the returned dict has no gradient for {', '.join(missing)}"
        for name in GRADIENT_ORDER:
            what = "d delta (of the raw step, before bias and softplus)" if name == "delta" else f"d {name}"
            _compare(got[name], expected[name], f"{what}, {shape}")


def exercise_2(nb):
    """the discretisation discretize (run by the one-sequence kernel, forward and backward)"""
    gen = torch.Generator().manual_seed(SEED + 2)
    odd_length = int(torch.randint(30, 130, (1,), generator=gen))
    for N, L in [(1, 1), (3, 1), (2, 7), (5, 33), (3, odd_length)]:
        u = torch.randn(L, generator=gen, dtype=F64)
        delta = torch.rand(L, generator=gen, dtype=F64) * 0.8 + 0.05
        A = -torch.rand(N, generator=gen, dtype=F64) * 2 - 0.1
        B, C = torch.randn(N, L, generator=gen, dtype=F64), torch.randn(N, L, generator=gen, dtype=F64)
        dout = torch.randn(L, generator=gen, dtype=F64)
        device = nb.DEVICE
        ours = nb.single_sequence(*(x.to(device) for x in (u, delta, A, B, C, dout)))
        leaves = [x.clone().requires_grad_(True) for x in (u, delta, A, B, C)]
        y_ref = selective_scan_ref(leaves[0][None, None], leaves[1][None, None], leaves[2][None],
                                   leaves[3][None], leaves[4][None])[0, 0]
        refs = [y_ref, *torch.autograd.grad((y_ref * dout).sum(), leaves)]
        for name, x, ref in zip(["y", "du", "d delta", "dA", "dB", "dC"], ours, refs):
            _compare(x, ref, f"single_sequence (the kernel calls discretize), float64, N = {N}, L = {L}: {name}")


def _forward(kernel, device, u, delta, A, B, C, D, z, delta_bias, h0, chunk, block_d):
    """Launch the forward kernel as the chapter's launcher does, keeping the boundary states (SAVE):
    returns out, the last state and the state entering every chunk (batch, dim, N, n_chunks)."""
    u, delta, A, B, C, D, z, delta_bias, h0 = (None if x is None else x.to(device).contiguous()
                                               for x in (u, delta, A, B, C, D, z, delta_bias, h0))
    batch, dim, length = u.shape
    n_states, n_chunks = A.shape[1], triton.cdiv(length, chunk)
    groups = (B.shape[1] if B.dim() == 4 else 1, C.shape[1] if C.dim() == 4 else 1)
    out = torch.empty_like(u)
    last = u.new_empty(batch, dim, n_states)
    states = u.new_empty(batch, dim, n_states, n_chunks)
    ybar = u.new_empty(u.shape if z is not None else (0,))
    kernel[(batch, triton.cdiv(dim, block_d))](
        u, delta, A, B, C, D, z, delta_bias, h0, out, ybar, states, last,
        dim, length, n_states, n_chunks, *groups,
        HAS_D=D is not None, HAS_Z=z is not None, HAS_BIAS=delta_bias is not None, HAS_H0=h0 is not None,
        B_PER_STEP=B.dim() == 4, C_PER_STEP=C.dim() == 4, SOFTPLUS=True, ACC=accumulator_dtype(u.dtype), SAVE=True,
        BLOCK_D=block_d, BLOCK_N=triton.next_power_of_2(n_states), CHUNK=chunk, num_warps=1)
    return out.cpu(), last.cpu(), states.cpu()


def exercise_3(nb):
    """the carry between chunks in selective_scan_fwd_kernel (fold it in, scan, read out, pass it on)"""
    gen = torch.Generator().manual_seed(SEED + 3)
    odd_length = int(torch.randint(40, 140, (1,), generator=gen))
    cases = [  # batch, dim, N, L, groups (None: B, C of shape (batch, N, L); 0: C time-invariant), chunk, block_d, h0
        (2, 4, 2, 7, 2, 4, 2, False),   # first the carry alone (two chunks, no initial state): its reason names it
        (1, 2, 3, 1, None, 16, 2, True), (1, 2, 3, 37, None, 8, 1, True),
        (2, 3, 5, 20, 0, 4, 2, True), (1, 3, 3, odd_length, None, 16, 2, True)]
    for batch, dim, N, L, groups, chunk, block_d, with_h0 in cases:
        def draw(*shape, scale=1.0):
            return torch.randn(*shape, generator=gen, dtype=F64) * scale
        bc = (batch, 1 if groups is None else max(groups, 1), N, L)
        inputs = dict(u=draw(batch, dim, L), delta=draw(batch, dim, L, scale=0.5) - 1.0,
                      A=-torch.rand(dim, N, generator=gen, dtype=F64) - 0.2, B=draw(*bc),
                      C=draw(dim, N) if groups == 0 else draw(*bc), D=draw(dim), z=draw(batch, dim, L),
                      delta_bias=draw(dim, scale=0.3), initial_state=draw(batch, dim, N) if with_h0 else None)
        out, last, states = _forward(nb.selective_scan_fwd_kernel, nb.DEVICE, *inputs.values(), chunk=chunk,
                                     block_d=block_d)
        ref_out, ref_last = selective_scan_ref(**inputs, delta_softplus=True, return_last_state=True)
        what = (f"selective_scan_fwd_kernel, float64, batch {batch}, dim {dim}, N {N}, L = {L}, chunks of {chunk}, "
                f"{'C time-invariant' if groups == 0 else 'B, C per position'}, "
                f"{'with' if with_h0 else 'no'} initial state")
        wrong = ~((out - ref_out).abs() <= 1e-9 * ref_out.abs().max())
        if wrong.any():
            t = int(wrong.any(0).any(0).nonzero()[0])
            k = t // chunk
            where = (f"first wrong at t = {t}, in chunk {k}: the state entering it (the carry) or its last "
                     "state is wrong" if k > 0 else
                     f"first wrong at t = {t}, in the first chunk: the scan within the chunk or ybar += C_n h" +
                     (", or the initial state (the carry entering chunk 0) folded into its first step" if with_h0 else ""))
            raise AssertionError(f"{what}: out has relative error {_relative_error(out, ref_out):.3g}; {where}")
        _compare(last, ref_last, f"{what}: the last state (the carry after the last chunk)")
        for k in range(states.shape[-1]):
            if k == 0:
                entering = inputs["initial_state"] if with_h0 else torch.zeros(batch, dim, N, dtype=F64)
            else:
                per_position = {"u", "delta", "z"} | {name for name in "BC" if inputs[name].dim() == 4}
                prefix = {name: x[..., :k * chunk] if name in per_position else x for name, x in inputs.items()}
                _, entering = selective_scan_ref(**prefix, delta_softplus=True, return_last_state=True)
            _compare(states[..., k], entering, f"{what}: the state entering chunk {k} (the carry)")

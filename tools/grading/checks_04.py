"""Hidden checks of chapter 04's exercises (tools/grade.py runs them in a process of its own).

One function `exercise_K(nb)` per exercise 04.K, its docstring's first line the exercise's title: it
returns when the exercise is solved and raises (an AssertionError saying why) when it is not. `nb.name`
is what the student's notebook defined. The inputs are drawn here (random batch, numbers of states that
are not powers of two, awkward lengths, chunks short enough that the carry crosses several boundaries)
and compared with scan_lib's float64 loop `multistate_scan_ref`, its gradients by autograd (the
library's reference, not the student's notebook code). The checks call the notebook's launchers
(`multistate_single_block`, `multistate_forward`, `multistate_backward`): the chapter itself imports
scan_lib's `multistate_scan` over its own, so the public function would not grade the student's kernels.
"""
import torch

from scan_lib.multistate import multistate_scan_ref   # the float64 reference (the library's)

SEED = 20_04


def _inputs(gen, batch, n_states, length, device, dtype=torch.float64):
    """a in (0.9, 1) (long memories, as in the chapter), B, C, x standard normal, an initial state."""
    a = 0.9 + 0.1 * torch.rand(batch, n_states, length, generator=gen, dtype=torch.float64)
    b, c = torch.randn(2, batch, n_states, length, generator=gen, dtype=torch.float64)
    x = torch.randn(batch, length, generator=gen, dtype=torch.float64)
    h0 = torch.randn(batch, n_states, generator=gen, dtype=torch.float64)
    return [t.to(device=device, dtype=dtype) for t in (a, b, c, x, h0)]


def _states(a, b, x, h0):
    """All states h (batch, N, L) in float64 by the loop (h0 None: zeros)."""
    a, b, x = (t.detach().cpu().double() for t in (a, b, x))
    h = torch.zeros_like(a[:, :, 0]) if h0 is None else h0.detach().cpu().double()
    out = []
    for t in range(a.shape[-1]):
        h = a[:, :, t] * h + b[:, :, t] * x[:, None, t]
        out.append(h)
    return torch.stack(out, -1)


def _compare(got, want, what, name, tol, block_l=None, backward=False):
    """Assert got (on any device, any float dtype) matches the float64 want, relative to max |want|;
    say where it first goes wrong (in the scan's order) and hint at the carry when past the first chunk."""
    assert isinstance(got, torch.Tensor), f"{what}: {name} is {type(got).__name__}, not a tensor"
    assert tuple(got.shape) == tuple(want.shape), f"{what}: {name} has shape {tuple(got.shape)}, expected {tuple(want.shape)}"
    got = got.detach().cpu().double()
    scale = want.abs().max().clamp_min(1e-30)
    wrong = ~((got - want).abs() <= tol * scale)  # NaN counts as wrong
    if not wrong.any():
        return
    err = ((got - want).abs().nan_to_num(float("inf")).max() / scale).item()
    message = f"{what}: {name} wrong, max rel err {err:.3g}"
    if want.dim() >= 2 and name in ("y", "d_a", "d_B", "d_C", "d_x"):
        length = want.shape[-1]
        columns = wrong.reshape(-1, length).any(0).nonzero().flatten().tolist()
        t = columns[-1] if backward else columns[0]
        message += f"; first wrong at t = {t} of L = {length} ({'right to left' if backward else 'left to right'})"
        if block_l is not None:
            entered = (length - 1) // block_l - t // block_l if backward else t // block_l
            if entered > 0:
                message += (f", in the chunk number {entered} visited (chunks of {block_l}): is the "
                            f"{'adjoint' if backward else 'state'} carried between chunks?")
    raise AssertionError(message)


def exercise_1(nb):
    """the N scans at once in multistate_single_block_kernel"""
    gen = torch.Generator().manual_seed(SEED + 1)
    odd = int(torch.randint(40, 250, (1,), generator=gen))
    for batch, n_states, length, dtype in [(1, 1, 1, torch.float32), (2, 3, 7, torch.float32),
                                           (3, 5, odd, torch.float32), (1, 16, 129, torch.float32),
                                           (2, 7, 33, torch.float64)]:
        a, b, c, x, _ = _inputs(gen, batch, n_states, length, nb.DEVICE, dtype)
        want, _ = multistate_scan_ref(*(t.cpu().double() for t in (a, b, c, x)))
        got = nb.multistate_single_block(a, b, c, x)
        what = f"multistate_single_block, batch {batch}, N = {n_states}, L = {length}, {str(dtype)[6:]}"
        _compare(got, want, what, "y", 1e-5)


def exercise_2(nb):
    """the carry of the N states between chunks in multistate_fwd_kernel"""
    gen = torch.Generator().manual_seed(SEED + 2)
    odd = int(torch.randint(70, 200, (1,), generator=gen))
    # first the carry alone (no initial state, several chunks), then lengths 1, 16, 17, ... with and without
    for batch, n_states, length, block_l, with_h0 in [(2, 3, 40, 16, False), (1, 1, 1, 16, True),
                                                      (2, 3, 16, 16, False), (2, 5, 17, 16, True),
                                                      (1, 3, odd, 16, True), (3, 6, odd, 32, False),
                                                      (1, 9, 100, 64, True)]:
        a, b, c, x, h0 = _inputs(gen, batch, n_states, length, nb.DEVICE)
        h0 = h0 if with_h0 else None
        y_ref, last_ref = multistate_scan_ref(*(t.cpu() for t in (a, b, c, x)), None if h0 is None else h0.cpu())
        states = _states(a, b, x, h0)
        first = torch.zeros(batch, n_states, 1, dtype=torch.float64) if h0 is None else h0.cpu()[..., None]
        entering = torch.cat([first, states[..., block_l - 1:-1:block_l]], -1).transpose(1, 2)  # batch x chunks x N
        got = nb.multistate_forward(a, b, c, x, h0, block_l, save_chunks=True)
        assert isinstance(got, (tuple, list)) and len(got) == 3, "multistate_forward must return (y, h_last, h_chunks)"
        what = (f"multistate_forward, batch {batch}, N = {n_states}, L = {length}, block_l = {block_l}, "
                f"{'with' if with_h0 else 'no'} initial state")
        _compare(got[0], y_ref, what, "y", 1e-12, block_l)
        _compare(got[1], last_ref, what, "the last state", 1e-12)
        _compare(got[2], entering, what, "the states entering the chunks (h_chunks)", 1e-12)


def exercise_3(nb):
    """the adjoint carried from the right in multistate_bwd_kernel"""
    gen = torch.Generator().manual_seed(SEED + 3)
    odd = int(torch.randint(70, 200, (1,), generator=gen))
    # first the carry alone (several chunks, no gradient into the last state: a forgotten carry shows
    # before the last chunk, and the reason says so), then lengths 1, 16, 17, ... with and without
    for batch, n_states, length, block_l, with_dh_last in [(3, 6, odd, 32, False), (1, 1, 1, 16, True),
                                                           (2, 3, 16, 16, False), (2, 5, 17, 16, True),
                                                           (1, 3, odd, 16, True), (1, 9, 100, 64, True)]:
        a, b, c, x, h0 = _inputs(gen, batch, n_states, length, nb.DEVICE)
        dy = torch.randn(batch, length, generator=gen, dtype=torch.float64).to(nb.DEVICE)
        dh_last = torch.randn(batch, n_states, generator=gen, dtype=torch.float64).to(nb.DEVICE)
        if not with_dh_last:
            dh_last = torch.zeros_like(dh_last)
        leaves = [t.detach().cpu().requires_grad_() for t in (a, b, c, x, h0)]
        want = torch.autograd.grad(multistate_scan_ref(*leaves), leaves, (dy.cpu(), dh_last.cpu()))
        states = _states(a, b, x, h0)
        entering = torch.cat([h0.cpu()[..., None], states[..., block_l - 1:-1:block_l]], -1).transpose(1, 2)
        h_chunks = entering.contiguous().to(nb.DEVICE)  # the forward's saved states, from the reference
        got = nb.multistate_backward(a, b, c, x, h_chunks, dy, dh_last, block_l)
        assert isinstance(got, (tuple, list)) and len(got) == 5, "multistate_backward must return 5 gradients"
        what = (f"multistate_backward, batch {batch}, N = {n_states}, L = {length}, block_l = {block_l}, "
                f"{'a' if with_dh_last else 'no'} gradient into the last state")
        for name, g, w in zip(("d_a", "d_B", "d_C", "d_x", "d_initial_state"), got, want):
            _compare(g, w, what, name, 1e-12, block_l, backward=True)

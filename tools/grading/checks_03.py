"""Hidden checks of chapter 03's exercises (tools/grade.py runs them in a process of its own).

One function `exercise_K(nb)` per exercise 03.K, its docstring's first line the exercise's title: it
returns when the exercise is solved and raises (an AssertionError saying why) when it is not. `nb.name`
is what the student's notebook defined. The inputs are drawn here (random rows, awkward lengths, both
directions, with and without an initial state, chunks small enough that the adjoint crosses chunk
boundaries) and every output and gradient is compared with float64 autograd through scan_lib's loop
`linear_scan_loop` (the library's reference, not the student's notebook code).
"""
import torch

from scan_lib.ema import linear_scan_loop   # the float64 reference (the library's, not the student's notebook)

SEED = 20_03
NAMES = ("h", "d_gates", "d_tokens", "d_initial_state")


def _inputs(gen, length, device, dtype=torch.float64, rows=None):
    """gates in [0.5, 1) (a long memory, so that a wrong carry shows), tokens, dy, initial state: (rows, L)."""
    rows = rows or int(torch.randint(1, 4, (1,), generator=gen))
    gates = 0.5 + 0.5 * torch.rand(rows, length, generator=gen, dtype=torch.float64)
    tokens, dy = torch.randn(2, rows, length, generator=gen, dtype=torch.float64)
    h0 = torch.randn(rows, generator=gen, dtype=torch.float64)
    return [x.to(device=device, dtype=dtype) for x in (gates, tokens, dy, h0)]


def _reference(gates, tokens, h0, dy, reverse):
    """(h, d_gates, d_tokens, d_h0) in float64 by autograd through scan_lib's loop, loss sum(h * dy);
    h0 None: no initial state (its gradient None)."""
    leaves = [x.detach().cpu().double().requires_grad_() for x in (gates, tokens)]
    if h0 is not None:
        leaves.append(h0.detach().cpu().double().requires_grad_())
    h = linear_scan_loop(leaves[0], leaves[1], leaves[2] if h0 is not None else None, reverse=reverse)
    grads = torch.autograd.grad(h, leaves, dy.detach().cpu().double())
    return (h.detach(), *grads, *([None] if h0 is None else []))


def _compare(got, expected, what, reverse=False, chunk=None):
    """Assert each of got matches expected (float64); say which one goes wrong and where first, in the
    adjoint's order (right to left for a forward scan)."""
    for name, g, e in zip(NAMES, got, expected):
        if e is None:
            continue
        assert isinstance(g, torch.Tensor), f"{what}: {name} is {type(g).__name__}, not a tensor"
        assert tuple(g.shape) == tuple(e.shape), f"{what}: {name} has shape {tuple(g.shape)}, expected {tuple(e.shape)}"
        exact = g.dtype == torch.float64  # float32: rounding grows with the length
        g = g.detach().double().cpu()
        tol = 1e-9 * (1 + e.abs()) if exact else 1e-4 * (1 + e.abs().max())
        wrong = ~((g - e).abs() <= tol)  # NaN counts as wrong
        if not wrong.any():
            continue
        err = (g - e).abs().nan_to_num(float("inf")).max().item()
        if e.dim() == 1:
            raise AssertionError(f"{what}: {name} wrong, max abs err {err:.3g}")
        length = e.shape[-1]
        columns = wrong.any(0).nonzero().flatten().tolist()
        t = columns[0] if reverse else columns[-1]  # the adjoint runs against the forward scan
        where = f"the first wrong position in the adjoint's order is t = {t} of L = {length}"
        if chunk is not None:
            entered = t // chunk if reverse else (length - 1) // chunk - t // chunk  # chunks aligned to multiples
            if entered > 0:
                where += (f", in the chunk number {entered} the backward visits (chunks of {chunk}): "
                          "is the adjoint carried between chunks?")
        raise AssertionError(f"{what}: {name} wrong, max abs err {err:.3g}; {where}")


def _case(length, reverse, chunk=None, init=True, dtype=torch.float64):
    return (f"L = {length}, {'reverse' if reverse else 'forward'} scan"
            + (f", chunk = {chunk}" if chunk else "") + ("" if init else ", no initial state")
            + ("" if dtype == torch.float64 else f", {str(dtype)[6:]}"))


def exercise_1(nb):
    """the adjoint in grads_by_formula: a reverse scan of the shifted gates"""
    gen = torch.Generator().manual_seed(SEED + 1)
    odd = int(torch.randint(40, 300, (1,), generator=gen))
    for length in (1, 2, 7, odd):
        for reverse in (False, True):
            gates, tokens, dy, h0 = _inputs(gen, length, nb.DEVICE)
            got = nb.grads_by_formula(gates, tokens, h0, dy, reverse)
            _compare(got, _reference(gates, tokens, h0, dy, reverse),
                     f"grads_by_formula, {_case(length, reverse)}", reverse)


def exercise_2(nb):
    """h_{t-1} in scan_one_block_kernel (the gradient of the gates in one block)"""
    gen = torch.Generator().manual_seed(SEED + 2)
    odd = int(torch.randint(40, 300, (1,), generator=gen))
    for length, dtype in [(1, torch.float64), (2, torch.float64), (7, torch.float64), (odd, torch.float64),
                          (129, torch.float32)]:
        gates, tokens, dy, h0 = _inputs(gen, length, nb.DEVICE, dtype)
        got = nb.scan_one_block(gates, tokens, h0, dy)
        _compare(got, _reference(gates, tokens, h0, dy, False), f"scan_one_block, {_case(length, False, dtype=dtype)}")


def exercise_3(nb):
    """the adjoint carried across chunks in linear_scan_bwd_kernel"""
    gen = torch.Generator().manual_seed(SEED + 3)
    odd = int(torch.randint(70, 260, (1,), generator=gen))
    cases = [(1, 16, False, True, False), (16, 16, True, True, False), (17, 16, False, False, False),
             (17, 16, True, True, True), (odd, 16, False, True, False), (odd, 32, True, False, False),
             (odd, 16, True, True, True), (100, 64, False, True, True)]
    for length, chunk, reverse, init, reversed_loads in cases:
        gates, tokens, dy, h0 = _inputs(gen, length, nb.DEVICE)
        h0 = h0 if init else None
        expected = _reference(gates, tokens, h0, dy, reverse)
        h = expected[0].to(nb.DEVICE)  # the forward's output, from the reference: only the backward is graded
        config = {**nb.BWD_CONFIG, "reversed_loads": reversed_loads}
        got = nb.linear_scan_rows_backward(gates, h, dy, h0, reverse=reverse, chunk=chunk, config=config)
        what = (f"linear_scan_rows_backward, {_case(length, reverse, chunk, init)}, "
                f"{'descending' if reversed_loads else 'ascending'} loads")
        _compare((h, *got), expected, what, reverse, chunk)
    # and through autograd: linear_scan's backward is this kernel
    gates, tokens, dy, h0 = _inputs(gen, 45, nb.DEVICE)
    leaves = [x.clone().requires_grad_() for x in (gates, tokens, h0)]
    h = nb.linear_scan(*leaves, chunk=16)
    got = (h.detach(), *torch.autograd.grad(h, leaves, dy))
    _compare(got, _reference(gates, tokens, h0, dy, False), "torch.autograd.grad through linear_scan, L = 45, chunk = 16",
             False, 16)


def exercise_4(nb):
    """the gradients in _backward_by_scan (the backward that autograd can differentiate)"""
    gen = torch.Generator().manual_seed(SEED + 4)
    odd = int(torch.randint(40, 200, (1,), generator=gen))
    for length, reverse, init in [(1, False, True), (1, True, False), (7, False, False), (7, True, True),
                                  (odd, False, True), (odd, True, True), (odd, True, False)]:
        gates, tokens, dy, h0 = _inputs(gen, length, nb.DEVICE)
        h0 = h0 if init else None
        expected = _reference(gates, tokens, h0, dy, reverse)
        h = expected[0].to(nb.DEVICE)
        got = nb._backward_by_scan(gates, h, dy, h0, reverse, 16)
        assert isinstance(got, (tuple, list)) and len(got) == 3, \
            "_backward_by_scan must return the triple (d_gates, d_tokens, d_initial_state)"
        if not init:
            got = (*got[:2], None)
        _compare((h, *got), expected, f"_backward_by_scan, {_case(length, reverse, 16, init)}", reverse)
    # and through autograd with create_graph=True, the path that calls it
    gates, tokens, dy, h0 = _inputs(gen, 33, nb.DEVICE)
    leaves = [x.clone().requires_grad_() for x in (gates, tokens, h0)]
    h = nb.linear_scan(*leaves, reverse=True, chunk=16)
    got = (h.detach(), *torch.autograd.grad(h, leaves, dy, create_graph=True))
    _compare(got, _reference(gates, tokens, h0, dy, True),
             "torch.autograd.grad(..., create_graph=True) through linear_scan, L = 33, reverse scan", True)

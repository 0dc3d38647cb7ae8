"""Hidden checks of chapter 02's exercises (tools/grade.py runs them in a process of its own).

One function `exercise_K(nb)` per exercise 02.K, its docstring's first line the exercise's title: it
returns when the exercise is solved and raises (an AssertionError saying why) when it is not. `nb.name`
is what the student's notebook defined. The inputs are drawn here, with shapes and lengths the notebook
does not use, and compared with scan_lib's float64 loop `linear_scan_loop`, not the notebook's code. Chapter 02 has no
backward pass, so no gradients are checked (chapter 03's checks will).
"""
import torch

from scan_lib.ema import linear_scan_loop   # the float64 reference (the library's, not the student's notebook)

SEED = 20_02


def tree_scan(op, gates, tokens):
    """Inclusive scan in log2(L) rounds of combines of accumulated pairs (Hillis-Steele: the grouping of a
    GPU's scan), for a combine on tensors. tests/test_ema.py uses it too."""
    a, b, shift = gates, tokens, 1
    while shift < tokens.shape[-1]:
        a_earlier = torch.cat([torch.ones_like(a[..., :shift]), a[..., :-shift]], -1)
        b_earlier = torch.cat([torch.zeros_like(b[..., :shift]), b[..., :-shift]], -1)
        a, b = op(a_earlier, b_earlier, a, b)
        shift *= 2
    return b


def _compare(h, expected, what, chunk=None, reverse=False):
    """Assert h matches the float64 reference; say where it first goes wrong."""
    assert h.shape == expected.shape, f"{what}: shape {tuple(h.shape)}, expected {tuple(expected.shape)}"
    float64 = h.dtype == torch.float64
    h, expected = h.double().cpu(), expected.double().cpu()
    if float64:
        tol = 1e-9 * (1 + expected.abs())
    else:  # float32: rounding grows with the length and the size of the states
        tol = 1e-4 * (1 + expected.abs().max())
    wrong = ~((h - expected).abs() <= tol)  # NaN counts as wrong
    if not wrong.any():
        return
    columns = wrong.any(0).nonzero().flatten().tolist()
    t = columns[-1] if reverse else columns[0]
    where = f"first wrong (in scan order) at t = {t} of L = {expected.shape[-1]}"
    if chunk is not None:
        length = expected.shape[-1]
        entered = (length - 1 - t) // chunk if reverse else t // chunk
        if entered > 0:
            where += f", in the chunk number {entered} visited (chunks of {chunk}): is the state carried between chunks?"
    err = (h - expected).abs().nan_to_num(float("inf")).max().item()
    raise AssertionError(f"{what}: max abs err {err:.3g}; {where}")


def _rows(gen, length, dtype, device, with_init):
    rows = int(torch.randint(1, 4, (1,), generator=gen))
    gates = (0.5 + 0.5 * torch.rand(rows, length, generator=gen, dtype=torch.float64)).to(dtype)  # long memory
    tokens = torch.randn(rows, length, generator=gen, dtype=torch.float64).to(dtype)
    init = torch.randn(rows, generator=gen, dtype=torch.float64).to(dtype) if with_init else None
    move = (lambda x: None if x is None else x.to(device))
    return move(gates), move(tokens), move(init)


def exercise_1(nb):
    """the combine operator first_order_op"""
    op = getattr(nb.first_order_op, "fn", nb.first_order_op)
    gen = torch.Generator().manual_seed(SEED)
    n = int(torch.randint(500, 3000, (1,), generator=gen))
    a_p, b_p, a_q, b_q = torch.randn(4, n, dtype=torch.float64, generator=gen)
    out = op(a_p, b_p, a_q, b_q)
    assert isinstance(out, (tuple, list)) and len(out) == 2, \
        f"first_order_op must return the pair (gate, token), it returned {type(out).__name__}"
    gate, token = out
    assert torch.allclose(gate, a_p * a_q, rtol=1e-12, atol=1e-12), "the composed gate is not a_left * a_right"
    assert torch.allclose(token, a_q * b_p + b_q, rtol=1e-12, atol=1e-12), \
        "the composed token is not a_right * b_left + b_right (the left step comes first)"
    for length in (1, 2, 37, 300):  # a tree of combines, where an operator right only for a fold fails
        gates = torch.rand(3, length, dtype=torch.float64, generator=gen)
        tokens = torch.randn(3, length, dtype=torch.float64, generator=gen)
        _compare(tree_scan(op, gates, tokens), linear_scan_loop(gates, tokens), f"a tree scan with first_order_op, L = {length}")
    for length in (1, 5, 130):  # the operator as the chapter's one-block kernel runs it
        gates, tokens, _ = _rows(gen, length, torch.float64, nb.DEVICE, False)
        _compare(nb.scan_one_block(gates, tokens), linear_scan_loop(gates, tokens), f"scan_one_block, float64, L = {length}")


def exercise_2(nb):
    """the carried state in scan_chunk (forward scans over many chunks)"""
    gen = torch.Generator().manual_seed(SEED + 2)
    odd_length = int(torch.randint(200, 600, (1,), generator=gen))
    # first the carry alone (several chunks, no initial state: a forgotten carry shows past the first
    # chunk, and the reason says so), then lengths 1 and 17, with and without an initial state
    for length, chunk, dtype, with_init in [(100, 16, torch.float64, False), (1, 16, torch.float64, False),
                                            (1, 16, torch.float64, True), (17, 16, torch.float64, True),
                                            (odd_length, 32, torch.float64, True), (257, 64, torch.float32, True)]:
        gates, tokens, init = _rows(gen, length, dtype, nb.DEVICE, with_init)
        h = nb.linear_scan_rows(gates, tokens, init, reverse=False, chunk=chunk)
        what = (f"linear_scan_rows forward, {str(dtype)[6:]}, L = {length}, chunk = {chunk}, "
                f"{'with' if with_init else 'no'} initial state")
        _compare(h, linear_scan_loop(gates, tokens, init), what, chunk)


def exercise_3(nb):
    """the reverse direction's chunk positions in chunk_positions"""
    gen = torch.Generator().manual_seed(SEED + 3)
    odd_length = int(torch.randint(130, 500, (1,), generator=gen))
    config = {**nb.FWD_CONFIG, "reversed_loads": False}  # the default: ascending loads, the scan reversed
    for length, chunk, dtype, with_init in [(1, 16, torch.float64, True), (16, 16, torch.float64, False),
                                            (17, 16, torch.float64, True), (100, 32, torch.float64, False),
                                            (odd_length, 16, torch.float64, True), (257, 64, torch.float32, True)]:
        gates, tokens, init = _rows(gen, length, dtype, nb.DEVICE, with_init)
        h = nb.linear_scan_rows(gates, tokens, init, reverse=True, chunk=chunk, config=config)
        what = (f"linear_scan_rows reverse, {str(dtype)[6:]}, L = {length}, chunk = {chunk}, "
                f"{'with' if with_init else 'no'} initial state")
        _compare(h, linear_scan_loop(gates, tokens, init, reverse=True), what, chunk, reverse=True)

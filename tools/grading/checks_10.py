"""Hidden checks of chapter 10's exercises (tools/grade.py runs them in a process of its own).

One function `exercise_K(nb)` per exercise 10.K, its docstring's first line the exercise's title: it
returns when the exercise is solved and raises (an AssertionError saying why) when it is not. `nb.name`
is what the student's notebook defined. The inputs are drawn here (lengths that are not multiples of
the chunk, heads sharing groups, state sizes that are not powers of two) and compared with scan_lib's
float64 loop `ssd_loop` and a float64 loop over the chunks written here, not with the notebook's code.
"""
import torch

from scan_lib.ssd import ssd_loop   # the float64 reference (the library's)

SEED = 20_10


def _problem(gen, batch, length, heads, groups, head_dim, n_states, device):
    """Mamba-2 inputs in float64: steps in (0, 1.3), A < 0, an initial state."""
    rand = lambda *shape: torch.randn(*shape, generator=gen, dtype=torch.float64)   # noqa: E731
    x, B, C = rand(batch, length, heads, head_dim), rand(batch, length, groups, n_states), rand(batch, length, groups, n_states)
    dt = torch.nn.functional.softplus(rand(batch, length, heads) - 1)
    A, h0 = -torch.exp(rand(heads) * 0.5), rand(batch, heads, head_dim, n_states)
    return [t.to(device) for t in (x, dt, A, B, C, h0)]


def _compare(got, want, what, name, tol):
    """Assert got (any device and float dtype) matches the float64 want, relative to max |want|."""
    assert isinstance(got, torch.Tensor), f"{what}: {name} is {type(got).__name__}, not a tensor"
    assert tuple(got.shape) == tuple(want.shape), f"{what}: {name} has shape {tuple(got.shape)}, expected {tuple(want.shape)}"
    got, want = got.detach().cpu().double(), want.detach().cpu().double()
    scale = want.abs().max().clamp_min(1e-30)
    err = ((got - want).abs().nan_to_num(float("inf")).max() / scale).item()
    assert err <= tol, f"{what}: {name} wrong, max rel err {err:.3g}"


def exercise_1(nb):
    """the scan over chunks in _chunk_steps (step 3 of the chunked form)"""
    gen = torch.Generator().manual_seed(SEED + 1)
    odd = int(torch.randint(40, 90, (1,), generator=gen))
    # first without an initial state (the carry alone), then lengths of one chunk, less than one, odd ones
    for batch, length, chunk, heads, groups, head_dim, n_states, with_h0 in [
            (2, 40, 8, 4, 2, 3, 5, False), (1, 8, 8, 2, 1, 2, 3, True), (1, 1, 4, 2, 2, 3, 2, True),
            (2, odd, 16, 4, 1, 5, 3, True), (1, odd, 4, 6, 3, 2, 7, False)]:
        x, dt, A, B, C, h0 = _problem(gen, batch, length, heads, groups, head_dim, n_states, nb.DEVICE)
        h0 = h0 if with_h0 else None
        y_want, final_want = ssd_loop(x, dt, A, B, C, None, h0)
        got = nb.ssd_chunked(x, dt, A, B, C, chunk, None, h0)
        assert isinstance(got, (tuple, list)) and len(got) == 2, "ssd_chunked must return (y, final state)"
        what = (f"ssd_chunked, batch {batch}, L = {length}, chunks of {chunk}, {heads} heads in {groups} groups, "
                f"P = {head_dim}, N = {n_states}, {'with' if with_h0 else 'no'} initial state")
        _compare(got[1], final_want, what, "the final state (is each chunk's state decayed by the chunk's "
                 "total decay, then the chunk's own state added?)", 1e-10)
        _compare(got[0], y_want, what, "y (is the state entering chunk c the state before chunk c's own "
                 "inputs are added?)", 1e-10)


def _chunk_loop(local, decay, start, reverse):
    """pass_states in float64, one chunk at a time: (the carry entering each chunk, the carry at the end)."""
    local, decay = local.cpu().double(), decay.cpu().double()
    carry = torch.zeros_like(local[:, :, 0]) if start is None else start.cpu().double()
    passed = torch.empty_like(local)
    order = range(local.shape[2] - 1, -1, -1) if reverse else range(local.shape[2])
    for c in order:
        passed[:, :, c] = carry
        carry = decay[:, :, c, None, None] * carry + local[:, :, c]
    return passed, carry


def exercise_2(nb):
    """the carry over chunks in ssd_state_passing_kernel"""
    gen = torch.Generator().manual_seed(SEED + 2)
    for batch, heads, n_chunks, head_dim, n_states, block, reverse, with_start in [
            (2, 3, 6, 5, 7, 16, False, False), (1, 2, 1, 3, 3, 16, False, True), (2, 1, 5, 4, 9, 32, True, False),
            (1, 3, 9, 6, 5, 16, True, True), (3, 2, 4, 8, 8, 64, False, True)]:
        local = torch.randn(batch, heads, n_chunks, head_dim, n_states, generator=gen).to(nb.DEVICE)
        decay = torch.rand(batch, heads, n_chunks, generator=gen).to(nb.DEVICE)
        start = torch.randn(batch, heads, head_dim, n_states, generator=gen).to(nb.DEVICE) if with_start else None
        want_passed, want_end = _chunk_loop(local, decay, start, reverse)
        got = nb.pass_states(local, decay, start, reverse=reverse, block=block)
        assert isinstance(got, (tuple, list)) and len(got) == 2, "pass_states must return (passed, end)"
        what = (f"pass_states, batch {batch}, {heads} heads, {n_chunks} chunks of a {head_dim} x {n_states} state "
                f"in blocks of {block}, {'reverse' if reverse else 'forward'}, {'with' if with_start else 'no'} start")
        _compare(got[0], want_passed, what, "the carry entering each chunk (stored before the chunk is folded in?)", 1e-5)
        _compare(got[1], want_end, what, "the carry at the end", 1e-5)

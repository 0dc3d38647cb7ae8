"""Hidden checks of chapter 01's exercises (tools/grade.py runs them in a process of its own).

One function `exercise_K(nb)` per exercise 01.K, its docstring's first line the exercise's title: it
returns when the exercise is solved and raises (an AssertionError saying why) when it is not. `nb.name`
is what the student's notebook defined. The inputs are drawn here, with lengths and blocks the notebook
does not use, and compared with float64 references computed here (torch.cumsum in float64, and a
down-sweep replayed step by step), not with the notebook's code. The three-phase kernels are launched
directly, each on inputs made here, so that the block totals (01.3) and the carry (01.4) are checked
each on its own. Chapter 01's gradient (a reverse scan) belongs to the exported cumsum, which has no
exercise.
"""
import torch

SEED = 20_01


def _compare(y, expected, scale, what, block=None):
    """Assert y (any float dtype) matches the float64 `expected` within 1e-5 * (1 + scale), elementwise;
    say where it first goes wrong (and in which block, if `block`)."""
    assert y.shape == expected.shape, f"{what}: shape {tuple(y.shape)}, expected {tuple(expected.shape)}"
    y, expected, scale = y.double().cpu(), expected.double().cpu(), scale.double().cpu()
    wrong = ~((y - expected).abs() <= 1e-5 * (1 + scale))  # NaN counts as wrong
    if not wrong.any():
        return
    t = int(wrong.nonzero()[0, 0])
    where = f"first wrong at index {t} of {expected.numel()} (got {y[t].item():.6g}, expected {expected[t].item():.6g})"
    if block is not None:
        where += f", in block {t // block} (blocks of {block})"
        where += ": block 0 has no carry (is S[-1] read?)" if t < block else ": is its carry S[k-1]?"
    raise AssertionError(f"{what}: {where}")


def _lengths(gen, fixed):
    return list(fixed) + [int(torch.randint(130, 700, (1,), generator=gen))]


def exercise_1(nb):
    """the one-block scan kernel: masked load and tl.associative_scan"""
    gen = torch.Generator().manual_seed(SEED + 1)
    for length in _lengths(gen, (1, 7, 16, 129)):
        x = torch.randn(length, generator=gen).to(nb.DEVICE)
        y = nb.cumsum_one_block(x)
        expected = torch.cumsum(x.double(), 0)
        _compare(y, expected, torch.cumsum(x.double().abs(), 0), f"cumsum_one_block, float32, L = {length}")
    # The kernel itself with a block twice the length: masked lanes must not be stored
    length = int(torch.randint(33, 64, (1,), generator=gen))
    x = torch.randn(length, generator=gen).to(nb.DEVICE)
    y = torch.full((256,), 12345.0, device=nb.DEVICE)
    nb.cumsum_one_block_kernel[(1,)](x, y, length, BLOCK=128)
    _compare(y[:length], torch.cumsum(x.double(), 0), torch.cumsum(x.double().abs(), 0),
             f"cumsum_one_block_kernel, L = {length}, BLOCK = 128")
    assert (y[length:] == 12345.0).all(), \
        f"cumsum_one_block_kernel, L = {length}, BLOCK = 128, wrote past the end (index >= {length}): is the mask right?"
    # float16 in, float16 out: the sums must be accumulated in float32 (float16 would lose most digits)
    length = 1000
    x = (1 + torch.rand(length, generator=gen)).half().to(nb.DEVICE)
    y = nb.cumsum_one_block(x)
    expected = torch.cumsum(x.double(), 0)
    err = ((y.double().cpu() - expected.cpu()).abs() / expected.cpu()).max().item()
    assert err <= 2 ** -10, (f"cumsum_one_block, float16, L = {length}: relative error {err:.2g}, "
                             f"above float16's rounding ({2 ** -11:.2g}): is the scan accumulated in float32?")


def _replay_down_sweep(a):
    """The states after each down-sweep step, from the state after "clear last" (float64, here)."""
    a, states, d = a.clone(), [], a.numel()
    while d > 1:
        d //= 2
        t = torch.arange(2 * d - 1, a.numel(), 2 * d)
        a[t - d], a[t] = a[t].clone(), a[t] + a[t - d]
        states.append((d, t, a.clone()))
    return states


def exercise_2(nb):
    """the down-sweep of Blelloch's scan (blelloch_scan)"""
    gen = torch.Generator().manual_seed(SEED + 2)
    powers = [1, 2, 3, 5, int(torch.randint(6, 11, (1,), generator=gen))]
    for power in powers:
        length = 2 ** power
        x = torch.randint(-9, 10, (length,), generator=gen).double()
        out = nb.blelloch_scan(x)
        assert isinstance(out, tuple) and len(out) == 3, "blelloch_scan must return (scan, steps, additions)"
        y, steps, additions = out
        what = f"blelloch_scan, L = {length}"
        labels = [label for label, _, _ in steps]
        assert "clear last" in labels, f"{what}: no step labelled 'clear last' (the steps: {labels})"
        cleared = labels.index("clear last")
        down = [step for step in steps[cleared + 1:] if step[0].startswith("down")]
        expected_steps = _replay_down_sweep(steps[cleared][2].double())
        assert len(down) == len(expected_steps) == power, \
            f"{what}: {len(down)} down-sweep steps, expected log2(L) = {power} (d = L/2, ..., 1)"
        for (label, written, values), (d, t, expected) in zip(down, expected_steps):
            assert label == f"down d={d}", f"{what}: a down-sweep step labelled {label!r}, expected 'down d={d}'"
            assert torch.equal(torch.as_tensor(written).cpu(), t), \
                f"{what}, down d={d}: wrote the indices {torch.as_tensor(written).tolist()[:8]}..., expected t = 2d-1, 4d-1, ..."
            assert torch.equal(values.double(), expected), \
                (f"{what}, down d={d}: the values after the step differ from the down-sweep's (each t hands its "
                 f"value to t - d and takes its value + the child's old value)")
        exclusive = torch.cumsum(x, 0) - x
        assert torch.equal(down[-1][2].double(), exclusive), f"{what}: after the down-sweep, not the exclusive scan"
        assert torch.equal(y.double(), torch.cumsum(x, 0)), f"{what}: the inclusive scan is wrong"
        assert additions == 3 * length - 2, f"{what}: {additions} additions, expected 3L - 2 = {3 * length - 2}"
    # L = 1 has no down-sweep: it must still be right
    x = torch.randn(1, generator=gen, dtype=torch.float64)
    assert torch.equal(nb.blelloch_scan(x)[0], x), "blelloch_scan, L = 1: the scan of one value is that value"


def exercise_3(nb):
    """the block totals of the three-phase scan (scan_blocks_kernel, phase 1)"""
    gen = torch.Generator().manual_seed(SEED + 3)
    for length, block in [(1, 16), (7, 16), (16, 16), (129, 32)] + [(n, 16) for n in _lengths(gen, ())]:
        num_blocks = -(-length // block)
        x = torch.randn(length, generator=gen).to(nb.DEVICE)
        y = torch.empty_like(x)
        totals = torch.full((num_blocks,), float("nan"), device=nb.DEVICE)
        nb.scan_blocks_kernel[(num_blocks,)](x, y, totals, length, BLOCK=block)
        padded = torch.nn.functional.pad(x.double().cpu(), (0, num_blocks * block - length)).view(num_blocks, block)
        _compare(totals, padded.sum(1), padded.abs().sum(1),
                 f"scan_blocks_kernel's totals T, L = {length}, BLOCK = {block} ({num_blocks} blocks)")


def exercise_4(nb):
    """the carry of the three-phase scan (add_carry_kernel, phase 3)"""
    gen = torch.Generator().manual_seed(SEED + 4)
    for length, block in [(1, 16), (7, 16), (17, 16), (129, 32), (256, 16)] + [(n, 16) for n in _lengths(gen, ())]:
        num_blocks = -(-length // block)
        x = torch.randn(length, generator=gen, dtype=torch.float64)
        padded = torch.nn.functional.pad(x, (0, num_blocks * block - length)).view(num_blocks, block)
        scanned = torch.cumsum(padded, 1).flatten()[:length]                  # phase 1's y: each block scanned
        prefix = torch.cumsum(padded.sum(1), 0)                               # phase 2's S
        y = torch.full((length + block,), 12345.0)                             # a sentinel past the end
        y[:length] = scanned
        s = torch.cat([torch.tensor([float("nan")], dtype=torch.float64), prefix])   # NaN at S[-1]
        y, s = y.float().to(nb.DEVICE), s.float().to(nb.DEVICE)
        nb.add_carry_kernel[(num_blocks,)](y, s[1:], length, BLOCK=block)
        _compare(y[:length], torch.cumsum(x, 0), torch.cumsum(x.abs(), 0),
                 f"add_carry_kernel, L = {length}, BLOCK = {block} ({num_blocks} blocks)", block)
        assert (y[length:].cpu() == 12345.0).all(), \
            f"add_carry_kernel, L = {length}, BLOCK = {block}: wrote past the end (index >= {length})"

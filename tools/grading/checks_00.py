"""Hidden checks of chapter 00's exercises (tools/grade.py runs them in a process of its own).

One function `exercise_K(nb)` per exercise 00.K, its docstring's first line the exercise's title: it
returns when the exercise is solved and raises (an AssertionError saying why) when it is not. `nb.name`
is what the student's notebook defined. The inputs are drawn here, with sizes, blocks and views the
notebook does not use; the kernels are launched directly where the checks need to see past the end of
an output (a sentinel there must survive the masked store). References: torch's own x + y and views
(exact), and float64 sums for the row sums. Chapter 00 has no backward pass, so no gradients.
"""
import torch

SEED = 20_00
SENTINEL = 12345.0


def _cdiv(a, b):
    return -(-a // b)


def _launch_sizes(gen):
    return [1, 7, 64, 129, 257, int(torch.randint(300, 3000, (1,), generator=gen))]


def exercise_1(nb):
    """the masked offsets, loads and store of vector_add_kernel"""
    gen = torch.Generator().manual_seed(SEED + 1)
    # First the kernel itself, its output longer than n (an unmasked store writes into the sentinel, not
    # past an allocation, which on the interpreter can crash the checks' process)
    n, block = 100, 32
    x, y = torch.randn(2, n, generator=gen).to(nb.DEVICE)
    z = torch.full((4 * block,), SENTINEL, device=nb.DEVICE)
    nb.vector_add_kernel[(_cdiv(n, block),)](x, y, z, n, BLOCK=block)
    assert torch.equal(z[:n].cpu(), (x + y).cpu()), \
        f"vector_add_kernel, n = {n}, BLOCK = {block} ({_cdiv(n, block)} programs): wrong sums; does each program take its own block?"
    assert (z[n:].cpu() == SENTINEL).all(), \
        f"vector_add_kernel, n = {n}, BLOCK = {block}: wrote past the end (index >= {n}): is the store masked?"
    for n in _launch_sizes(gen):
        block = [16, 64, 256][int(torch.randint(0, 3, (1,), generator=gen))]
        x, y = torch.randn(2, n, generator=gen).to(nb.DEVICE)
        z = nb.vector_add(x, y, block)
        if not torch.equal(z.cpu(), (x + y).cpu()):
            wrong = (z.cpu() != (x + y).cpu()).nonzero()[0, 0].item()
            raise AssertionError(f"vector_add, n = {n}, BLOCK = {block}: first wrong at index {wrong} "
                                 f"(program {wrong // block}): does each program take its own block?")


def _views(gen, rows, cols):
    """(name, a 2-D view of shape rows x cols) in several layouts."""
    base = torch.randn(rows, 2 * cols + 1, generator=gen)
    return [("row-major", base[:, :cols].contiguous()),
            ("transposed", torch.randn(cols, rows, generator=gen).t()),
            ("every other column", base[:, ::2][:, :cols]),
            ("columns of a wider matrix", base[:, 1:cols + 1])]


def exercise_2(nb):
    """the mask and the strided load of copy_2d_kernel"""
    gen = torch.Generator().manual_seed(SEED + 2)
    # First the kernel itself, with blocks larger than the matrix and an output with room past it
    rows, cols = 5, 6
    view = torch.randn(cols, rows, generator=gen).t().to(nb.DEVICE)
    y = torch.full((rows * cols + 64,), SENTINEL, device=nb.DEVICE)
    nb.copy_2d_kernel[(1,)](view, y, rows, cols, view.stride(0), view.stride(1), ROWS=8, COLS=8)
    assert torch.equal(y[:rows * cols].view(rows, cols).cpu(), view.cpu()), \
        f"copy_2d_kernel, {rows} x {cols} in an 8 x 8 block: wrong values"
    assert (y[rows * cols:].cpu() == SENTINEL).all(), \
        f"copy_2d_kernel, {rows} x {cols} in an 8 x 8 block: wrote past the end: does the mask cover rows and columns?"
    shapes = [(1, 1), (3, 7), (5, 3), (9, 17), (int(torch.randint(2, 20, (1,), generator=gen)), 33)]
    for rows, cols in shapes:
        for name, view in _views(gen, rows, cols):
            view = view.to(nb.DEVICE)
            assert view.shape == (rows, cols), (name, view.shape)
            y = nb.copy_2d(view)
            assert torch.equal(y.cpu(), view.cpu()), \
                f"copy_2d of a {rows} x {cols} view ({name}, strides {view.stride()}): wrong values; are X's strides used?"


def exercise_3(nb):
    """the loop body of row_sums_kernel: a block of columns at a time"""
    gen = torch.Generator().manual_seed(SEED + 3)
    shapes = [(1, 1), (3, 5), (2, 16), (4, 129), (2, int(torch.randint(300, 1000, (1,), generator=gen)))]
    for rows, cols in shapes:
        for block in (16, 64):
            for name, view in _views(gen, rows, cols)[:3]:
                view = view.to(nb.DEVICE)
                got = nb.row_sums(view, block).double().cpu()
                exact = view.double().sum(1).cpu()
                bound = 4 * max(cols, 2) ** 0.5 * 2 ** -24 * view.double().abs().sum(1).cpu() + 1e-30
                err = (got - exact).abs()
                if not (err <= bound).all():  # NaN counts as wrong
                    row = int((~(err <= bound)).nonzero()[0, 0])
                    raise AssertionError(
                        f"row_sums of a {rows} x {cols} view ({name}), BLOCK = {block}: row {row} sums to "
                        f"{got[row].item():.6g}, expected {exact[row].item():.6g}: are the columns past n_cols "
                        f"masked to 0, and all blocks of columns visited?")

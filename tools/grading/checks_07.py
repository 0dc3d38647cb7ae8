"""Hidden checks of chapter 07's exercises (tools/grade.py runs them in a process of its own).

One function `exercise_K(nb)` per exercise 07.K, its docstring's first line the exercise's title: it
returns when the exercise is solved and raises (an AssertionError saying why) when it is not. `nb.name`
is what the student's notebook defined.

07.1 compares `selective_floors` with the byte and exp counts written out below, at random sizes.
07.2 runs the notebook's public `selective_scan` on strided views (u and delta with different strides,
several batch elements, a position stride that is not 1) against scan_lib's float64
`selective_scan_ref`: output and last state, without gradients (the notebook's backward kernel is
07.3's); then the gradients through scan_lib's selective_scan with the notebook's forward kernel swapped
in (the backward reads the states that kernel saved). 07.3 swaps in the notebook's backward kernel
instead, after scan_lib's forward: the exercises do not depend on each other.
"""
import contextlib
import importlib

import torch

from scan_lib.selective_scan import selective_scan_ref   # the float64 oracle (the library's, not the notebook's)

SEED = 20_07
library_scan = importlib.import_module("scan_lib.fast_selective_scan")   # this chapter's exported module


def _randint(gen, low, high):
    return int(torch.randint(low, high, (1,), generator=gen))


# ---- 07.1 ---------------------------------------------------------------------------------------

def _floors(batch, dim, length, n_states, size, bandwidth, exps_per_s, backward):
    """The counts, written out: forward reads u, delta, z (batch x dim x L each), B and C (batch x N x L)
    and writes out (batch x dim x L), with one exp per (batch, channel, position, state); the backward
    reads u, delta, z, B, C and dout, writes du, d delta, dz, dB and dC, with one exp per element.
    backward=True: a training step, the bytes of both passes and their exps (1 + 1 per element)."""
    big, small = batch * dim * length, batch * n_states * length
    values = {"read": 3 * big + 2 * small, "written": big}
    if backward:
        values = {"read": values["read"] + 4 * big + 2 * small, "written": values["written"] + 3 * big + 2 * small}
    exps = (2 if backward else 1) * batch * dim * length * n_states
    return (values["read"] + values["written"]) * size / bandwidth * 1e6, exps / exps_per_s * 1e6


def exercise_1(nb):
    """the floors: bytes and exps counted in selective_floors"""
    gen = torch.Generator().manual_seed(SEED + 1)
    cases = [(8, 1024, 2048, 16, 4, 4.0e12, 5.0e12), (8, 1024, 2048, 16, 2, 4.0e12, 5.0e12), (1, 1, 1, 1, 4, 1e9, 1e9)]
    cases += [(_randint(gen, 1, 9), _randint(gen, 1, 3000), _randint(gen, 1, 5000), _randint(gen, 1, 65),
               [1, 2, 4, 8][_randint(gen, 0, 4)], float(_randint(gen, 1, 5000)) * 1e9, float(_randint(gen, 1, 9000)) * 1e9)
              for _ in range(6)]
    for batch, dim, length, n_states, size, bandwidth, exps_per_s in cases:
        for backward in (False, True):
            shape = f"(batch, dim, L, N) = {(batch, dim, length, n_states)}, {size} bytes a value"
            got = nb.selective_floors(batch, dim, length, n_states, size, bandwidth, exps_per_s, backward=backward)
            assert isinstance(got, (tuple, list)) and len(got) == 2, \
                f"selective_floors must return (memory floor, exp floor), it returned {got!r}"
            want = _floors(batch, dim, length, n_states, size, bandwidth, exps_per_s, backward)
            passes = "forward and backward (backward=True)" if backward else "forward"
            for name, g, w, counted in zip(("memory", "exp"), got, want, ("bytes", "exps")):
                if not abs(float(g) - w) <= 1e-9 * w:
                    ratio = float(g) / w
                    raise AssertionError(f"{name} floor of the {passes}, {shape}: {float(g):.6g} us, expected {w:.6g} us "
                                         f"({ratio:.4g} times it): are the {counted} counted as the docstring says, and "
                                         "divided by the rate, in microseconds?")


# ---- 07.2 ---------------------------------------------------------------------------------------

def _view(kind, batch, dim, length, gen, device):
    """A (batch, dim, L) float64 view on `device` with the strides of `kind`, and what they are (the base
    tensor is moved, then sliced: moving a view would lose its strides)."""
    rand = lambda *shape: torch.randn(*shape, generator=gen, dtype=torch.float64).to(device)  # noqa: E731
    if kind == "block rows":        # a slice of a (batch, 3 dim, L) projection: stride 1 along L
        x = rand(batch, 3 * dim, length)[:, dim:2 * dim]
    elif kind == "channel last":    # a slice of a (batch, L, 2 dim) tensor, transposed: stride 1 along dim
        x = rand(batch, length, 2 * dim).transpose(1, 2)[:, :dim]
    elif kind == "every other position":
        x = rand(batch, dim, 2 * length)[..., ::2]
    else:                            # "batch last": the batch elements interleaved
        x = rand(dim, length, batch).permute(2, 0, 1)
    return x, f"{kind} {tuple(x.stride())}"


@contextlib.contextmanager
def _notebook_kernel(nb, name):
    """scan_lib's selective_scan (this chapter's launchers and autograd) running the notebook's kernel `name`
    in place of its own."""
    saved = getattr(library_scan, name)
    setattr(library_scan, name, getattr(nb, name))
    try:
        yield library_scan.selective_scan
    finally:
        setattr(library_scan, name, saved)


def _strided_cases(nb, seed):
    """(inputs, what) for views of several layouts: u and delta with different strides each time."""
    gen = torch.Generator().manual_seed(seed)
    cases = [  # (batch, dim, N, L, u's layout, delta's layout)
        (2, 3, 2, 1, "channel last", "block rows"), (3, 2, 3, 7, "block rows", "channel last"),
        (2, 3, 2, 19, "every other position", "batch last"), (2, 2, 2, _randint(gen, 9, 25), "batch last", "every other position"),
    ]
    for batch, dim, n_states, length, u_kind, delta_kind in cases:
        u, u_layout = _view(u_kind, batch, dim, length, gen, nb.DEVICE)
        delta, delta_layout = _view(delta_kind, batch, dim, length, gen, nb.DEVICE)
        z, _ = _view("channel last", batch, dim, length, gen, nb.DEVICE)
        inputs = dict(u=u, delta=delta, A=-(0.2 + torch.rand(dim, n_states, generator=gen, dtype=torch.float64)),
                      B=torch.randn(batch, n_states, length, generator=gen, dtype=torch.float64),
                      C=torch.randn(batch, n_states, length, generator=gen, dtype=torch.float64),
                      D=torch.randn(dim, generator=gen, dtype=torch.float64), z=z,
                      delta_bias=0.3 * torch.randn(dim, generator=gen, dtype=torch.float64),
                      initial_state=torch.randn(batch, dim, n_states, generator=gen, dtype=torch.float64))
        inputs = {k: v if k in ("u", "delta", "z") else v.to(nb.DEVICE) for k, v in inputs.items()}
        yield inputs, f"batch {batch}, dim {dim}, N {n_states}, L = {length}; u: {u_layout}, delta: {delta_layout}"


def _compare(names, got, want, what):
    for name, g, w in zip(names, got, want):
        assert tuple(g.shape) == tuple(w.shape), f"{name}: shape {tuple(g.shape)}, expected {tuple(w.shape)} ({what})"
        err = ((g.double() - w).abs().nan_to_num(float("inf")).max() / w.abs().max().clamp_min(1e-30)).item()
        assert err <= 1e-10, f"{name}: relative error {err:.3g} against the float64 reference ({what})"


def _with_gradients(fn, inputs):
    """out, last state and the gradients of every input, for one fixed random dout and dlast."""
    args = {k: v.detach().requires_grad_(True) for k, v in inputs.items()}   # leaves with the views' strides
    out, last = fn(**args, delta_softplus=True, return_last_state=True)
    gen = torch.Generator().manual_seed(SEED)
    dout = torch.randn(out.shape, generator=gen, dtype=torch.float64).to(out.device)
    dlast = torch.randn(last.shape, generator=gen, dtype=torch.float64).to(out.device)
    loss = (out.double() * dout).sum() + (last.double() * dlast).sum()
    return [out, last, *torch.autograd.grad(loss, list(args.values()))]


def exercise_2(nb):
    """the strided offsets of u and delta in strided_fwd_kernel"""
    for inputs, what in _strided_cases(nb, SEED + 2):
        with torch.no_grad():   # the notebook's public function: forward only (the backward is 07.3's)
            got = nb.selective_scan(**inputs, delta_softplus=True, return_last_state=True)
        want = selective_scan_ref(**inputs, delta_softplus=True, return_last_state=True)
        _compare(["out", "last state"], got, want, f"selective_scan, {what}")
        with _notebook_kernel(nb, "strided_fwd_kernel") as scan:   # the states it saves for the backward
            got = _with_gradients(scan, inputs)
        names = ["out", "last state"] + [f"d{k}" for k in inputs]
        _compare(names, got, _with_gradients(selective_scan_ref, inputs),
                 f"scan_lib's backward after the notebook's forward kernel, {what}")


def exercise_3(nb):
    """the loads of u, delta and the step after each run in strided_bwd_kernel"""
    for inputs, what in _strided_cases(nb, SEED + 3):
        with _notebook_kernel(nb, "strided_bwd_kernel") as scan:
            got = _with_gradients(scan, inputs)
        names = ["out", "last state"] + [f"d{k}" for k in inputs]
        _compare(names, got, _with_gradients(selective_scan_ref, inputs),
                 f"the notebook's backward kernel after scan_lib's forward, {what}")

"""Hidden checks of chapter 08's exercises (tools/grade.py runs them in a process of its own).

One function `exercise_K(nb)` per exercise 08.K, its docstring's first line the exercise's title: it
returns when the exercise is solved and raises (an AssertionError saying why) when it is not. `nb.name`
is what the student's notebook defined.

The reference is the library's `attention_reference` (not the student's notebook), in float64, the naive
way: the whole L x L matrix of scores, its softmax and log-sum-exp, and the gradients by torch autograd
through it. 08.1 merges states (m, l, o) of two
disjoint sets of keys, drawn here (some rows of a set with no key at all: the identity), and compares the
merged state with the state of the union and with attention over the union. 08.2 runs scan_lib's forward
launcher with the notebook's `attend_key_blocks` swapped into scan_lib's module; 08.3 runs scan_lib's
forward, then scan_lib's backward with the notebook's `dkdv_query_blocks` swapped in: the exercises do not
depend on each other (an unsolved 08.2 does not fail 08.3). The lengths are awkward (1, 7, 33 and a random
one) so that whole, partial and causal-diagonal blocks are all visited.
"""
import contextlib
import importlib
import sys
from collections import defaultdict

import torch

from scan_lib.runtime import DEVICE

importlib.import_module("scan_lib.flash_attention")
library = sys.modules["scan_lib.flash_attention"]   # the module (scan_lib.flash_attention is the function)

SEED = 20_08
TOLERANCE = {torch.float32: 5e-5, torch.float64: 1e-10}       # max abs error of outputs and gradients, inputs ~ N(0, 1)
LSE_TOLERANCE = {torch.float32: 1e-4, torch.float64: 1e-10}


def _randint(gen, low, high):
    return int(torch.randint(low, high, (1,), generator=gen))


def _first_wrong(got, want, tol, dim_of_rows):
    """(max abs error, index of the first wrong row along dim_of_rows, or None)."""
    diff = (got.double() - want.double()).abs().nan_to_num(nan=float("inf"), posinf=float("inf"))
    rows = diff.movedim(dim_of_rows, 0).reshape(diff.shape[dim_of_rows], -1).amax(1) > tol
    wrong = rows.nonzero().flatten().tolist()
    return diff.max().item(), (wrong[0] if wrong else None)


def _off(err):
    """How far off, in words: a number, or 'not finite' (NaN or inf)."""
    return f"off by {err:.3g}" if err < float("inf") else "not finite (NaN or inf)"


# ---- 08.1 ---------------------------------------------------------------------------------------

def _state(scores, visible, values):
    """(m, l, o) in float64 of the visible keys of each row; rows with no visible key get the identity (-inf, 0, 0)."""
    masked = scores.masked_fill(~visible, float("-inf"))
    m = masked.max(-1).values if scores.shape[-1] else torch.full(scores.shape[:-1], float("-inf"), dtype=scores.dtype)
    finite_m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    weights = torch.where(visible, torch.exp(scores - finite_m[..., None]), torch.zeros_like(scores))
    return m, weights.sum(-1), weights @ values


def exercise_1(nb):
    """the merge of two online-softmax states in merge_states"""
    gen = torch.Generator().manual_seed(SEED + 1)
    for length in (1, 7, 33, _randint(gen, 34, 130)):
        queries, head_dim = _randint(gen, 4, 8), _randint(gen, 1, 17)
        cut = _randint(gen, 0, length + 1)   # X = keys [0, cut), Y = [cut, L): 0 and L give an empty X or Y
        scores = 20 * torch.randn(queries, length, generator=gen, dtype=torch.float64)   # wide: the maxima differ
        scores[0] -= 30 * (torch.arange(length) >= cut)   # row 0's maximum is in X (when X has one)
        scores[1] += 30 * (torch.arange(length) >= cut)   # row 1's in Y
        values = torch.randn(length, head_dim, generator=gen, dtype=torch.float64)
        visible = torch.rand(queries, length, generator=gen) < 0.7
        visible[:, _randint(gen, 0, length)] = True   # every row sees a key
        if cut > 0 and length > cut:   # row 2 sees no key of X, row 3 none of Y: the identity in one of them
            visible[2, :cut] = False
            visible[3, cut:] = False
        x = _state(scores[:, :cut], visible[:, :cut], values[:cut])
        y = _state(scores[:, cut:], visible[:, cut:], values[cut:])
        whole = _state(scores, visible, values)
        masked = scores.masked_fill(~visible, float("-inf"))   # attention over the visible keys, the whole matrix
        lse = torch.logsumexp(masked, -1)
        out = torch.exp(masked - lse[:, None]) @ values
        case = f"{queries} queries, L = {length} keys cut at {cut} (X = keys [0, {cut}), Y = [{cut}, {length}))"
        for order, (first, second) in (("merge_states(X, Y)", (x, y)), ("merge_states(Y, X)", (y, x))):
            got = nb.merge_states(tuple(t.clone() for t in first), tuple(t.clone() for t in second))
            assert isinstance(got, (tuple, list)) and len(got) == 3, \
                f"{order} must return the state (m, l, o), it returned {type(got).__name__}"
            m, l, o = got
            for name, g, w in (("m", m, whole[0]), ("l", l, whole[1]), ("o", o, whole[2])):
                assert tuple(g.shape) == tuple(w.shape), f"{order}: {name} has shape {tuple(g.shape)}, expected {tuple(w.shape)} ({case})"
            if not torch.equal(m, whole[0]):
                raise AssertionError(f"{order}: m is not the larger of the two maxima ({case})")
            for name, g, w in (("l", l, whole[1]), ("o", o, whole[2])):
                err, row = _first_wrong(g, w, 1e-12 * (1 + w.abs().max().item()), 0)
                if row is not None:
                    why = ""
                    if g.isnan().any():
                        why = (": NaN. Where a state is the identity (-inf, 0, 0) its scale is e^(-inf - m) = 0, and where both "
                               "are, e^(-inf - (-inf)) must count as 1; is each scale e^(its m - m), at most 1?")
                    else:
                        bigger = "X" if x[0][row] >= y[0][row] else "Y"
                        why = f": is the other state rescaled by e^(its m - m), and the state with the maximum ({bigger} for that row) kept as it is?"
                    raise AssertionError(f"{order}: {name} of the merged state differs from the state of X and Y "
                                         f"together: {_off(err)}, first in row {row} ({case}){why}")
            err = max((o / l[:, None] - out).abs().max().item(), (m + l.log() - lse).abs().max().item())
            assert err < 1e-12, f"{order}: o / l or m + log l differs from attention over X and Y by {err:.3g} ({case})"
    identity = (torch.full((2,), float("-inf"), dtype=torch.float64), torch.zeros(2, dtype=torch.float64),
                torch.zeros(2, 3, dtype=torch.float64))
    m, l, o = nb.merge_states(identity, tuple(t.clone() for t in identity))
    assert torch.equal(m, identity[0]) and torch.equal(l, identity[1]) and torch.equal(o, identity[2]), \
        (f"merge_states of the identity (-inf, 0, 0) with itself gave m = {m.tolist()}, l = {l.tolist()}, "
         f"o = {o.tolist()}: expected the identity (e^(-inf - (-inf)) must count as 1, not NaN)")


# ---- 08.2 and 08.3 ------------------------------------------------------------------------------

@contextlib.contextmanager
def _notebook_helper(nb, name, kernel_name):
    """scan_lib's kernel `kernel_name` calling the notebook's @triton.jit helper `name` in place of its own.

    On the interpreter the kernel looks the helper up in scan_lib's module at every call; on a GPU a
    compiled kernel would be reused, so the kernel's caches are set aside (and put back afterwards)."""
    kernel = getattr(library, kernel_name)
    saved_caches = {attr: getattr(kernel, attr) for attr in ("device_caches", "hash") if hasattr(kernel, attr)}
    saved = getattr(library, name)
    setattr(library, name, getattr(nb, name))
    try:
        if "device_caches" in saved_caches:
            kernel.device_caches = defaultdict(kernel.create_binder)
        if "hash" in saved_caches:
            kernel.hash = None
        yield
    finally:
        setattr(library, name, saved)
        for attr, value in saved_caches.items():
            setattr(kernel, attr, value)


def _cases(gen):
    """(L, head_dim, causal, dtype, sm_scale): float32 at every length, causal and not, and float64 once."""
    length = _randint(gen, 34, 100)
    cases = [(1, 32, False), (7, 32, True), (33, 32, False), (33, 32, True), (length, 32, bool(_randint(gen, 0, 2)))]
    cases = [(n, d, causal, torch.float32, 0.1 + 0.4 * torch.rand(1, generator=gen).item()) for n, d, causal in cases]
    return cases + [(_randint(gen, 17, 50), 32, True, torch.float64, 32 ** -0.5)]


def _inputs(gen, length, head_dim, dtype, how_many):
    heads = 2   # batch 1: the kernels see (batch * heads) rows of L x head_dim
    return [torch.randn(1, heads, length, head_dim, generator=gen, dtype=torch.float64).to(DEVICE, dtype)
            for _ in range(how_many)]


def _what(length, head_dim, causal, dtype, sm_scale):
    return f"L = {length}, head dim {head_dim}, {'causal' if causal else 'not causal'}, {str(dtype)[6:]}, sm_scale {sm_scale:.3g}"


def exercise_2(nb):
    """the online-softmax update (m, l, o) in attend_key_blocks"""
    gen = torch.Generator().manual_seed(SEED + 2)
    for length, head_dim, causal, dtype, sm_scale in _cases(gen):
        q, k, v = _inputs(gen, length, head_dim, dtype, 3)
        with _notebook_helper(nb, "attend_key_blocks", "flash_fwd_kernel"):
            out, lse = library.flash_attention_forward(q, k, v, causal, sm_scale)
        want_out, want_lse = library.attention_reference(q, k, v, causal, sm_scale)
        what = f"scan_lib's forward with the notebook's attend_key_blocks, {_what(length, head_dim, causal, dtype, sm_scale)}"
        lse_err, lse_row = _first_wrong(lse, want_lse, LSE_TOLERANCE[dtype], -1)
        out_err, out_row = _first_wrong(out, want_out, TOLERANCE[dtype], -2)
        if lse_row is None and out_row is None:
            continue
        if lse_row is not None:
            raise AssertionError(f"the log-sum-exp m / log2(e) + log(l) is {_off(lse_err)}, first at query {lse_row} "
                                 f"({what}): are m the running maximum (base 2) and l rescaled by alpha = 2^(m - m_new) "
                                 "before the block's sum of p is added?")
        raise AssertionError(f"the output o / l is {_off(out_err)}, first at query {out_row}, while the log-sum-exp "
                             f"is right ({what}): is o rescaled by alpha before p @ v is added (alpha[:, None], p times "
                             "the block's values)?")


def exercise_3(nb):
    """the dK / dV accumulation in dkdv_query_blocks"""
    gen = torch.Generator().manual_seed(SEED + 3)
    for length, head_dim, causal, dtype, sm_scale in _cases(gen):
        q, k, v, grad = _inputs(gen, length, head_dim, dtype, 4)
        leaves = [t.double().requires_grad_() for t in (q, k, v)]
        _, want_dk, want_dv = torch.autograd.grad(library.attention_reference(*leaves, causal, sm_scale)[0], leaves,
                                                 grad.double())
        out, lse = library.flash_attention_forward(q, k, v, causal, sm_scale)   # scan_lib's forward
        with _notebook_helper(nb, "dkdv_query_blocks", "flash_bwd_dkdv_kernel"):
            _, dk, dv = library.flash_attention_backward(q, k, v, out, lse, grad, causal, sm_scale)
        what = f"scan_lib's backward with the notebook's dkdv_query_blocks, {_what(length, head_dim, causal, dtype, sm_scale)}"
        dv_err, dv_row = _first_wrong(dv, want_dv, TOLERANCE[dtype], -2)
        if dv_row is not None:
            raise AssertionError(f"dV is {_off(dv_err)}, first at key {dv_row} ({what}): dV += P^T dO, with P^T "
                                 "the tile of keys down and queries across")
        dk_err, dk_row = _first_wrong(dk, want_dk, TOLERANCE[dtype], -2)
        if dk_row is not None:
            raise AssertionError(f"dK is {_off(dk_err)}, first at key {dk_row}, while dV is right ({what}): "
                                 "dP^T = V dO^T, dS^T = P^T * (dP^T - delta) with delta one number per query (a row "
                                 "vector across the tile), dK += dS^T Q")

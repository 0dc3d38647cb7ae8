"""scan_lib.ssd (chapter 10): Mamba-2's recurrence as a loop, as one masked matrix and in chunks, in
float64, at awkward lengths, groups of heads, initial and final states, and gradients through autograd."""
import pytest
import torch

import scan_lib  # noqa: F401  (first: without a GPU it switches Triton to its interpreter)
from scan_lib.ssd import segsum, ssd_chunked, ssd_loop, ssd_quadratic


def problem(batch, length, heads, head_dim, groups, n_states, seed=0):
    g = torch.Generator().manual_seed(seed)
    rand = lambda *shape: torch.randn(*shape, generator=g, dtype=torch.float64)   # noqa: E731
    return dict(x=rand(batch, length, heads, head_dim), dt=torch.nn.functional.softplus(rand(batch, length, heads) - 1),
                A=-torch.exp(rand(heads) * 0.5), B=rand(batch, length, groups, n_states),
                C=rand(batch, length, groups, n_states), D=rand(heads), initial_state=rand(batch, heads, head_dim, n_states))


def rel(got, want):
    return ((got - want).abs().max() / want.abs().max().clamp_min(1e-300)).item()


def test_segsum_is_the_sum_of_the_terms_between():
    a = torch.randn(7, dtype=torch.float64)
    s = segsum(a)
    for t in range(7):
        for u in range(7):
            want = a[u + 1:t + 1].sum() if u <= t else torch.tensor(float("-inf"), dtype=torch.float64)
            assert torch.equal(s[t, u], want) or abs(s[t, u] - want) < 1e-14, (t, u)


@pytest.mark.parametrize("length, chunk, heads, groups", [(37, 8, 4, 2), (32, 8, 4, 4), (5, 16, 2, 1), (1, 4, 2, 2), (17, 1, 3, 1)])
def test_chunked_and_matrix_forms_match_the_loop(length, chunk, heads, groups):
    p = problem(2, length, heads, 3, groups, 5, seed=length)
    y, final = ssd_loop(**p)
    y_chunked, final_chunked = ssd_chunked(p["x"], p["dt"], p["A"], p["B"], p["C"], chunk, p["D"], p["initial_state"])
    assert rel(y_chunked, y) < 1e-12 and rel(final_chunked, final) < 1e-12
    no_state = {k: v for k, v in p.items() if k != "initial_state"}
    assert rel(ssd_quadratic(**no_state), ssd_loop(**no_state)[0]) < 1e-12


def test_gradients_of_the_chunked_form_match_the_loop():
    """Autograd through both, every input: the chunked algorithm is the same function, not only the same values."""
    p = {k: v.requires_grad_() for k, v in problem(1, 11, 2, 2, 1, 3, seed=5).items()}
    weights = torch.randn(1, 11, 2, 2, dtype=torch.float64)
    y, final = ssd_loop(**p)
    want = torch.autograd.grad((y * weights).sum() + final.sum(), list(p.values()))
    y, final = ssd_chunked(p["x"], p["dt"], p["A"], p["B"], p["C"], 4, p["D"], p["initial_state"])
    got = torch.autograd.grad((y * weights).sum() + final.sum(), list(p.values()))
    for name, g, w in zip(p, got, want):
        assert rel(g, w) < 1e-12, name


def test_zero_steps_leave_the_state_alone():
    """dt = 0 neither decays the state nor adds to it: the padding rule of the last chunk."""
    p = problem(1, 6, 2, 2, 2, 3)
    p["dt"] = torch.zeros_like(p["dt"])
    _, final = ssd_chunked(p["x"], p["dt"], p["A"], p["B"], p["C"], 4, initial_state=p["initial_state"])
    assert torch.equal(final, p["initial_state"])


@pytest.mark.parametrize("length, chunk, heads, groups, head_dim, n_states",
                         [(37, 16, 4, 2, 3, 5), (70, 32, 2, 1, 8, 4), (1, 16, 2, 2, 4, 4)])
def test_the_triton_forward_matches_the_loop(length, chunk, heads, groups, head_dim, n_states):
    """ssd_forward (two kernels and linear_scan) on float32 inputs against the float64 loop."""
    from scan_lib.runtime import DEVICE
    from scan_lib.ssd import ssd_forward
    p = {k: v.float().to(DEVICE) for k, v in problem(2, length, heads, head_dim, groups, n_states, seed=length).items()}
    y_want, final_want = ssd_loop(**p)
    y, final = ssd_forward(p["x"], p["dt"], p["A"], p["B"], p["C"], chunk, p["D"], p["initial_state"])
    assert y.dtype == torch.float32 and rel(y.double(), y_want) < 1e-5 and rel(final.double(), final_want) < 1e-5

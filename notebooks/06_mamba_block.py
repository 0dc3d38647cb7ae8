# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # 06 · The Mamba block: the scan doing its job
#
# [![Open In Colab](https://colab.research.google.com/assets/colab-badge.svg)](https://colab.research.google.com/github/scan-course/scans-the-hard-way/blob/main/notebooks/06_mamba_block.ipynb)
#
# Chapter 05 built the selective scan. Here it goes to work inside the layer Mamba stacks to make a
# language model. You will learn:
#
# 1. the causal depthwise convolution that comes before the scan, as a Triton kernel (forward and
#    backward), a drop-in for the `causal-conv1d` package's `causal_conv1d_fn`;
# 2. the block around the two kernels, piece by piece, with `mamba_ssm`'s parameter names so a
#    `state_dict` loads either way, and the initialisation that keeps it stable (and what goes wrong
#    without it);
# 3. inference three ways that agree: the whole sequence at once, a long prompt in chunks, and one
#    token at a time in constant memory;
# 4. the scan three ways: a loop, PyTorch's `associative_scan`, and `scan_lib`;
# 5. a tiny model that learns the selective-copying task, beside a baseline that cannot.

# %%
# Setup, the same in every chapter. On Colab, install scan_lib (Colab already has torch and triton).
# Importing scan_lib comes first: without a GPU it switches Triton to its CPU interpreter,
# which must happen before any @triton.jit function is defined.
import subprocess, sys
if "google.colab" in sys.modules:
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "git+https://github.com/scan-course/scans-the-hard-way"], check=True)
import scan_lib
from scan_lib.runtime import DEVICE, ON_GPU
print(scan_lib.runtime.describe())

# %%
#| default_exp mamba

# %%
import math

import matplotlib
import matplotlib.pyplot as plt
import torch
import torch.nn as nn
import torch.nn.functional as F
import triton
import triton.language as tl

from scan_lib.runtime import save_figure

matplotlib.use("Agg")


def max_err(x, ref):
    """Largest absolute difference, in float64."""
    return (x.double() - ref.double()).abs().max().item()

# %% [markdown]
# ## 1. The block at a glance
#
# (lead: the data flow of one block)

# %% [markdown]
# ## 2. The causal convolution
#
# (conv helper: this section)

# %% [markdown]
# ## 3. The block, piece by piece
#
# (lead)

# %% [markdown]
# ## 4. Inference three ways
#
# (lead)

# %% [markdown]
# ## 5. The scan three ways
#
# (lead)

# %% [markdown]
# ## 6. A model that learns: selective copying
#
# The Mamba paper motivates selection with a synthetic task, *selective copying* (Gu & Dao 2023,
# section 4.1.1). A sequence of `L` positions holds `K` data tokens scattered at random positions
# among blank (noise) tokens; then come `K` marker tokens, and at the $k$-th marker the model must
# output the $k$-th data token. Only the `K` marker positions are scored. The positions of the data
# tokens change from one sequence to the next, so the gaps between them (the blanks to ignore) have
# no fixed length.

# %%
BLANK, MARKER = 0, 1


def selective_copying_batch(batch, length, n_data, n_symbols, generator, device=DEVICE):
    """A batch of the selective-copying task: n_data tokens drawn from n_symbols data symbols
    (token ids 2 .. n_symbols+1) at random positions among length - n_data blanks, then n_data markers.
    Returns inputs (batch, length), targets (batch, length) and the mask of the scored positions
    (the markers), where the targets are the data tokens in order."""
    n_noise = length - n_data
    data = torch.randint(2, n_symbols + 2, (batch, n_data), generator=generator)
    positions = torch.rand(batch, n_noise, generator=generator).argsort(dim=-1)[:, :n_data].sort(dim=-1).values
    inputs = torch.full((batch, length), BLANK, dtype=torch.long)
    inputs.scatter_(1, positions, data)
    inputs[:, n_noise:] = MARKER
    targets = torch.full((batch, length), BLANK, dtype=torch.long)
    targets[:, n_noise:] = data
    mask = torch.zeros(batch, length, dtype=torch.bool)
    mask[:, n_noise:] = True
    return inputs.to(device), targets.to(device), mask.to(device)


def show_tokens(tokens):
    """A token sequence as text: '.' blank, '>' marker, letters for the data symbols."""
    return "".join(".>"[t] if t < 2 else chr(ord("a") + t - 2) for t in tokens.tolist())


# Two size profiles: the CPU one trains both models in about a minute each.
if ON_GPU:
    copy_cfg = dict(length=128, n_data=8, n_symbols=16, d_model=64, n_layers=2, batch=64, steps=1500, lr=3e-3)
else:
    copy_cfg = dict(length=32, n_data=4, n_symbols=8, d_model=32, n_layers=2, batch=32, steps=400, lr=1e-2)
copy_data = {k: copy_cfg[k] for k in ("length", "n_data", "n_symbols")}

example_in, example_target, example_mask = selective_copying_batch(
    2, generator=torch.Generator().manual_seed(0), **copy_data)
for row in range(2):
    print("input :", show_tokens(example_in[row]))
    print("target:", " " * int((~example_mask[row]).sum()) + show_tokens(example_target[row][example_mask[row]]))

# %% [markdown]
# Why this needs selection. Fix $\Delta$, $B$ and $C$ (the same at every position, whatever the input)
# and the scan of each channel becomes *time-invariant*: $a = e^{\Delta A}$ at every step, and
# unrolling $h_t = a h_{t-1} + \Delta B u_t$ turns the output into a fixed convolution over positions,
#
# $$\bar y_t = \sum_{s \le t} k_{t-s}\, u_s + D u_t, \qquad k_j = \sum_n C_n\, e^{j \Delta A_n}\, \Delta B_n .$$
#
# The weight $k_{t-s}$ that token $s$ gets at position $t$ depends only on the distance $t - s$, fixed
# once trained, never on what the tokens in between were. The block can make the value $u_s$ of a
# blank small, but each blank still decays what the state holds: the trace the $k$-th data token
# leaves at the markers depends on the random number of blanks after it, so no fixed kernel recovers
# the data tokens in order. A selective scan computes $\Delta_t$ from the token: near 0 on a blank,
# $a_t = e^{\Delta_t A} \approx 1$ and $b_t \approx 0$, the state passes through untouched, as if the
# blank were not there; large on a data token, which is written in. The state then evolves only on
# the data tokens, and the $k$-th of them is always $K - k$ writes back, however long the gaps.
# (Only the scan is time-invariant in the baseline: the gate, the projections and a second layer are
# not, which lets a stack of LTI blocks recover part of the task, for instance by counting tokens with
# a kernel that barely decays. It scores above chance, as the gated LTI models of the paper's table do,
# but far from copying.)
#
# The model is a tiny language model: an embedding, `n_layers` residual blocks
# $x \leftarrow x + \mathrm{Mamba}(\mathrm{RMSNorm}(x))$, a final RMSNorm and a linear head. The
# baseline is the same model with an LTI block: a subclass of `scan_lib.Mamba` whose
# `ssm_parameters` (the method that computes $\Delta$, $B$, $C$ from the conv's output) returns
# learned constants broadcast over the batch and the positions. Everything else (the projections, the
# causal conv, the SiLU gate, $A$, $D$, the initialisation) is shared, so the two differ only in the
# selection.

# %%
class CopyLM(nn.Module):
    """Embedding, n_layers residual blocks x + mixer(RMSNorm(x)), a final RMSNorm and a linear head."""

    def __init__(self, mixer, vocab, d_model, n_layers):
        super().__init__()
        self.embedding = nn.Embedding(vocab, d_model)
        self.norms = nn.ModuleList(nn.RMSNorm(d_model) for _ in range(n_layers))
        self.mixers = nn.ModuleList(mixer(d_model, layer_idx=i) for i in range(n_layers))
        self.norm_f = nn.RMSNorm(d_model)
        self.head = nn.Linear(d_model, vocab, bias=False)

    def forward(self, tokens):                         # tokens (batch, L) -> logits (batch, L, vocab)
        x = self.embedding(tokens)
        for norm, mixer in zip(self.norms, self.mixers):
            x = x + mixer(norm(x))
        return self.head(self.norm_f(x))

    def step(self, tokens, caches):                    # tokens (batch,) -> logits (batch, vocab), one position
        x = self.embedding(tokens)[:, None]
        for i, (norm, mixer) in enumerate(zip(self.norms, self.mixers)):
            out, conv_state, ssm_state = mixer.step(norm(x), *caches[i])
            caches[i] = (conv_state, ssm_state)
            x = x + out
        return self.head(self.norm_f(x))[:, 0]


class LTIMamba(scan_lib.Mamba):
    """scan_lib.Mamba with Delta, B and C that do not depend on the input: learned constants broadcast
    over the batch and the positions, so its scan is a linear time-invariant SSM. (x_proj goes unused.)"""

    def __init__(self, d_model, **kwargs):
        super().__init__(d_model, **kwargs)
        like = dict(device=self.A_log.device, dtype=self.dt_proj.weight.dtype)
        self.delta_const = nn.Parameter(torch.zeros(self.d_inner, **like))  # dt_proj.bias still sets the step
        self.B_const = nn.Parameter(torch.randn(self.d_state, **like))
        self.C_const = nn.Parameter(torch.randn(self.d_state, **like))

    def ssm_parameters(self, x):                        # x (batch, d_inner, L): only its shape is used
        batch, _, length = x.shape
        return (self.delta_const[None, :, None].expand(batch, -1, length),
                self.B_const[None, :, None].expand(batch, -1, length),
                self.C_const[None, :, None].expand(batch, -1, length))


# The baseline's Delta, B and C are the same for two different inputs; the selective block's are not.
probe = LTIMamba(8).to(DEVICE), scan_lib.Mamba(8).to(DEVICE)
probe_x = torch.randn(2, 2, 16, 5, device=DEVICE)
for block in probe:
    same = all(torch.equal(p, q) for p, q in zip(block.ssm_parameters(probe_x[0]), block.ssm_parameters(probe_x[1])))
    print(f"{type(block).__name__:8s} Delta, B, C independent of the input: {same}")
    assert same == isinstance(block, LTIMamba)

# %% [markdown]
# Training: AdamW with a short warm-up and a cosine decay, cross-entropy on the scored positions only,
# the same seeds (same initial embedding and head, same batches) and the same number of steps for both
# models. On the GPU the blocks run the Triton kernels (`causal_conv1d`, `selective_scan`); on the CPU,
# where Triton's interpreter is far too slow to train, `scan_lib.Mamba` picks its pure-PyTorch path
# (`F.conv1d` and a loop over the positions), the same computation.

# %%
from tqdm.auto import tqdm


def train_copying(mixer, cfg, seed=0):
    """Train CopyLM(mixer) on fresh batches of the task; returns the model and the loss and accuracy
    on the scored positions at every step."""
    torch.manual_seed(seed)
    model = CopyLM(mixer, cfg["n_symbols"] + 2, cfg["d_model"], cfg["n_layers"]).to(DEVICE)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg["lr"], weight_decay=0.0)
    steps, warmup = cfg["steps"], cfg["steps"] // 10
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * s / steps)))
    generator = torch.Generator().manual_seed(seed)
    data = {k: cfg[k] for k in ("length", "n_data", "n_symbols")}
    losses, accuracies = [], []
    progress = tqdm(range(steps), desc=mixer.__name__, mininterval=1.0)
    for step in progress:
        inputs, targets, mask = selective_copying_batch(cfg["batch"], generator=generator, **data)
        logits = model(inputs)[mask]                       # (scored positions, vocab)
        loss = F.cross_entropy(logits, targets[mask])
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        schedule.step()
        losses.append(loss.item())
        accuracies.append((logits.argmax(-1) == targets[mask]).float().mean().item())
        if step % 10 == 0 or step == steps - 1:
            progress.set_postfix(loss=f"{losses[-1]:.3f}", accuracy=f"{accuracies[-1]:.2f}", refresh=False)
    return model, losses, accuracies


copy_runs = {name: train_copying(mixer, copy_cfg) for name, mixer in
             [("Mamba (selective)", scan_lib.Mamba), ("LTI baseline", LTIMamba)]}

# %%
def running_mean(values, window=10):
    v = torch.tensor(values, dtype=torch.float64)
    return (v.cumsum(0) - F.pad(v.cumsum(0), (window, 0))[:-window]) / torch.arange(1, len(v) + 1).clamp(max=window)


fig, (ax_loss, ax_acc) = plt.subplots(1, 2, figsize=(7, 3.5))
chance = 1 / copy_cfg["n_symbols"]
for name, (_, losses, accuracies) in copy_runs.items():
    ax_loss.plot(running_mean(losses), label=name)
    ax_acc.plot(running_mean(accuracies), label=name)
ax_loss.axhline(math.log(copy_cfg["n_symbols"]), color="gray", ls=":", label="chance")
ax_acc.axhline(chance, color="gray", ls=":", label="chance")
ax_loss.set(xlabel="step", ylabel="cross-entropy (scored positions)", yscale="log", title="loss")
ax_acc.set(xlabel="step", ylabel="accuracy", ylim=(0, 1.02), title="accuracy (running mean of 10 steps)")
ax_acc.legend(fontsize=8)
fig.tight_layout()
save_figure(fig, "06_selective_copying.png")

# %% [markdown]
# The selective model leaves chance after a plateau and climbs to near-perfect copying; the LTI
# baseline, the same block around a time-invariant scan, levels off well below. On a fresh held-out
# batch, overall and for each of the `K` slots (the $k$-th marker copies the $k$-th data token), which
# shows where the baseline's points above chance come from:

# %%
with torch.no_grad():
    test_in, test_target, test_mask = selective_copying_batch(
        1000, generator=torch.Generator().manual_seed(1), **copy_data)
    copy_correct = {name: (model(test_in).argmax(-1) == test_target)[test_mask].view(len(test_in), -1).double()
                    for name, (model, _, _) in copy_runs.items()}            # (sequences, K) hits
copy_accuracy = {name: hits.mean().item() for name, hits in copy_correct.items()}
print(f"chance {chance:.3f}")
print(f"{'model':18s} {'held-out':>8s}   by slot k = 1 .. {copy_cfg['n_data']}")
for name, hits in copy_correct.items():
    print(f"{name:18s} {copy_accuracy[name]:8.3f}   " + " ".join(f"{a:.2f}" for a in hits.mean(0).tolist()))
assert copy_accuracy["Mamba (selective)"] >= 0.9
assert copy_accuracy["LTI baseline"] <= 0.7

# %% [markdown]
# Generation with the recurrent path: the trained model reads a held-out sequence one token at a time
# through `step`, carrying only each block's conv state and scan state (section 4), and emits its copy
# at the markers. Its logits must match the whole-sequence forward's, and so must the greedy tokens.

# %%
copy_model = copy_runs["Mamba (selective)"][0]
gen_in, gen_target, gen_mask = test_in[:8], test_target[:8], test_mask[:8]
with torch.no_grad():
    full_logits = copy_model(gen_in)                                      # (batch, L, vocab)
    caches = [mixer.allocate_inference_cache(gen_in.shape[0], gen_in.shape[1]) for mixer in copy_model.mixers]
    step_logits = torch.stack([copy_model.step(gen_in[:, t], caches) for t in range(gen_in.shape[1])], dim=1)
step_tokens, full_tokens = step_logits.argmax(-1), full_logits.argmax(-1)
logit_err, logit_tol = max_err(step_logits, full_logits), 1e-4 * full_logits.abs().max().item()
for row in range(3):
    print("input:", show_tokens(gen_in[row]), " target:", show_tokens(gen_target[row][gen_mask[row]]),
          " step path:", show_tokens(step_tokens[row][gen_mask[row]]))
print(f"max |step logits - forward logits| = {logit_err:.2e} (tolerance {logit_tol:.1e}); "
      f"greedy tokens agree at the scored positions: {torch.equal(step_tokens[gen_mask], full_tokens[gen_mask])}")
assert logit_err <= logit_tol
assert torch.equal(step_tokens[gen_mask], full_tokens[gen_mask])

# %% [markdown]
# ## 7. On the GPU: one block against mamba_ssm's
#
# (lead)

# %% [markdown]
# ## Going deeper

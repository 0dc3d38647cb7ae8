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
# (model helper: this section)

# %% [markdown]
# ## 7. On the GPU: one block against mamba_ssm's
#
# (lead)

# %% [markdown]
# ## Going deeper

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
# # 02 · Exponential moving averages and the first-order scan
#
# [![Open In Colab](https://colab.research.google.com/assets/colab-badge.svg)](https://colab.research.google.com/github/scan-course/scans-the-hard-way/blob/main/notebooks/02_ema.ipynb)

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
#| default_exp ema

# %%
#| export
import triton
import triton.language as tl


@triton.jit
def first_order_op(a_left, b_left, a_right, b_right):
    """Compose two steps of h -> a*h + b: first the left (earlier) one, then the right (later) one.

    a_right * (a_left * h + b_left) + b_right = (a_left * a_right) * h + (a_right * b_left + b_right)
    """
    return a_left * a_right, a_right * b_left + b_right

"""Issue 21, item 4: the host's work per call of every public op on an empty input (nothing reaches a
kernel), on benchmarks/host_time.py's calls.

Timings on a shared machine swing with other jobs' load, so the tests count instead: the Python
functions and the C functions called from Python during one call (sys.setprofile), and which files
they come from. Those counts are the same on every machine and under any load; a regression that
puts the dispatcher, inspect.signature or a dozen more tensor ops back on the path shows up as a
count over its budget. One timing test backs them, with a margin of three times the target."""
import importlib.util
import statistics
import sys
import time
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("host_time", ROOT / "benchmarks" / "host_time.py")
host_time = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(host_time)

TARGET_US = 30   # issue 21: at most 30 us of Python per call on an empty input, on the 2-core CPU machine

# Calls (Python functions plus C functions called from Python) per empty call, about 1.5 times what
# each op takes after issue 21's item 4 (in brackets: without gradients / with; before it: cumsum
# 65 / 65, linear_scan 101 / 101, flash_attention 86 / 86, mamba_chunk_scan_combined 132 / 132).
BUDGET = {
    "cumsum": 70,                       # 45 / 57
    "linear_scan": 60,                  # 39 / 44
    "multistate_scan": 80,              # 50 / 56
    "selective_scan": 100,              # 62 / 68
    "causal_conv1d": 60,                # 34 / 38
    "flash_attention": 110,             # 62 / 78
    "mamba_chunk_scan_combined": 160,   # 101 / 119
    "causal_conv1d_update": 35,         # 20 / 20
    "selective_state_update": 60,       # 41 / 41
}


def calls_during(fn) -> list:
    """The functions called during fn(): ("py", file, name) for Python, ("c", "", name) for C."""
    events = []

    def record(frame, event, arg):
        if event == "call":
            events.append(("py", frame.f_code.co_filename, frame.f_code.co_name))
        elif event == "c_call":
            events.append(("c", "", getattr(arg, "__qualname__", repr(arg))))
    sys.setprofile(record)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return events[:-1]   # the last one is sys.setprofile(None) itself


@pytest.mark.parametrize("grad", [False, True], ids=["plain", "grad"])
@pytest.mark.parametrize("name", list(BUDGET))
def test_an_empty_call_stays_within_its_budget_of_calls(name, grad):
    op = host_time.empty_calls(grad)[name][0]
    op()   # the first call may build caches
    events = calls_during(op)
    assert len(events) <= BUDGET[name], f"{name}: {len(events)} calls, budget {BUDGET[name]}: {events}"
    files = {file for kind, file, _ in events if kind == "py"}
    # torch.library's custom-op dispatch (EagerFastOp skips it in eager calls) and inspect.signature
    # (new-style autograd.Function.apply binds its arguments with it; runtime.apply avoids that):
    for slow in ("torch/_library/", "torch/_ops.py", "inspect.py"):
        assert not any(slow in file for file in files), f"{name}: the call went through {slow}: {sorted(files)}"


def test_the_count_sees_the_dispatcher():
    """The file check can fail: the op behind cumsum, called through the dispatcher as the public op
    called it before EagerFastOp, runs code of torch/_library."""
    from scan_lib.cumsum import cumsum_op
    x = torch.empty(4, 0)
    cumsum_op._op(x, -1)
    events = calls_during(lambda: cumsum_op._op(x, -1))
    assert any("torch/_library/" in file for _, file, _ in events)


@pytest.mark.parametrize("name", list(BUDGET))
def test_an_empty_call_takes_at_most_three_times_the_target(name):
    """This thread's CPU time (another job's load moves it far less than wall time), median of 7
    samples of 100 calls, under 3 x 30 us: a generous margin, so that only a real regression fails."""
    op = host_time.empty_calls(False)[name][0]
    us = host_time.median_host_us(op, 100, clock="cpu")
    assert us < 3 * TARGET_US, f"{name}: {us:.1f} us per empty call"

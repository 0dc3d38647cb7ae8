"""The grader (tools/grade.py) on chapter 04's exercise notebook: untouched, partly solved, solved.

Cost on 2 shared CPU cores: about 2 minutes for the file (measured 111 s: the chapter 65 s, the partial
27 s, the untouched 19 s; twice that when the cores are busy). Each case is a fresh kernel running the
notebook on Triton's interpreter with --needed-only (up to the backward kernel's cell, where the last
exercise is): the untouched notebook's stubs fail fast; the chapter runs sections 1-4's own checks in
full (the one-block and the blocked forward kernels, L up to 1000) before the hidden checks (about 10 s).
Every case is marked slow (`make test-slow`); CI does not run them.
"""
import sys
from pathlib import Path

import nbformat
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import grade  # noqa: E402
from test_grade import _passed, chapter_passes_every_exercise, solved, untouched_fails_every_exercise# noqa: E402

IDS = ["04.1", "04.2", "04.3"]


@pytest.mark.slow
def test_untouched_notebook_fails_every_exercise():
    untouched_fails_every_exercise("04_multistate", IDS)


@pytest.mark.slow
def test_partly_solved_notebook_gets_partial_credit(tmp_path):
    """04.1 and 04.3 solved, 04.2 written without the carry (each chunk scanned from zero): 04.2 fails
    with a reason that points at the carry, and the backward (04.3) is graded on its own."""
    path = solved("04_multistate", set(IDS), tmp_path)
    notebook = nbformat.read(path, as_version=4)
    right = "states = scan_tile(a, b * x[:, None], h)"
    cell = next(c for c in notebook.cells if right in c.source)
    cell.source = cell.source.replace(right, "states = scan_tile(a, b * x[:, None], h * 0.0)")
    nbformat.write(notebook, path)
    report = grade.grade(path, needed_only=True)
    assert _passed(report) == {"04.1": True, "04.2": False, "04.3": True}, grade.text_report(report)
    reason = report["exercises"][1]["reason"]
    assert "multistate_forward" in reason and "carried between chunks" in reason, reason
    assert "score: 2/3" in grade.text_report(report)


@pytest.mark.slow
def test_the_chapter_passes_every_exercise():
    chapter_passes_every_exercise("04_multistate", IDS)

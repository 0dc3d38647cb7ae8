"""The grader (tools/grade.py) on chapter 00's exercise notebook: untouched, partly solved, solved.

Cost on 2 shared CPU cores (busy with other work): about 75 s for the file, over the 60 s aimed at: 3
grader runs of 18-32 s, each a fresh kernel running the notebook on Triton's interpreter with
--needed-only, up to row_sums_kernel (on the way, compiling vector_add_kernel for sm_90 three times in
subprocesses and the row sums' own demonstration), then the hidden checks of
tools/grading/checks_00.py, about 4 s. The full chapter runs in about the same time (18 s of cells),
so --needed-only saves little here; it is kept for symmetry with the other chapters.
"""
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import grade  # noqa: E402
from test_grade import _passed, chapter_passes_every_exercise, solved, untouched_fails_every_exercise# noqa: E402

IDS = ["00.1", "00.2", "00.3"]


@pytest.mark.slow
def test_untouched_notebook_fails_every_exercise():
    untouched_fails_every_exercise("00_triton", IDS)


@pytest.mark.slow
def test_partly_solved_notebook_gets_partial_credit(tmp_path):
    report = grade.grade(solved("00_triton", {"00.2"}, tmp_path), needed_only=True)
    assert _passed(report) == {"00.1": False, "00.2": True, "00.3": False}, grade.text_report(report)
    assert "exercise 00.1" in report["exercises"][0]["reason"] and "exercise 00.3" in report["exercises"][2]["reason"]
    assert report["score"] == 1


def test_the_chapter_passes_every_exercise():
    chapter_passes_every_exercise("00_triton", IDS)

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

import nbformat
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import grade  # noqa: E402
from test_grade import _passed, solved  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
CHAPTER = ROOT / "notebooks" / "00_triton.ipynb"
EXERCISE = ROOT / "exercises" / "00_triton.ipynb"
IDS = ["00.1", "00.2", "00.3"]


@pytest.mark.slow
def test_untouched_notebook_fails_every_exercise():
    report = grade.grade(EXERCISE, needed_only=True)
    assert _passed(report) == dict.fromkeys(IDS, False)
    assert report["score"] == 0 and report["total"] == 3
    for exercise in report["exercises"]:  # each fails on its own stub, whose message names it
        assert f"exercise {exercise['id']}" in exercise["reason"], exercise
    assert "score: 0/3" in grade.text_report(report)


@pytest.mark.slow
def test_partly_solved_notebook_gets_partial_credit(tmp_path):
    report = grade.grade(solved("00_triton", {"00.2"}, tmp_path), needed_only=True)
    assert _passed(report) == {"00.1": False, "00.2": True, "00.3": False}, grade.text_report(report)
    assert "exercise 00.1" in report["exercises"][0]["reason"] and "exercise 00.3" in report["exercises"][2]["reason"]
    assert report["score"] == 1


def test_the_chapter_passes_every_exercise():
    """The chapter itself, solutions in place (the partly solved case covers putting solutions back)."""
    report = grade.grade(CHAPTER, needed_only=True)
    assert _passed(report) == dict.fromkeys(IDS, True), grade.text_report(report)
    assert report["execution"]["cells"] < sum(c.cell_type == "code" for c in nbformat.read(EXERCISE, 4).cells)

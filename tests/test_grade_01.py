"""The grader (tools/grade.py) on chapter 01's exercise notebook: untouched, partly solved, solved.

Cost on 2 shared CPU cores (busy with other work): 46-61 s for the file, 3 grader runs of 11-23 s, each
a fresh kernel running the notebook on Triton's interpreter with --needed-only, up to the three-phase
kernels, then the hidden checks of tools/grading/checks_01.py, under 1 s. (The full solved chapter
takes about 115 s of cells here, the exported cumsum's checks most of it: graded by hand with
`make grade NB=notebooks/01_cumsum.ipynb`.)
"""
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import grade  # noqa: E402
from test_grade import _passed, chapter_passes_every_exercise, solved, untouched_fails_every_exercise# noqa: E402

IDS = ["01.1", "01.2", "01.3", "01.4"]


@pytest.mark.slow
def test_untouched_notebook_fails_every_exercise():
    untouched_fails_every_exercise("01_cumsum", IDS)


@pytest.mark.slow
def test_partly_solved_notebook_gets_partial_credit(tmp_path):
    """The block totals and the carry are checked on kernels launched directly, so each passes on its own."""
    report = grade.grade(solved("01_cumsum", {"01.2", "01.4"}, tmp_path), needed_only=True)
    assert _passed(report) == {"01.1": False, "01.2": True, "01.3": False, "01.4": True}, grade.text_report(report)
    assert "exercise 01.1" in report["exercises"][0]["reason"] and "exercise 01.3" in report["exercises"][2]["reason"]
    assert report["score"] == 2


def test_the_chapter_passes_every_exercise():
    chapter_passes_every_exercise("01_cumsum", IDS)

"""The grader (tools/grade.py) on chapter 07's exercise notebook: untouched, partly solved, and the chapter.

Every case runs with --needed-only: the run stops after the launchers' cells in "Going deeper" (16 code
cells, the main line's timing cells skipped on a CPU; the chapter's checks, measurements and failed ideas
after them take about 1.5 minutes on Triton's interpreter and are not what the checks need). Most of each case is the checks of 07.2 and 07.3 (the
strided scan forward and backward on the interpreter, about 10 s each). Cost on 2 shared CPU cores: 10-28 s per case,
54 s for the file (measured at load 4).
"""
from pathlib import Path

import pytest

import sys

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import grade  # noqa: E402
from test_grade import _passed, chapter_passes_every_exercise, solved, untouched_fails_every_exercise# noqa: E402

NAME = "07_performance"
IDS = ["07.1", "07.2", "07.3"]


@pytest.mark.slow
def test_untouched_notebook_fails_every_exercise():
    untouched_fails_every_exercise("07_performance", IDS)


@pytest.mark.slow
def test_partly_solved_notebook_gets_partial_credit(tmp_path: Path):
    """The floors (07.1) and the backward's loads (07.3) solved, the forward's loads (07.2) not: 07.3 is
    checked after scan_lib's forward, so the forward's stub does not fail it."""
    report = grade.grade(solved(NAME, {"07.1", "07.3"}, tmp_path), needed_only=True)
    assert _passed(report) == {"07.1": True, "07.2": False, "07.3": True}, grade.text_report(report)
    assert "exercise 07.2" in report["exercises"][1]["reason"]
    assert report["score"] == 2


@pytest.mark.slow
def test_the_chapter_passes_every_exercise():
    chapter_passes_every_exercise("07_performance", IDS)

"""The grader (tools/grade.py) on chapter 10's exercise notebook: untouched, partly solved, and the chapter.

Every case runs with --needed-only: the run stops after the cell of the state-passing kernel (the last
that holds an exercise). The checks run the chunked form in float64 and the kernel on Triton's
interpreter in a few seconds; before that cell run the chapter's main-line checks of sections 1-3 (its
Going deeper checks come after it). All three cases are slow (over CI's 15 s each).
"""
from pathlib import Path

import pytest

import sys

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import grade  # noqa: E402
from test_grade import _passed, chapter_passes_every_exercise, solved, untouched_fails_every_exercise  # noqa: E402

NAME = "10_mamba2"
IDS = ["10.1", "10.2"]


@pytest.mark.slow
def test_untouched_notebook_fails_every_exercise():
    untouched_fails_every_exercise(NAME, IDS)


@pytest.mark.slow
def test_partly_solved_notebook_gets_partial_credit(tmp_path: Path):
    """The kernel's carry (10.2) solved, the PyTorch scan over chunks (10.1) not: 10.2 is checked on
    pass_states alone, so 10.1's stub does not fail it."""
    report = grade.grade(solved(NAME, {"10.2"}, tmp_path), needed_only=True)
    assert _passed(report) == {"10.1": False, "10.2": True}, grade.text_report(report)
    assert "exercise 10.1" in report["exercises"][0]["reason"]
    assert report["score"] == 1


@pytest.mark.slow
def test_the_chapter_passes_every_exercise():
    chapter_passes_every_exercise(NAME, IDS)

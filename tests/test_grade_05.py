"""The grader (tools/grade.py) on chapter 05's exercise notebook: untouched, partly solved, and the chapter.

Every case runs with --needed-only (up to the forward kernel's cell): the chapter's later cells check
scan_lib.selective_scan, the library's kernels, which the stubs do not reach, so an untouched notebook
would run them all (about 250 s on the CPU interpreter) without failing fast. The partly solved
notebook keeps 05.2's stub in `discretize`, which every kernel calls: that 05.3 passes anyway shows
that its check runs the student's forward kernel with the library's `discretize`.
"""
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import grade  # noqa: E402
from test_grade import _passed, chapter_passes_every_exercise, solved, untouched_fails_every_exercise# noqa: E402

IDS = ("05.1", "05.2", "05.3")


def _solved(ids: set[str], tmp_path: Path) -> Path:
    return solved("05_mamba", ids, tmp_path)


@pytest.mark.slow
def test_untouched_notebook_fails_every_exercise():
    untouched_fails_every_exercise("05_mamba", IDS)


@pytest.mark.slow
def test_partly_solved_notebook_gets_partial_credit(tmp_path):
    report = grade.grade(_solved({"05.1", "05.3"}, tmp_path), needed_only=True)
    assert _passed(report) == {"05.1": True, "05.2": False, "05.3": True}, grade.text_report(report)
    assert "exercise 05.2" in report["exercises"][1]["reason"]
    assert "score: 2/3" in grade.text_report(report)


@pytest.mark.slow
def test_the_chapter_passes_every_exercise():
    chapter_passes_every_exercise("05_mamba", IDS)

"""The grader (tools/grade.py) on chapter 06's exercise notebook: untouched, partly solved, and the chapter.

Every case runs with --needed-only: the run stops after the Initialisation cell (14 code cells), since
the rest of the chapter (the block's checks, the timings, the selective-copying training) is not what
the checks need and takes minutes on Triton's interpreter. Most of each run is the chapter's own
convolution checks (scan_lib's kernels on the interpreter). Cost on 2 shared CPU cores: 30-45 s per
case, about 2 minutes for the file (112 s measured at load 4.7), over the 60 s target (the cells before the last exercise cannot
be skipped without grading something other than the notebook).
"""
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import grade  # noqa: E402
from test_grade import _passed, chapter_passes_every_exercise, solved, untouched_fails_every_exercise# noqa: E402

NAME = "06_mamba_block"
IDS = ["06.1", "06.2", "06.3"]


@pytest.mark.slow
def test_untouched_notebook_fails_every_exercise():
    untouched_fails_every_exercise("06_mamba_block", IDS)


@pytest.mark.slow
def test_partly_solved_notebook_gets_partial_credit(tmp_path):
    """The step kernel (06.2) solved, the convolution (06.1) and the selection (06.3) not."""
    report = grade.grade(solved(NAME, {"06.2"}, tmp_path), needed_only=True)
    assert _passed(report) == {"06.1": False, "06.2": True, "06.3": False}, grade.text_report(report)
    assert "exercise 06.1" in report["exercises"][0]["reason"]
    assert "exercise 06.3" in report["exercises"][2]["reason"]
    assert report["score"] == 1


@pytest.mark.slow
def test_the_chapter_passes_every_exercise():
    chapter_passes_every_exercise("06_mamba_block", IDS)

"""The grader (tools/grade.py) on chapter 06's exercise notebook: untouched, partly solved, and the chapter.

Every case runs with --needed-only: the run stops after the Initialisation cell (10 code cells), since
the rest of the chapter (the block's checks, the timings, the selective-copying training, Going deeper's
checks of scan_lib's convolution kernels) is not what the checks need and takes minutes on Triton's
interpreter. Exercise 06.1 is the tap loop of section 2's short convolution kernel, whose check there
runs a few small problems. Cost on 2 shared CPU cores: 44 s for the file with -n 2 at load 1.4
(landing's, whose needed-only run went through the library kernels' checks: 55 s at the same load).
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

"""The grader (tools/grade.py) on chapter 08's exercise notebook: untouched, partly solved, and the chapter.

Every case runs with --needed-only: the run stops after the backward kernels' cell, the first code cell
of "Going deeper: the backward kernels" right after the main line's Summary (the last that holds an
exercise; the backward's checks, the torch op, the CUDA walk-through and the GPU comparisons after it
are not what the checks need). In the chapter run most of the time is the forward checks of section 4
on Triton's interpreter; in the exercise notebooks those cells stop at the first stub. The
checks take about 5 s (08.2 and 08.3 run scan_lib's kernels on the interpreter). Cost on 2 shared CPU
cores: 28 s untouched, 28 s partly solved, 34 s for the chapter (over CI's 15 s: all three are slow),
91 s for the file (measured at load 0.5).
"""
from pathlib import Path

import pytest

import sys

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import grade  # noqa: E402
from test_grade import _passed, chapter_passes_every_exercise, solved, untouched_fails_every_exercise  # noqa: E402

NAME = "08_flash_attention"
IDS = ["08.1", "08.2", "08.3"]


@pytest.mark.slow
def test_untouched_notebook_fails_every_exercise():
    untouched_fails_every_exercise(NAME, IDS)


@pytest.mark.slow
def test_partly_solved_notebook_gets_partial_credit(tmp_path: Path):
    """The merge (08.1) and the dK/dV accumulation (08.3) solved, the forward's update (08.2) not: 08.3 is
    checked after scan_lib's forward, so the forward's stub does not fail it."""
    report = grade.grade(solved(NAME, {"08.1", "08.3"}, tmp_path), needed_only=True)
    assert _passed(report) == {"08.1": True, "08.2": False, "08.3": True}, grade.text_report(report)
    assert "exercise 08.2" in report["exercises"][1]["reason"]
    assert report["score"] == 2


@pytest.mark.slow
def test_the_chapter_passes_every_exercise():
    chapter_passes_every_exercise(NAME, IDS)

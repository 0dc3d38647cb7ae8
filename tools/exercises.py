"""Student notebooks: each chapter with its solutions taken out, written to exercises/NN_name.ipynb.

    python tools/exercises.py          # write exercises/ (make exercises)
    python tools/exercises.py --check  # fail if exercises/ differs from what the chapters give

A chapter joins by putting nbgrader's markers, each on a line of its own, around the lines a student
writes (in notebooks/NN_name.py, then `make sync`):

        ### BEGIN SOLUTION
        ### HINT: one line that the stub's error message shows (optional)
        <the solution: kept in the chapter and in scan_lib>
        ### END SOLUTION

Each region becomes an exercise, numbered in notebook order: 02.1, 02.2, ... Its lines are replaced by
a stub with the indentation of the BEGIN SOLUTION line,

        # YOUR CODE HERE (exercise 02.1)
        raise NotImplementedError("exercise 02.1: <the hint>")

The cells that held solutions lose their outputs; every other output of the chapter's committed run
stays, so the student sees what their code should print. The Colab badge points at the exercise
notebook, and a markdown cell after the title says how to work and how to get graded
(tools/grade.py, with the hidden checks of tools/grading/checks_NN.py).

A stub inside a `@triton.jit` function raises on Triton's CPU interpreter (the function runs as
Python); on a GPU the compiler rejects it before anything runs: the last error of the chain quotes the
stub's line ("unsupported AST node type: Raise"), so the exercise's id and hint are in the message
either way (seen by compiling such a kernel for sm_90 with Triton 3.6; not run on a GPU here).
"""
from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

import nbformat

sys.path.insert(0, str(Path(__file__).resolve().parent))
import nbtools  # noqa: E402

EXERCISES = nbtools.ROOT / "exercises"
GENERIC_HINT = "write the code that the text above describes"


class MarkerError(ValueError):
    pass


def solution_regions(source: str) -> list[tuple[int, int, str, str]]:
    """(first line, last line, indentation, hint) of each BEGIN/END SOLUTION region in a cell's source,
    line indices of the marker lines themselves."""
    regions, begin = [], None
    lines = source.split("\n")
    for i, line in enumerate(lines):
        if line.strip() == nbtools.BEGIN_SOLUTION:
            if begin is not None:
                raise MarkerError(f"line {i + 1}: BEGIN SOLUTION inside another solution")
            begin = i
        elif line.strip() == nbtools.END_SOLUTION:
            if begin is None:
                raise MarkerError(f"line {i + 1}: END SOLUTION without BEGIN SOLUTION")
            hint = GENERIC_HINT
            if begin + 1 < i and lines[begin + 1].strip().startswith(nbtools.HINT):
                hint = lines[begin + 1].strip()[len(nbtools.HINT):].strip() or GENERIC_HINT
            indent = lines[begin][: len(lines[begin]) - len(lines[begin].lstrip())]
            regions.append((begin, i, indent, hint))
            begin = None
    if begin is not None:
        raise MarkerError(f"line {begin + 1}: BEGIN SOLUTION without END SOLUTION")
    return regions


def stub(exercise_id: str, indent: str, hint: str) -> list[str]:
    message = f"exercise {exercise_id}: {hint}"
    return [f"{indent}# YOUR CODE HERE (exercise {exercise_id})", f"{indent}raise NotImplementedError({message!r})"]


def _enclosing_def(lines: list[str], begin: int) -> str | None:
    """The name of the function whose body holds line `begin`, if any."""
    depth = len(lines[begin]) - len(lines[begin].lstrip())
    for line in reversed(lines[:begin]):
        match = re.match(r"(\s*)def (\w+)\(", line)
        if match and len(match.group(1)) < depth:
            return match.group(2)
    return None


def exercise_notebook(chapter: Path):
    """The student notebook of a chapter (its .ipynb, outputs included), and the exercises in it:
    a list of (id, function or None, hint). None when the chapter has no markers."""
    name = chapter.stem
    notebook = nbformat.read(chapter, as_version=4)
    number = name[:2]
    exercises = []
    for index, cell in enumerate(notebook.cells):
        if cell.cell_type != "code":
            continue
        try:
            regions = solution_regions(cell.source)
        except MarkerError as error:
            raise MarkerError(f"{_rel(chapter)}, code cell {index}: {error}") from None
        if not regions:
            continue
        lines = cell.source.split("\n")
        kept, start = [], 0
        for begin, end, indent, hint in regions:
            exercise_id = f"{number}.{len(exercises) + 1}"
            exercises.append((exercise_id, _enclosing_def(lines, begin), hint))
            kept += lines[start:begin] + stub(exercise_id, indent, hint)
            start = end + 1
        cell.source = "\n".join(kept + lines[start:])
        cell.outputs = []
        cell.execution_count = None
        cell.metadata["tags"] = cell.metadata.get("tags", []) + ["exercise"]  # the grader's --needed-only
    if not exercises:
        return None, []
    first_md = next(c for c in notebook.cells if c.cell_type == "markdown")
    first_md.source = first_md.source.replace(nbtools.colab_link(name), colab_link(name))
    intro = nbformat.v4.new_markdown_cell(_intro(name, exercises))
    intro.id = "exercises-how-to"
    notebook.cells.insert(notebook.cells.index(first_md) + 1, intro)
    notebook.metadata.pop("scan_course", None)  # the output fingerprint belongs to the chapter
    notebook.metadata.pop("jupytext", None)  # no .py pairing for a student notebook
    notebook.metadata["scan_course"] = {"exercises": {"chapter": name, "ids": [e[0] for e in exercises]}}
    return notebook, exercises


def colab_link(name: str) -> str:
    return nbtools.colab_link(name).replace("/notebooks/", "/exercises/")


def _intro(name: str, exercises) -> str:
    rows = "\n".join(f"| {i} | {f'`{f}`' if f else ''} | {h} |" for i, f, h in exercises)
    return f"""\
## Exercises

This is chapter {name[:2]} with {len(exercises)} pieces of code taken out. Each one is now a stub,
`raise NotImplementedError("exercise {exercises[0][0]}: ...")`: replace it by your code, at the same
indentation, and run the notebook from the top. The outputs shown under the other cells are those of
the complete chapter (on a GPU), so you can compare; the cells after an exercise fail until it is done.

| exercise | in | hint |
| --- | --- | --- |
{rows}

Inside a `@triton.jit` function the stub raises when the kernel runs on Triton's CPU interpreter; on a
GPU the compiler refuses it first: the last error of the chain quotes the stub's line and says
"unsupported AST node type: Raise".

**Grading.** Save the notebook (on Colab: File, Download .ipynb) and hand it in. The grader,
`make grade NB=path/to/{name}.ipynb` in a clone of the repository, runs it top to bottom in a fresh
kernel with a time limit, then runs checks you do not see here (random shapes, awkward lengths, a
float64 reference) on the functions your notebook defines, and reports each exercise as passed or
failed with the reason. Keep the names of the functions as they are."""


def _rel(path: Path) -> Path:
    return path.relative_to(nbtools.ROOT) if path.is_relative_to(nbtools.ROOT) else path


def _text(notebook) -> str:
    return nbformat.writes(notebook) + "\n"


def wanted() -> dict[Path, str]:
    """Every exercise notebook and the text it should hold."""
    files = {}
    for source in nbtools.chapter_sources():
        notebook, _ = exercise_notebook(source.with_suffix(".ipynb"))
        if notebook is not None:
            files[EXERCISES / f"{source.stem}.ipynb"] = _text(notebook)
    return files


def write() -> None:
    files = wanted()
    for stale in set(EXERCISES.glob("*.ipynb")) - set(files):
        stale.unlink()
        print(f"removed {_rel(stale)}")
    for path, text in files.items():
        if not path.exists() or path.read_text() != text:
            path.parent.mkdir(exist_ok=True)
            path.write_text(text)
            print(f"wrote {_rel(path)}")


def check() -> list[str]:
    """Problems with exercises/: a missing, stale or orphaned notebook, or malformed markers."""
    try:
        files = wanted()
    except MarkerError as error:
        return [f"solution markers: {error}"]
    problems = []
    for path, text in files.items():
        if not path.exists() or path.read_text() != text:
            problems.append(f"{_rel(path)} is stale: run `make exercises`")
    for stale in set(EXERCISES.glob("*.ipynb")) - set(files):
        problems.append(f"{_rel(stale)} comes from no chapter with solution markers: run `make exercises`")
    return problems


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="fail if exercises/ is stale instead of writing it")
    if parser.parse_args().check:
        problems = check()
        for problem in problems:
            print(f"FAIL {problem}")
        sys.exit(1 if problems else 0)
    write()


if __name__ == "__main__":
    main()

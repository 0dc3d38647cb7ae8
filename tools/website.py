"""Build the course website: every chapter with its committed outputs, and the exercise notebooks.

    python tools/website.py [--out build/site]        (make site; open build/site/html/index.html)

The site is a Sphinx project rendered by myst-nb (Jupyter Book's engine, used directly: its notebooks
are plain .ipynb files, nothing needs converting, and every piece installs from PyPI with pip). This
script assembles the source folder build/site/src from site/conf.py, site/index.md,
notebooks/NN_*.ipynb (as chapters/) and exercises/NN_*.ipynb, copies MathJax 3 next to the pages (from
the sphinx-mathjax-offline wheel) so that the site needs no network, and replaces each notebook's Colab
badge image (an external picture) by a plain link. Notebooks are not executed: the committed outputs of
the GPU run are what readers see.
"""
from __future__ import annotations

import argparse
import re
import shutil
import sys
from pathlib import Path

import nbformat

ROOT = Path(__file__).resolve().parent.parent
BADGE = re.compile(r"\[!\[Open In Colab\]\([^)]*\)\]\(([^)]*)\)")


def pages() -> dict[str, list[Path]]:
    """The notebooks the site shows, by section: chapters and exercises, in course order."""
    return {"chapters": sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb")),
            "exercises": sorted((ROOT / "exercises").glob("[0-9][0-9]_*.ipynb"))}


def copy_notebook(source: Path, target: Path) -> None:
    """The notebook with its Colab badge as a plain link (no external image to load)."""
    notebook = nbformat.read(source, as_version=4)
    for cell in notebook.cells:
        if cell.cell_type == "markdown":
            cell.source = BADGE.sub(r"[Open in Colab](\1)", cell.source)
    nbformat.write(notebook, target)


def assemble(src: Path) -> None:
    if src.exists():
        shutil.rmtree(src)
    (src / "_static").mkdir(parents=True)
    for name in ("conf.py", "index.md", "favicon.svg"):
        shutil.copy(ROOT / "site" / name, src / name)
    for section, notebooks in pages().items():
        (src / section).mkdir()
        for notebook in notebooks:
            copy_notebook(notebook, src / section / notebook.name)
    import importlib.util
    mathjax = Path(importlib.util.find_spec("sphinx-mathjax-offline").origin).parent / "static" / "mathjax"
    shutil.copytree(mathjax, src / "_static" / "mathjax")


def build(out: Path) -> Path:
    """Assemble the sources under out/src and render them to out/html; returns the html folder."""
    from sphinx.cmd.build import build_main
    assemble(out / "src")
    html = out / "html"
    status = build_main(["-b", "html", "-q", "-j", "auto", str(out / "src"), str(html)])
    if status != 0:
        sys.exit(f"sphinx-build failed with status {status}")
    return html


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=ROOT / "build" / "site")
    html = build(parser.parse_args().out)
    print(f"site: open {html / 'index.html'}")


if __name__ == "__main__":
    main()

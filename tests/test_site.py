"""The course website (`make site`, tools/website.py): built from the repo's files, then every page opened
in a real headless browser, Debian's Chromium driven through chromedriver (selenium).

For each page: it loads without a console error (severe entries of the browser log: a missing file, a
script error), every image has loaded (figures are cell outputs written next to the page), and the
math has been typeset by MathJax with no TeX error. A screenshot of chapter 05's page is kept in
build/site_screenshot.png. Needs the packages chromium and chromium-driver (.ci/run installs them);
skipped, saying so, without them. Builds the site once (about 30 s) and visits about 20 pages.
"""
import json
import shutil
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))
import website as course_site  # noqa: E402

for module in ("sphinx", "myst_nb", "selenium"):   # requirements.txt installs them; a bare GPU python may lack them
    pytest.importorskip(module, reason=f"{module} is not installed (pip install -r requirements.txt)")
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
DRIVER = shutil.which("chromedriver")
pytestmark = pytest.mark.skipif(not (CHROMIUM and DRIVER), reason=(
    "needs Chromium and its driver: apt-get install chromium chromium-driver (.ci/run installs them)"))

WAIT_FOR_MATHJAX = """
const done = arguments[arguments.length - 1], start = Date.now();
(function poll() {   // MathJax 3 loads asynchronously; startup.promise resolves after the first typesetting
  if (window.MathJax && MathJax.startup && MathJax.startup.promise) {
    MathJax.startup.promise.then(() => done("typeset"), error => done("MathJax failed: " + error));
  } else if (Date.now() - start > 30000) {
    done("MathJax did not load");
  } else {
    setTimeout(poll, 100);
  }
})();
"""
PAGE_STATE = """
return {
  broken_images: Array.from(document.images).filter(i => !(i.complete && i.naturalWidth > 0)).map(i => i.src),
  images: document.images.length,
  math: document.querySelectorAll("span.math, div.math").length,
  typeset: document.querySelectorAll("mjx-container").length,
  tex_errors: document.querySelectorAll("mjx-merror, [data-mjx-error]").length,
  title: document.title,
};
"""


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    return course_site.build(tmp_path_factory.mktemp("site"))


@pytest.fixture(scope="module")
def server(site):
    """The built site over HTTP on localhost, as a reader gets it (file:// pages cannot load web fonts)."""
    import functools
    import http.server
    import threading
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(site))
    handler.log_message = lambda *args: None
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()


@pytest.fixture(scope="module")
def browser():
    from selenium import webdriver
    from selenium.webdriver.chrome.options import Options
    from selenium.webdriver.chrome.service import Service
    options = Options()
    options.binary_location = CHROMIUM
    for argument in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                     "--window-size=1280,1000"):
        options.add_argument(argument)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(DRIVER), options=options)
    driver.set_script_timeout(60)
    yield driver
    driver.quit()


def visit(browser, url: str) -> dict:
    browser.get(url)
    state = {"mathjax": browser.execute_async_script(WAIT_FOR_MATHJAX), **browser.execute_script(PAGE_STATE)}
    state["console_errors"] = [entry["message"] for entry in browser.get_log("browser") if entry["level"] == "SEVERE"]
    return state


def recorded_figures(notebook) -> int:
    """How many images the notebook's recorded outputs hold (PNG or SVG)."""
    cells = json.loads(notebook.read_text())["cells"]
    return sum(any(kind in output.get("data", {}) for kind in ("image/png", "image/svg+xml"))
               for cell in cells for output in cell.get("outputs", []))


def test_every_page_loads_with_its_figures_and_math(site, server, browser):
    sections = course_site.pages()
    pages = [site / "index.html"] + [site / section / (notebook.stem + ".html")
                                     for section, notebooks in sections.items() for notebook in notebooks]
    assert len(sections["chapters"]) >= 8 and all(page.exists() for page in pages)
    for page in pages:
        where = page.relative_to(site)
        state = visit(browser, f"{server}/{where}")
        assert state["console_errors"] == [], (where, state["console_errors"])
        assert state["broken_images"] == [], (where, state["broken_images"])
        if state["math"]:   # Sphinx loads MathJax only on pages with math
            assert state["mathjax"] == "typeset", (where, state["mathjax"])
        assert state["tex_errors"] == 0, where
        if page.parent.name == "chapters":   # every chapter has formulas; its recorded figures all show
            assert state["math"] > 0 and state["typeset"] >= state["math"], (where, state)
            assert state["images"] >= recorded_figures(ROOT / "notebooks" / f"{page.stem}.ipynb"), (where, state)
        if page.stem == "05_mamba":
            shot = ROOT / "build" / "site_screenshot.png"
            shot.parent.mkdir(exist_ok=True)
            assert browser.save_screenshot(str(shot)) and shot.stat().st_size > 10_000


def test_the_browser_check_catches_a_broken_page(site, server, browser):
    """A page with a missing figure, a script error and broken TeX fails each check (the test can fail)."""
    page = site / "broken_page_for_the_test.html"
    page.write_text("""<html><head><script async src="_static/mathjax/tex-svg.js"></script></head>
<body><img src="missing.png"><span class="math">\\(\\frac{1}{\\)</span>
<script>undefined_function();</script></body></html>""")
    state = visit(browser, f"{server}/{page.name}")
    page.unlink()
    assert state["broken_images"] and state["console_errors"]
    assert state["tex_errors"] > 0 or state["typeset"] < state["math"]

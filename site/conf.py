# Sphinx configuration of the course website (`make site`, tools/website.py). The notebooks are rendered
# with their committed outputs (never executed here) by myst-nb; math by a MathJax 3 copy served with
# the site (from the sphinx-mathjax-offline wheel), so the pages need no network.
project = "Scans the hard way"
author = "the scan-course authors"
copyright = "2026, the scan-course authors"
extensions = ["myst_nb"]
myst_enable_extensions = ["dollarmath", "amsmath"]
nb_execution_mode = "off"                 # the committed outputs (a GPU run) are the content
nb_merge_streams = True
exclude_patterns = ["_build", "**.ipynb_checkpoints"]
html_theme = "sphinx_book_theme"
html_title = "Scans the hard way"
html_static_path = ["_static"]
html_theme_options = {
    "repository_url": "https://github.com/scan-course/scans-the-hard-way",
    "use_repository_button": True,
    "show_toc_level": 2,
}
mathjax_path = "mathjax/tex-svg.js"       # MathJax 3, SVG output: no fonts to fetch (tools/website.py copies it)
suppress_warnings = ["mystnb.unknown_mime_type", "myst.header"]
html_context = {"default_mode": "light"}  # the theme logs an error for an unset mode on file:// pages
html_favicon = "favicon.svg"

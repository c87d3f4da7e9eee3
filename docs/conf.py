"""Sphinx configuration for mpjax's documentation.

Build: ``sphinx-build -W -b html docs docs/_build/html`` (the ``docs`` extra).
"""

import mpjax

project = "mpjax"
author = "The mpjax authors"
copyright = "2026, The mpjax authors"  # noqa: A001 (Sphinx's name)
release = mpjax.__version__
version = release

extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.autosummary",
    "sphinx.ext.napoleon",
    "sphinx.ext.viewcode",
    "myst_parser",
]

source_suffix = {".rst": "restructuredtext", ".md": "markdown"}
exclude_patterns = ["_build"]
myst_heading_anchors = 3

autosummary_generate = True
autodoc_default_options = {"members": True, "show-inheritance": False}
autodoc_typehints = "description"
autodoc_member_order = "bysource"
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_rtype = False
napoleon_use_ivar = True  # "Attributes:" as fields, so NamedTuple fields are not described twice

html_theme = "sphinx_book_theme"
html_title = f"mpjax {release}"  # every page says which version it documents
html_theme_options = {"show_toc_level": 2}
html_static_path = ["_static"]
html_css_files = ["mpjax.css"]  # code and tables wrap at a 1280-pixel window

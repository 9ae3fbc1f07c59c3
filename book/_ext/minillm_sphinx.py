"""A small Sphinx extension for the book's website (loaded from _config.yml).

Jupyter Book 1 with Sphinx 7 writes some inline scripts into every page twice (the same
script registered at two priorities). For sphinx-thebe's `const THEBE_JS_URL = ...` the
second copy is a JavaScript error on every page ("Identifier 'THEBE_JS_URL' has already
been declared"), which the browser test (tests/browser) reports. Keep the first copy.

The site is read offline too, so formulas must not need a CDN: MathJax 3 comes from the
django-static-mathjax wheel (the `book` extra) into `_static/mathjax/`, and every page
loads it from there.
"""
from __future__ import annotations

import shutil
from pathlib import Path

# what tex-chtml.js loads: its fonts, TeX extensions on demand, the menu
MATHJAX_PARTS = ["tex-chtml.js", "output/chtml", "input/tex", "ui", "a11y"]
MATHJAX_PATH = "mathjax/tex-chtml.js"  # relative to _static


def mathjax_source() -> Path:
    try:
        import mathjax  # django-static-mathjax: mathjax/static/mathjax/es5/...
    except ImportError:
        raise RuntimeError("the website serves MathJax itself: install the 'book' "
                           "extra (django-static-mathjax)") from None
    return Path(mathjax.__path__[0]) / "static" / "mathjax" / "es5"


def use_local_mathjax(app) -> None:
    app.config.mathjax_path = MATHJAX_PATH


def copy_mathjax(app, exception) -> None:
    if exception is not None or app.builder.format != "html":
        return
    source, target = mathjax_source(), Path(app.outdir) / "_static" / "mathjax"
    for part in MATHJAX_PARTS:
        if (source / part).is_dir():
            shutil.copytree(source / part, target / part, dirs_exist_ok=True)
        else:
            target.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source / part, target / part)


def _script_key(script) -> tuple:
    attributes = getattr(script, "attributes", {}) or {}
    # an inline script's filename is None in one copy and "" in the other
    return (getattr(script, "filename", None) or "", tuple(sorted(attributes.items())))


def drop_duplicate_scripts(app, pagename, templatename, context, doctree) -> None:
    seen, unique = set(), []
    for script in context.get("script_files", []):
        key = _script_key(script)
        if key not in seen:
            seen.add(key)
            unique.append(script)
    context["script_files"] = unique


def setup(app):
    app.connect("html-page-context", drop_duplicate_scripts, priority=900)
    app.connect("builder-inited", use_local_mathjax)
    app.connect("build-finished", copy_mathjax)
    return {"parallel_read_safe": True, "parallel_write_safe": True}

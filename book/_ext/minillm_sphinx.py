"""A small Sphinx extension for the book's website (loaded from _config.yml).

Jupyter Book 1 with Sphinx 7 writes some inline scripts into every page twice (the same
script registered at two priorities). For sphinx-thebe's `const THEBE_JS_URL = ...` the
second copy is a JavaScript error on every page ("Identifier 'THEBE_JS_URL' has already
been declared"), which the browser test (tests/browser) reports. Keep the first copy.
"""
from __future__ import annotations


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
    return {"parallel_read_safe": True, "parallel_write_safe": True}

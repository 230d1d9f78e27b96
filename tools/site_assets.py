"""Sphinx extension (a local extension in _config.yml): every page loads each script once.

Sphinx 7.4 lists an inline script that an extension adds after the builder has started twice,
once under the file name None and once under '' (StandaloneHTMLBuilder.prepare_writing re-adds
the registry's scripts as `filename or ''`, and the two do not compare equal). sphinx-thebe's
`const THEBE_JS_URL = ...` then runs twice, and every page throws "Identifier 'THEBE_JS_URL' has
already been declared" in the reader's console (found by tools/check_site.py). This drops the
second copy of any script with the same file, priority and attributes.
"""

from __future__ import annotations

from typing import Any


def dedupe_scripts(app: Any, pagename: str, templatename: str, context: dict,
                   doctree: Any) -> None:
    scripts = context.get("script_files")
    if not scripts:
        return
    seen, kept = set(), []
    for js in scripts:
        attrs = getattr(js, "attributes", {}) or {}
        key = (str(getattr(js, "filename", js) or ""), getattr(js, "priority", 0),
               tuple(sorted(attrs.items())))
        if key not in seen:
            seen.add(key)
            kept.append(js)
    scripts[:] = kept


def setup(app: Any) -> dict:
    app.connect("html-page-context", dedupe_scripts, priority=900)
    return {"parallel_read_safe": True, "parallel_write_safe": True}

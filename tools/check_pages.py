"""Fail when a built page shows error output (a traceback, anything a cell wrote to stderr) or a
MyST role printed as text instead of rendered: `{glue:text}` inside backticks is code, so the
reader sees the role, not the number.

    python tools/check_pages.py _build/html
"""

import re
import sys
from pathlib import Path

MARKERS = ("output stderr", "output traceback", "Traceback (most recent call last)", "ipythontb")
# A role's name in braces, not part of LaTeX such as \text{ref} or \pi_{ref} in rendered math.
UNRENDERED_ROLE = re.compile(
    r"(?<![\\A-Za-z_])\{(glue|cite|ref|numref|eq|doc|download|term)(:[a-z]+)?\}")


def problems_in(text: str) -> list[str]:
    """What on one page's HTML a reader should not see."""
    found = [m for m in MARKERS if m in text]
    found += [f"unrendered role {m.group(0)}" for m in UNRENDERED_ROLE.finditer(text)]
    return found


def main(html_dir: str) -> int:
    pages = sorted(p for p in Path(html_dir).rglob("*.html") if "_static" not in p.parts)
    if not pages:
        print(f"no pages under {html_dir}: build the book first")
        return 1
    bad = [(p, m) for p in pages for m in problems_in(p.read_text(errors="replace"))]
    for page, problem in bad:
        print(f"{page}: contains {problem!r}")
    print(f"{len(pages)} pages checked, {len(bad)} problems")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "_build/html"))

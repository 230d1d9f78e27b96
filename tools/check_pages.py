"""Fail when a built page shows error output: a traceback, or anything a cell wrote to stderr.

    python tools/check_pages.py _build/html
"""

import sys
from pathlib import Path

MARKERS = ("output stderr", "output traceback", "Traceback (most recent call last)", "ipythontb")


def main(html_dir: str) -> int:
    pages = sorted(p for p in Path(html_dir).rglob("*.html") if "_static" not in p.parts)
    if not pages:
        print(f"no pages under {html_dir}: build the book first")
        return 1
    bad = [(p, m) for p in pages for m in MARKERS if m in p.read_text(errors="replace")]
    for page, marker in bad:
        print(f"{page}: contains {marker!r}")
    print(f"{len(pages)} pages checked, {len(bad)} problems")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "_build/html"))

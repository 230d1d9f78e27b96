"""tools/check_site.py catches what a reader would meet: checked on a small site made here, with
one good page and one page that has each fault the checker exists for. (The real site is checked
by .ci/run after the book build: `python tools/check_site.py _build/html`.)"""

from __future__ import annotations

import shutil
import struct
import sys
import zlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
check_site = pytest.importorskip("check_site")
pytest.importorskip("playwright.sync_api", reason="pip install playwright (requirements.txt)")
BROWSER = shutil.which("chromium") or "/usr/bin/chromium"
if not Path(BROWSER).exists():
    pytest.skip("no Chromium: apt-get install -y chromium (.ci/run installs it)",
                allow_module_level=True)

CONFIG = """repository:
  url: https://github.com/someone/book
  branch: dev
  path_to_book: .
launch_buttons:
  colab_url: https://colab.research.google.com
"""
COLAB = "https://colab.research.google.com/github/someone/book/blob/dev/nb.ipynb"


def png(w: int, h: int) -> bytes:
    raw = b"".join(b"\x00" + b"\xff\x00\x00" * w for _ in range(h))

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + \
            struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0)) \
        + chunk(b"IDAT", zlib.compress(raw)) + chunk(b"IEND", b"")


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    site = tmp_path_factory.mktemp("site")
    (site / "_sources").mkdir()
    (site / "plot.png").write_bytes(png(4, 3))
    (site / "_sources" / "nb.ipynb").write_text("{}")
    (site / "_sources" / "wrong.ipynb").write_text("{}")
    (site / "_config.yml").write_text(CONFIG)
    page = "<html><body><main>{}</main></body></html>".format
    (site / "good.html").write_text(page(
        '<h1 id="top">Good</h1><a href="other.html#sec">in</a><a href="#top">up</a>'
        '<img src="plot.png"><a href="https://example.org/">out</a>'))
    (site / "other.html").write_text(page('<h2 id="sec">Section</h2>'))
    (site / "nb.html").write_text(page(f'<a href="{COLAB}">colab</a>'
                                       '<a href="_sources/nb.ipynb">download</a>'))
    (site / "wrong.html").write_text(page(f'<a href="{COLAB.replace("dev", "main")}">colab</a>'))
    (site / "bad.html").write_text(page(
        '<a href="missing.html">gone</a><a href="other.html#nope">no anchor</a>'
        '<img src="missing.png"><img src="https://example.com/cdn.png">'
        '<script>console.error("boom"); throw new Error("kaput")</script>'))
    problems, counts = check_site.check(site, site / "_config.yml", BROWSER, 120, None,
                                        search=None, screenshots={})
    return problems, counts


def of(problems: list[str], page: str) -> list[str]:
    return [p for p in problems if p.startswith(page + ":")]


def test_a_good_page_has_no_problems(result):
    problems, counts = result
    assert of(problems, "good.html") == [] and of(problems, "other.html") == []
    assert of(problems, "nb.html") == []
    assert counts["pages"] == 5 and counts["notebook pages"] == 2
    assert counts["external links (not followed)"] == 3  # example.org and two Colab links


@pytest.mark.parametrize("fault", [
    "link to a missing file: missing.html",
    "anchor does not exist: other.html#nope",
    "image did not load: http://127.0.0.1",
    "request leaves loopback: https://example.com/cdn.png",
    "console error: boom",
    "uncaught exception: kaput",
    "HTTP 404: missing.png",
])
def test_each_fault_is_reported(result, fault):
    assert any(fault in p for p in of(result[0], "bad.html")), result[0]


def test_launch_and_download_buttons_must_match_the_config(result):
    wrong = of(result[0], "wrong.html")
    assert any("no launch button to " + COLAB.replace("nb.ipynb", "wrong.ipynb") in p
               for p in wrong)  # wrong.html's button names the main branch and another notebook
    assert any("no download button for _sources/wrong.ipynb" in p for p in wrong)

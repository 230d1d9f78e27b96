"""tools/check_pages.py, the static check of the built site: it reports error output and a MyST
role that reached the page as text (a glued number written inside backticks), and it leaves
LaTeX that happens to contain a role's name alone."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
import check_pages  # noqa: E402  (tools/ is not a package)


def test_a_role_inside_backticks_is_reported():
    page = ('<p>first in <code class="docutils literal notranslate"><span class="pre">'
            '{glue:text}</span></code>ws_key``)</p>')
    assert check_pages.problems_in(page) == ["unrendered role {glue:text}"]
    assert check_pages.problems_in("<p>see {cite}`x` and {numref}`fig`</p>") == [
        "unrendered role {cite}", "unrendered role {numref}"]


def test_latex_with_a_role_name_is_not_reported():
    math = (r'<span class="math">\(\pi_{\text{ref}} \exp(r/\beta)\)</span>'
            r'<span class="math">\(\rho_{ref}\)</span>')
    assert check_pages.problems_in(math) == []


def test_error_output_is_reported():
    assert check_pages.problems_in('<div class="output stderr">x</div>') == ["output stderr"]


def test_main_counts_the_problems_of_a_folder(tmp_path, capsys):
    (tmp_path / "good.html").write_text("<p>loss 1.95</p>")
    (tmp_path / "bad.html").write_text("<code>{glue:text}</code>")
    assert check_pages.main(str(tmp_path)) == 1
    out = capsys.readouterr().out
    assert "bad.html: contains 'unrendered role {glue:text}'" in out
    assert "2 pages checked, 1 problems" in out
    assert check_pages.main(str(tmp_path / "missing")) == 1

"""One bibliography for the whole book: book/references.bib, rendered by sphinxcontrib-bibtex on
book/appendix/bibliography.md. Every {cite} key on a page has an entry, every entry is cited, no
work is entered twice, and every entry says who wrote it, what it is called and when.

The pages are the .md files under book/ and the Markdown cells of the notebooks under book/ (code
cells are not prose and are not searched)."""

from __future__ import annotations

import json
import re
import shutil
from collections import defaultdict
from pathlib import Path

import notebooks  # tools/notebooks.py
import pytest
import yaml
from pybtex.database import parse_file

ROOT = Path(__file__).resolve().parents[1]
BOOK = ROOT / "book"
BIB = BOOK / "references.bib"
REQUIRED = ("author", "title", "year")
# MyST citation roles: {cite}`key`, {cite:p}`a,b`, {cite:t}`key` and sphinxcontrib-bibtex's other
# variants ({cite:ps}, {cite:ct}, {cite:year}, ...)
CITE = re.compile(r"\{cite(?::[a-z]+)?\}`([^`]*)`")


def citations(texts: dict[str, str]) -> dict[str, list[str]]:
    """Cited key -> the pages that cite it."""
    cited = defaultdict(list)
    for page, text in texts.items():
        for match in CITE.finditer(text):
            for key in match.group(1).split(","):
                cited[key.strip()].append(page)
    return dict(cited)


def entries(path: Path = BIB) -> dict[str, dict[str, str]]:
    """Key -> fields (lower-case names; people as "Last, First and Last, First")."""
    data = parse_file(str(path), bib_format="bibtex")  # a repeated key is an error here
    out = {}
    for key, entry in data.entries.items():
        fields = {name.lower(): str(value) for name, value in entry.fields.items()}
        for role, people in entry.persons.items():
            fields[role.lower()] = " and ".join(str(p) for p in people)
        out[key] = fields
    return out


def plain_title(title: str) -> str:
    """A title compared without case, braces, TeX commands or punctuation ("&" reads "and")."""
    title = re.sub(r"\\?&", " and ", title)
    title = re.sub(r"\\[A-Za-z]+|\\.|[{}]", "", title).casefold()
    return " ".join(re.sub(r"[^\w]+", " ", title).split())


def problems(bib: dict[str, dict[str, str]], cited: dict[str, list[str]],
             bib_name: str = "book/references.bib") -> list[str]:
    """Every way the citations and the bibliography disagree, one message each."""
    out = []
    for key in sorted(set(cited) - set(bib)):
        where = ", ".join(sorted(set(cited[key])))
        out.append(f"{{cite}}`{key}` on {where} has no entry in {bib_name}: add one (author, "
                   f"title, year) or fix the key")
    for key in sorted(set(bib) - set(cited)):
        out.append(f"{key} in {bib_name} is cited by no page: cite it with {{cite}}`{key}` in "
                   f"the chapter that relies on it, or remove the entry")
    by_title = defaultdict(list)
    for key, fields in bib.items():
        if fields.get("title", "").strip():
            by_title[plain_title(fields["title"])].append(key)
    for keys in by_title.values():
        if len(keys) > 1:
            out.append(f"{' and '.join(sorted(keys))} in {bib_name} have the same title "
                       f"{bib[keys[0]]['title']!r}: one work, one entry; keep one key and cite it "
                       f"everywhere")
    for key, fields in sorted(bib.items()):
        missing = [name for name in REQUIRED if not fields.get(name, "").strip()]
        if missing:
            out.append(f"{key} in {bib_name} has no {', '.join(missing)}: every entry needs "
                       f"author, title and year")
    return out


def test_the_book_cites_and_the_bibliography_agree():
    found = problems(entries(), citations(notebooks.pages_markdown()))
    assert not found, "\n".join(found)


def test_the_build_reads_this_bibliography():
    config = yaml.safe_load((ROOT / "_config.yml").read_text())
    assert config.get("bibtex_bibfiles") == [BIB.relative_to(ROOT).as_posix()], \
        "_config.yml: set bibtex_bibfiles: [book/references.bib]"
    page = (BOOK / "appendix" / "bibliography.md").read_text()
    assert "```{bibliography}" in page, "book/appendix/bibliography.md lost its bibliography"


def test_citations_are_collected_from_pages_and_markdown_cells_only(tmp_path):
    book = tmp_path / "book"
    (book / "part").mkdir(parents=True)
    (book / "page.md").write_text("As {cite:t}`a` shows, and {cite}`b, c`; not `cite` or {doc}`x`.")
    cells = [{"cell_type": "markdown", "source": ["- {cite:p}`d`, Table 2.\n", "- {cite}`a`."]},
             {"cell_type": "code", "source": ["print('{cite}`e`')"]}]
    (book / "part" / "ch.ipynb").write_text(json.dumps({"cells": cells}))
    (book / "_build").mkdir()
    (book / "_build" / "old.md").write_text("{cite}`f`")
    cited = citations(notebooks.pages_markdown(book))
    assert cited == {"a": ["book/page.md", "book/part/ch.ipynb"], "b": ["book/page.md"],
                     "c": ["book/page.md"], "d": ["book/part/ch.ipynb"]}


def test_the_checks_catch_each_kind_of_problem():
    bib = {
        "good2020": {"author": "Good, A.", "title": "{A Good Paper}", "year": "2020"},
        "twin2020": {"author": "Good, A.", "title": "A good paper.", "year": "2020"},
        "noyear": {"author": "Nobody", "title": "Undated"},
        "unused2021": {"author": "Lonely, B.", "title": "Never Cited", "year": "2021"},
    }
    cited = {"good2020": ["book/x.md"], "twin2020": ["book/y.md"], "noyear": ["book/x.md"],
             "missing2019": ["book/x.md", "book/y.ipynb"]}
    found = problems(bib, cited)
    assert len(found) == 4, found
    assert "{cite}`missing2019` on book/x.md, book/y.ipynb has no entry" in found[0]
    assert found[1].startswith("unused2021 in book/references.bib is cited by no page")
    assert found[2].startswith("good2020 and twin2020 in book/references.bib have the same title")
    assert found[3].startswith("noyear in book/references.bib has no year")


def test_a_planted_duplicate_and_bad_citation_fail(tmp_path):
    """The real bibliography, copied, with a work entered a second time under another key and
    without a year, and a page citing a key that does not exist."""
    bib = tmp_path / "references.bib"
    shutil.copy(BIB, bib)
    with bib.open("a") as f:
        f.write("\n@misc{gopher2021copy,\n  author = {Rae, Jack W. and others},\n"
                "  title = {Scaling language models: methods, analysis and insights from "
                "training Gopher},\n}\n")
    cited = citations(notebooks.pages_markdown())
    cited.setdefault("gopher2021copy", []).append("book/x.md")
    cited.setdefault("rae2021gopherr", []).append("book/x.md")
    found = problems(entries(bib), cited)
    assert len(found) == 3, found
    assert "{cite}`rae2021gopherr` on book/x.md has no entry" in found[0]
    assert "gopher2021copy and rae2021gopher" in found[1] and "same title" in found[1]
    assert found[2].startswith("gopher2021copy in book/references.bib has no year")


@pytest.mark.parametrize("title, same", [
    ("{Scaling Language Models: Methods, Analysis \\& Insights from Training Gopher}",
     "scaling language models methods analysis and insights from training gopher"),
    ("{{GQA}: Training}", "gqa training"),
])
def test_titles_compare_without_case_braces_or_punctuation(title, same):
    assert plain_title(title) == same


STYLE_BIB = r"""
@misc{rae, author = {Rae, Jack W. and others}, title = {{Gopher}}, year = {2021}}
@article{young, author = {Young, John W.}, title = {{Checkpoints}}, journal = {Communications of
  the ACM}, volume = {17}, number = {9}, year = {1974}}
@misc{hagele, author = {H{\"a}gele, Alexander and Jaggi, Martin}, title = {{WSD}}, year = {2024}}
@misc{hf, author = {{Hugging Face}}, title = {{Fixing}}, year = {2024}}
@misc{three, author = {Aa, Bb and Cc, Dd and Ee, Ff}, title = {{Three}}, year = {2000}}
"""


def test_the_styles_print_others_as_et_al_and_sort_by_letters():
    """tools/bibstyle.py, the styles _config.yml selects: "and others" reads "et al." in the
    bibliography and in citations; accents and braces do not move a name after Z; a volume and
    issue are printed without pages."""
    import bibstyle  # tools/bibstyle.py
    from pybtex.database import parse_string

    bibstyle.setup(None)
    data = parse_string(STYLE_BIB, "bibtex")
    style = bibstyle.PlainEtAlStyle()
    printed = {e.key: e.text.render_as("text") for e in style.format_entries(data.entries.values())}
    assert printed["rae"] == "Jack W. Rae et al. Gopher. 2021."
    assert printed["young"] == "John W. Young. Checkpoints. Communications of the ACM, 17(9), 1974."
    assert printed["three"].startswith("Bb Aa, Dd Cc, and Ff Ee.")
    assert [e.key for e in style.sort(data.entries.values())] == \
        ["three", "hagele", "hf", "rae", "young"]

    cite = bibstyle.AuthorYearEtAlStyle()

    def names(key, full):
        template = cite.person.author_or_editor_or_title(full=full)
        return template.format_data({"entry": data.entries[key], "style": cite}).render_as("text")

    assert names("rae", full=False) == names("rae", full=True) == "Rae et al."
    assert names("hagele", full=False) == "Hägele and Jaggi"
    assert (names("three", False), names("three", True)) == ("Aa et al.", "Aa, Cc, and Ee")
    assert cite.bracket_parenthetical.sep == "; "

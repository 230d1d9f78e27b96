"""Sphinx extension (a local extension in _config.yml): "and others" in book/references.bib reads
"et al.".

BibTeX says that an author list goes on with the name "others" (`Rae, Jack W. and others`), and
the book's entries use it wherever a chapter names only the first author ("Rae et al. 2021").
pybtex and sphinxcontrib-bibtex print "others" as if it were a person: "Jack W. Rae and others"
in the bibliography and "[Rae and others, 2021]" in the text. This registers the two styles that
_config.yml selects, which print "Jack W. Rae et al." and "[Rae *et al.*, 2021]" instead (the
italic "et al." sphinxcontrib-bibtex already uses for three or more authors), and separate the
works of one citation with semicolons:

* `plain_etal` (bibtex_default_style): pybtex's `plain` (entries sorted by author, year, title);
* `author_year_etal` (bibtex_reference_style): sphinxcontrib-bibtex's `author_year`.

`plain_etal` also sorts a name by its letters ("H{\\"a}gele" and "Hägele" with the Hs, "{Hugging
Face}" with the Hs, not after "Z" as braces and accents sort), and prints a journal's volume and
issue when an entry has no pages (plain prints "52(4)" only with pages, and the book's entries
leave out pages that no chapter gives).
"""

from __future__ import annotations

import re
import unicodedata
from dataclasses import dataclass, field
from typing import Any

import pybtex.plugin
import sphinxcontrib.bibtex.plugin
from pybtex.richtext import Text
from pybtex.style.formatting import toplevel
from pybtex.style.formatting.plain import Style as PlainStyle
from pybtex.style.formatting.unsrt import date
from pybtex.style.sorting.author_year_title import SortingStyle
from pybtex.style.template import (
    FieldIsMissing,
    first_of,
    node,
    optional,
    optional_field,
    sentence,
    tag,
)
from pybtex.style.template import field as bib_field
from pybtex.style.template import join as bib_join
from sphinxcontrib.bibtex.style.referencing import BracketStyle, PersonStyle
from sphinxcontrib.bibtex.style.referencing.author_year import AuthorYearReferenceStyle
from sphinxcontrib.bibtex.style.template import join


def split_others(persons: list) -> tuple[list, bool]:
    """(the named persons, whether the list ended with "others")."""
    people = list(persons)
    if people and str(people[-1]) == "others":
        return people[:-1], True
    return people, False


def _persons(data: dict, role: str) -> list:
    try:
        return data["entry"].persons[role]
    except KeyError:
        raise FieldIsMissing(role, data["entry"]) from None


@node
def entry_names(children, data, role, **kwargs):
    """The bibliography's names: "A", "A and B", "A, B, and C"; "A et al.", "A, B, et al."."""
    assert not children
    people, more = split_others(_persons(data, role))
    style = data["style"]
    names = [style.format_name(person, style.abbreviate_names) for person in people]
    if not more:
        return join(**kwargs)[names].format_data(data)
    return Text(join(sep=", ")[names].format_data(data),
                ", et al." if len(names) > 1 else " et al.")


@node
def cited_names(children, data, role, full, other, **kwargs):
    """A citation's names: as sphinxcontrib-bibtex writes them, and "A et al." (or, for the
    full-list roles such as {cite:ps}, "A, B et al.") for a list ending with "others"."""
    assert not children
    people, more = split_others(_persons(data, role))
    person = data["style"].person
    names = [person.style_plugin.format(p, person.abbreviate) for p in people]
    if not more:
        return join(other=None if full else other, **kwargs)[names].format_data(data)
    return Text(join(sep=", ")[names if full else names[:1]].format_data(data), other)


def sort_letters(text: str) -> str:
    """A sort key by letters: TeX accents and braces dropped, accented letters as plain ones."""
    text = re.sub(r"\\[A-Za-z]+|\\.", "", text)
    text = "".join(c for c in unicodedata.normalize("NFKD", text) if not unicodedata.combining(c))
    return "".join(c for c in text if c.isalnum() or c.isspace()).lower()


class LettersSortingStyle(SortingStyle):
    def person_key(self, person) -> str:
        return sort_letters(super().person_key(person))

    def sorting_key(self, entry):
        author, year, title = super().sorting_key(entry)
        return author, year, sort_letters(title)


class PlainEtAlStyle(PlainStyle):
    default_sorting_style = "letters_author_year_title"

    def format_names(self, role, as_sentence=True):
        names = entry_names(role, sep=", ", sep2=" and ", last_sep=", and ")
        return sentence[names] if as_sentence else names

    def get_article_template(self, e):
        if "pages" in e.fields:
            return super().get_article_template(e)
        volume = optional[bib_join[bib_field("volume"), optional["(", bib_field("number"), ")"]]]
        return toplevel[
            self.format_names("author"),
            self.format_title(e, "title"),
            sentence[tag("em")[bib_field("journal")], volume, date],
            sentence[optional_field("note")],
            self.format_web_refs(e),
        ]


@dataclass
class EtAlPersonStyle(PersonStyle):
    def names(self, role: str, full: bool):
        return cited_names(role=role, full=full, other=self.other, sep=self.sep, sep2=self.sep2,
                           last_sep=self.last_sep)

    def author_or_editor_or_title(self, full: bool):
        return first_of[
            optional[self.names("author", full)],
            optional[self.names("editor", full)],
            tag("em")[bib_field("title")],
        ]


def _semicolons() -> BracketStyle:
    return BracketStyle(sep="; ")


@dataclass
class AuthorYearEtAlStyle(AuthorYearReferenceStyle):
    """author_year, with "et al." for "others" and "; " between the works of one citation
    ("[Shazeer, 2020; Touvron et al., 2023]", not "[Shazeer, 2020, Touvron et al., 2023]")."""

    person: PersonStyle = field(default_factory=EtAlPersonStyle)
    bracket_parenthetical: BracketStyle = field(default_factory=_semicolons)
    bracket_textual: BracketStyle = field(default_factory=_semicolons)


def setup(app: Any) -> dict:
    pybtex.plugin.register_plugin("pybtex.style.sorting", "letters_author_year_title",
                                  LettersSortingStyle)
    pybtex.plugin.register_plugin("pybtex.style.formatting", "plain_etal", PlainEtAlStyle)
    sphinxcontrib.bibtex.plugin.register_plugin(
        "sphinxcontrib.bibtex.style.referencing", "author_year_etal", AuthorYearEtAlStyle)
    return {"parallel_read_safe": True, "parallel_write_safe": True}

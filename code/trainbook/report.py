"""Plain-text tables for the command line (no pandas needed).

Chapter: book/how-to-use.
"""

from __future__ import annotations


def fmt(value: object) -> str:
    """Integers with thousands separators, floats to 4 significant digits, None as '-'."""
    if value is None:
        return "-"
    if isinstance(value, bool):
        return str(value)
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, float):
        return f"{value:,.4g}" if abs(value) < 1e6 else f"{value:,.0f}"
    return str(value)


def table(rows: list[dict], columns: list[str] | None = None) -> str:
    """Rows of dicts as an aligned text table; numbers right-aligned."""
    if not rows:
        return "(no rows)"
    columns = columns or list(rows[0])
    cells = [[fmt(r.get(c)) for c in columns] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(columns)]
    numeric = [all(isinstance(r.get(c), (int, float)) or r.get(c) is None for r in rows)
               for c in columns]

    def line(values):
        return "  ".join(v.rjust(w) if n else v.ljust(w)
                         for v, w, n in zip(values, widths, numeric)).rstrip()

    return "\n".join([line(columns), line(["-" * w for w in widths]), *map(line, cells)])

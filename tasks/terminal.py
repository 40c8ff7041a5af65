"""Tables on a terminal that fit its width: a wide table turns to one small table per row
(field, value) instead of folding its columns to nothing or cutting an id a user copies."""

from __future__ import annotations

from typing import Any


def print_rows(
    console: Any, title: str, rows: list[dict[str, str]], *, whole: tuple[str, ...] = (),
    right: tuple[str, ...] = (), key: str | None = None,
) -> None:  # fmt: skip
    """Print `rows` (same keys, string values) as one table, or, when it would be wider than
    the console, as one field-value table per row, titled by the row's `key` column.

    Args:
        console: a rich Console.
        title: the table's title.
        rows: the rows, each a dict of column to text.
        whole: columns never broken or cut (ids, names, times).
        right: columns aligned right (numbers).
        key: the column that names a row in the narrow layout (None: its position).
    """
    from rich.table import Table

    t = Table(title=title, title_justify="left", title_style="bold")
    for col in rows[0]:
        t.add_column(col, justify="right" if col in right else "left",
                     no_wrap=col in whole, overflow="fold")  # fmt: skip
    for r in rows:
        t.add_row(*r.values())
    natural = console.measure(t, options=console.options.update_width(10_000)).maximum
    if natural <= console.width:
        console.print(t)
        return
    for i, r in enumerate(rows, 1):
        name = f"{key} {r[key]}".strip() if key is not None else str(i)
        f = Table(title=f"{title}: {name}", title_justify="left", title_style="bold")
        f.add_column("field")
        f.add_column("value", overflow="fold")
        for k, v in r.items():
            if k != key:
                f.add_row(k, v)
        console.print(f)

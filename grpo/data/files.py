"""Reading data files into the normalised row schema {id, prompt, answer, [solution], ...}.

JSONL or Parquet; GSM8K and MATH-500 in their published layouts. Every error names the file,
row and field.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from reward_fns.errors import UserError


class DataError(UserError, ValueError):
    """A data file or row is unusable; the message names the file, row and field."""


def read_rows(path: str | Path) -> list[dict[str, Any]]:
    """Rows of a .jsonl/.json-lines or .parquet file."""
    p = Path(path)
    if not p.is_file():
        raise DataError(f"{p}: file not found")
    if p.suffix == ".parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        try:
            return pq.read_table(p).to_pylist()
        except (pa.ArrowException, OSError) as e:
            raise DataError(f"{p}: not a readable Parquet file: {e}") from e
    if p.suffix not in (".jsonl", ".json"):
        raise DataError(f"{p}: unsupported file type {p.suffix!r}; expected .jsonl or .parquet")
    rows = []
    try:
        text = p.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise DataError(f"{p}: not UTF-8 text: {e}") from e
    for n, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(f"{p}: line {n}: not valid JSON: {e.msg}") from e
        except RecursionError as e:
            raise DataError(f"{p}: line {n}: JSON nested too deeply") from e
        if not isinstance(row, dict):
            raise DataError(f"{p}: line {n}: expected a JSON object, got {type(row).__name__}")
        rows.append(row)
    return rows


def normalize(
    rows: list[dict[str, Any]],
    source: str,
    *,
    prompt: str = "prompt",
    answer: str = "answer",
    worked_solution: str | None = None,
    id_column: str | None = "id",
) -> list[dict[str, Any]]:
    """Map raw rows to the schema, checking presence and types; ids are made when absent.

    Other scalar columns pass through (reward functions receive them). `solution` is the gold
    answer unless the file has a `solution` column of its own (the open-r1 convention).
    """
    if not rows:
        raise DataError(f"{source}: no rows")
    out, seen = [], set()
    for i, row in enumerate(rows):
        rec: dict[str, Any] = {}
        fields = (("prompt", prompt), ("answer", answer), ("worked_solution", worked_solution))
        for field, col in fields:
            if col is None:
                continue
            if col not in row:
                raise DataError(f"{source}: row {i}: missing column {col!r} ({field})")
            val = row[col]
            if isinstance(val, float) and not math.isfinite(val):
                raise DataError(
                    f"{source}: row {i}: column {col!r} ({field}) is {val!r}; expected a "
                    "finite number or a non-empty string"
                )
            if isinstance(val, (int, float)) and not isinstance(val, bool) and field == "answer":
                val = str(val)
            if not isinstance(val, str) or not val.strip():
                raise DataError(
                    f"{source}: row {i}: column {col!r} ({field}) must be a non-empty string, "
                    f"got {val!r:.60}"
                )
            if not val.isprintable() and _lone_surrogate(val) is not None:
                # valid JSON ("\ud800") but no UTF-8: every tokenizer fails on it later
                raise DataError(
                    f"{source}: row {i}: column {col!r} ({field}) holds a lone surrogate "
                    f"(\\u{ord(_lone_surrogate(val)):04x}), which is not a character"
                )
            rec[field] = val
        rid = row.get(id_column) if id_column else None
        rid = str(rid) if rid is not None else f"row-{i:06d}"
        if rid in seen:
            raise DataError(f"{source}: row {i}: duplicated id {rid!r}")
        seen.add(rid)
        rec["id"] = rid
        for k, v in row.items():
            if k not in (prompt, answer, worked_solution, id_column) and isinstance(
                v, (str, int, float)
            ):
                rec.setdefault(k, v)
        rec.setdefault("solution", rec["answer"])
        out.append(rec)
    return out


def gsm8k_rows(path: str | Path, with_solution: bool = False) -> list[dict[str, Any]]:
    """GSM8K rows: the final answer after '####'; the worked solution in the template."""
    rows = []
    for i, r in enumerate(read_rows(path)):
        if "question" not in r or "answer" not in r or "####" not in str(r["answer"]):
            raise DataError(f"{path}: row {i}: expected 'question' and an 'answer' with '####'")
        reasoning, final = str(r["answer"]).rsplit("####", 1)
        final = final.strip().replace(",", "")
        row = {"id": f"gsm8k-{i:05d}", "prompt": r["question"], "answer": final, "solution": final}
        if with_solution:
            row["worked_solution"] = f"<think>{reasoning.strip()}</think><answer>{final}</answer>"
        rows.append(row)
    return rows


def math500_rows(path: str | Path) -> list[dict[str, Any]]:
    rows = normalize(read_rows(path), str(path), prompt="problem", id_column="unique_id")
    return rows


def _lone_surrogate(text: str) -> str | None:
    return next((c for c in text if "\ud800" <= c <= "\udfff"), None)

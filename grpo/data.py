"""Datasets in one normalised schema: {id, prompt, answer, [solution], metadata...}.

Training sets come from the config (synthetic, or your JSONL/Parquet files); held-out sets are
named (synthetic, synthetic_ood, gsm8k, math500) or given by path with a column mapping
("path.jsonl:prompt=question,answer=final"). Every error names the file, row and field.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from grpo.config import Config

DATA_DIR = Path(__file__).resolve().parents[1] / "data"
EVAL_SETS = ("synthetic", "synthetic_ood", "gsm8k", "math500")


class DataError(ValueError):
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
    solution: str | None = None,
    id_column: str | None = "id",
) -> list[dict[str, Any]]:
    """Map raw rows to the schema, checking presence and types; ids are made when absent."""
    if not rows:
        raise DataError(f"{source}: no rows")
    out, seen = [], set()
    for i, row in enumerate(rows):
        rec: dict[str, Any] = {}
        for field, col in (("prompt", prompt), ("answer", answer), ("solution", solution)):
            if col is None:
                continue
            if col not in row:
                raise DataError(f"{source}: row {i}: missing column {col!r} ({field})")
            val = row[col]
            if isinstance(val, (int, float)) and not isinstance(val, bool) and field == "answer":
                val = str(val)
            if not isinstance(val, str) or not val.strip():
                raise DataError(
                    f"{source}: row {i}: column {col!r} ({field}) must be a non-empty string, "
                    f"got {val!r:.60}"
                )
            rec[field] = val
        rid = row.get(id_column) if id_column else None
        rid = str(rid) if rid is not None else f"row-{i:06d}"
        if rid in seen:
            raise DataError(f"{source}: row {i}: duplicated id {rid!r}")
        seen.add(rid)
        rec["id"] = rid
        for k, v in row.items():
            if k not in (prompt, answer, solution, id_column) and isinstance(v, (str, int, float)):
                rec.setdefault(k, v)
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
        row = {"id": f"gsm8k-{i:05d}", "prompt": r["question"], "answer": final}
        if with_solution:
            row["solution"] = f"<think>{reasoning.strip()}</think><answer>{final}</answer>"
        rows.append(row)
    return rows


def math500_rows(path: str | Path) -> list[dict[str, Any]]:
    rows = normalize(read_rows(path), str(path), prompt="problem", id_column="unique_id")
    return rows


def training_sets(cfg: Config) -> dict[str, list[dict[str, Any]]]:
    """sft, sft_val and train rows for the configured task."""
    d = cfg.data
    if d.task == "synthetic":
        from grpo.synthetic import make_sets

        sets = make_sets(d)
        return {k: sets[k] for k in ("sft", "sft_val", "train")}
    train = _load_file(d.train_path, cfg, solution=False)
    out = {"train": train}
    if d.sft_path:
        sft = _load_file(d.sft_path, cfg, solution=True)
        cut = max(1, len(sft) // 10)  # hold back 10% of worked solutions for early stopping
        out["sft"], out["sft_val"] = sft[cut:], sft[:cut]
    return out


def _load_file(path: str | None, cfg: Config, solution: bool) -> list[dict[str, Any]]:
    assert path is not None
    if cfg.data.gsm8k_solutions:
        return gsm8k_rows(path, with_solution=solution)
    return normalize(
        read_rows(path),
        path,
        prompt=cfg.data.prompt_column,
        answer=cfg.data.answer_column,
        solution=cfg.data.solution_column if solution else None,
    )


def eval_set(name: str, cfg: Config) -> list[dict[str, Any]]:
    """A held-out set by name, or 'path[:prompt=col,answer=col,id=col]'."""
    if name in ("synthetic", "synthetic_ood"):
        from grpo.synthetic import make_sets

        sets = make_sets(cfg.data)
        return sets["heldout" if name == "synthetic" else "heldout_ood"]
    if name == "gsm8k":
        return gsm8k_rows(DATA_DIR / "gsm8k" / "test.jsonl")
    if name == "math500":
        return math500_rows(DATA_DIR / "math500" / "test.jsonl")
    path, _, mapping = name.partition(":")
    if not Path(path).suffix:
        raise DataError(f"unknown eval set {name!r}; use one of {EVAL_SETS} or a file path")
    cols = {"prompt": "prompt", "answer": "answer", "id": "id"}
    for item in filter(None, mapping.split(",")):
        key, _, col = item.partition("=")
        if key not in cols or not col:
            raise DataError(f"{name}: bad column mapping {item!r}; use prompt=,answer=,id=")
        cols[key] = col
    return normalize(
        read_rows(path), path, prompt=cols["prompt"], answer=cols["answer"], id_column=cols["id"]
    )

"""The datasets of a config: training sets (synthetic, or your files) and held-out sets by name.

Held-out sets are named (synthetic, synthetic_ood, gsm8k, math500, or rg:<generator> for a
reasoning-gym generator) or given by path with a column mapping
("path.jsonl:prompt=question,answer=final").
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from grpo.config import Config
from grpo.data.files import DataError, gsm8k_rows, math500_rows, normalize, read_rows

EVAL_SETS = ("synthetic", "synthetic_ood", "gsm8k", "math500")


def data_dir() -> Path:
    """Where the named sets gsm8k and math500 are read: $GRPO_DATA_DIR, else the data/ folder of
    the source tree (a clone or an editable install; a wheel does not ship the data)."""
    env = os.environ.get("GRPO_DATA_DIR")
    path = Path(env) if env else Path(__file__).resolve().parents[2] / "data"
    if not path.is_dir():
        raise DataError(
            f"{path}: data folder not found; the named sets gsm8k and math500 read it. Set "
            "GRPO_DATA_DIR to a copy of the project's data/ folder, or give a file path"
        )
    return path


def training_sets(cfg: Config) -> dict[str, list[dict[str, Any]]]:
    """sft, sft_val, train and select rows for the configured task (select: the synthetic
    task's selection split, empty unless data.num_select)."""
    d = cfg.data
    if d.task == "synthetic":
        from grpo.data.synthetic import make_sets

        sets = make_sets(d)
        return {k: sets[k] for k in ("sft", "sft_val", "train", "select")}
    if d.task == "reasoning_gym":
        from grpo.data import reasoning_gym

        sets = reasoning_gym.make_sets(d)
        return {k: sets[k] for k in ("sft", "sft_val", "train", "select")}
    train = _load_file(d.train_path, cfg, solution=False)
    out = {"train": train, "select": []}
    if d.sft_path:
        sft = _load_file(d.sft_path, cfg, solution=True)
        cut = max(1, len(sft) // 10)  # hold back 10% of worked solutions for early stopping
        out["sft"], out["sft_val"] = sft[cut:], sft[:cut]
    return out


def _load_file(path: str, cfg: Config, solution: bool) -> list[dict[str, Any]]:
    if cfg.data.gsm8k_solutions:
        return gsm8k_rows(path, with_solution=solution)
    return normalize(
        read_rows(path),
        path,
        prompt=cfg.data.prompt_column,
        answer=cfg.data.answer_column,
        worked_solution=cfg.data.worked_solution_column if solution else None,
    )


NAMED_FILES = {"gsm8k": "gsm8k/test.jsonl", "math500": "math500/test.jsonl"}


def eval_set_file(name: str) -> Path | None:
    """The file an eval set is read from; None for the generated sets (synthetic, rg:)."""
    if name in ("synthetic", "synthetic_ood") or name.startswith("rg:"):
        return None
    if name in NAMED_FILES:
        return data_dir() / NAMED_FILES[name]
    return Path(name.partition(":")[0])


def eval_set(name: str, cfg: Config) -> list[dict[str, Any]]:
    """A held-out set by name, or 'path[:prompt=col,answer=col,id=col]'."""
    if name in ("synthetic", "synthetic_ood"):
        from grpo.data.synthetic import make_sets

        sets = make_sets(cfg.data)
        return sets["heldout" if name == "synthetic" else "heldout_ood"]
    if name.startswith("rg:"):
        from grpo.data import reasoning_gym

        return reasoning_gym.eval_rows(name, cfg.data)
    if name == "gsm8k":
        return gsm8k_rows(eval_set_file(name))
    if name == "math500":
        return math500_rows(eval_set_file(name))
    path, _, mapping = name.partition(":")
    if not Path(path).suffix:
        raise DataError(
            f"unknown eval set {name!r}; use one of {EVAL_SETS}, rg:<reasoning-gym generator> "
            "or a file path"
        )
    cols = {"prompt": "prompt", "answer": "answer", "id": "id"}
    for item in filter(None, mapping.split(",")):
        key, _, col = item.partition("=")
        if key not in cols or not col:
            raise DataError(f"{name}: bad column mapping {item!r}; use prompt=,answer=,id=")
        cols[key] = col
    return normalize(
        read_rows(path), path, prompt=cols["prompt"], answer=cols["answer"], id_column=cols["id"]
    )


def check_gold_answers(rows: list[dict[str, Any]], source: str) -> None:
    """Every gold answer of a held-out file is math: a number or LaTeX (math-verify parses a
    word such as "blue" too, as the product of four symbols, which no completion of a math
    model writes), so a file of word answers does not read 0.000 accuracy without a word."""
    from reward_fns import gold_parses

    def is_math(a: str) -> bool:
        return any(c.isdigit() or c == "\\" for c in a) and gold_parses(a)

    bad = [(i, r["answer"]) for i, r in enumerate(rows) if not is_math(r["answer"])]
    if bad:
        shown = "; ".join(f"row {i}: {a!r:.40}" for i, a in bad[:3])
        raise DataError(
            f"{source}: {len(bad)} of {len(rows)} gold answers are not math answers ({shown}): "
            "every completion would score 0 against them"
        )

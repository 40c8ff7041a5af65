"""Users' own data: Parquet and JSONL files, their own column names, GRPO_DATA_DIR."""

import json
from pathlib import Path

import pytest

from grpo.config import load_config
from grpo.data.files import DataError
from grpo.data.sets import eval_set, training_sets

ROOT = Path(__file__).resolve().parents[2]
ROWS = [{"q": f"{i}+{i}=", "gold": str(2 * i),
         "steps": f"<think>{i}+{i}={2 * i}</think><answer>{2 * i}</answer>",
         "uid": f"u{i}", "level": i % 3} for i in range(20)]  # fmt: skip


def _write(path: Path, rows: list[dict]) -> Path:
    if path.suffix == ".parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(rows), path)
    else:
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.mark.parametrize("suffix", [".parquet", ".jsonl"])
def test_training_files_with_their_own_column_names(tmp_path, suffix):
    f = _write(tmp_path / f"train{suffix}", ROWS)
    cfg = load_config(None, ["data.task=files", f"data.train_path={f}", f"data.sft_path={f}",
                             "data.prompt_column=q", "data.answer_column=gold",
                             "data.worked_solution_column=steps"])  # fmt: skip
    sets = training_sets(cfg)
    assert [r["prompt"] for r in sets["train"]] == [r["q"] for r in ROWS]
    assert [r["answer"] for r in sets["train"]] == [r["gold"] for r in ROWS]
    assert sets["train"][3]["level"] == 0  # other scalar columns reach the reward functions
    # 10% of the worked solutions held back for SFT's early stop, the rest trained on
    assert len(sets["sft_val"]) == 2 and len(sets["sft"]) == 18
    assert sets["sft"][0]["worked_solution"] == ROWS[2]["steps"]
    # an eval file maps its columns in its name
    held = eval_set(f"{f}:prompt=q,answer=gold,id=uid", cfg)
    assert [(r["id"], r["answer"]) for r in held[:2]] == [("u0", "0"), ("u1", "2")]


def test_a_missing_column_is_named_with_its_file_and_row(tmp_path):
    rows = [dict(r) for r in ROWS]
    del rows[4]["gold"]
    f = _write(tmp_path / "train.parquet", rows)
    cfg = load_config(None, ["data.task=files", f"data.train_path={f}", "data.prompt_column=q",
                             "data.answer_column=gold"])  # fmt: skip
    with pytest.raises(DataError, match=r"train.parquet: row 4: .*'gold'"):
        training_sets(cfg)


def test_named_sets_are_read_from_grpo_data_dir(tmp_path, monkeypatch):
    copy = tmp_path / "data"
    (copy / "gsm8k").mkdir(parents=True)
    lines = (ROOT / "data/gsm8k/test.jsonl").read_text().splitlines()[:3]
    (copy / "gsm8k" / "test.jsonl").write_text("\n".join(lines) + "\n")
    monkeypatch.setenv("GRPO_DATA_DIR", str(copy))
    cfg = load_config(None, [])
    assert [r["prompt"] for r in eval_set("gsm8k", cfg)] == [
        json.loads(x)["question"] for x in lines
    ]
    monkeypatch.setenv("GRPO_DATA_DIR", str(tmp_path / "nowhere"))
    with pytest.raises(DataError, match="nowhere: data folder not found.*GRPO_DATA_DIR"):
        eval_set("gsm8k", cfg)


def test_rows_no_tokenizer_or_grader_could_use_are_named(tmp_path):
    """A lone surrogate (valid JSON, no character) would end in a tokenizer traceback, a NaN
    answer would be taken as the text "nan", and a held-out file of non-math answers would
    score 0.000 without a word: each is named instead."""
    from grpo.data.files import normalize
    from grpo.data.sets import check_gold_answers

    with pytest.raises(DataError, match=r"f.jsonl: row 1: column 'prompt' .*lone surrogate"):
        normalize([{"prompt": "1+1=", "answer": "2"}, {"prompt": "a\ud800", "answer": "2"}],
                  "f.jsonl")  # fmt: skip
    with pytest.raises(DataError, match=r"row 0: column 'answer' \(answer\) is nan"):
        normalize([{"prompt": "1+1=", "answer": float("nan")}], "f.jsonl")
    rows = normalize([{"prompt": "p", "answer": a} for a in ("2", "\\frac{1}{2}", "blue", 7)],
                     "f.jsonl")  # fmt: skip
    with pytest.raises(
        DataError, match=r"1 of 4 gold answers are not math answers \(row 2: 'blue'"
    ):
        check_gold_answers(rows, "f.jsonl")
    check_gold_answers([r for r in rows if r["answer"] != "blue"], "f.jsonl")

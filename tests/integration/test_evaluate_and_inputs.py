"""Evaluation with the real tiny model; bad input is refused with errors naming it."""

import json
import subprocess
import sys

import pytest

from grpo.data.files import DataError, read_rows
from grpo.data.sets import eval_set
from grpo.eval.metrics import summarize
from grpo.eval.run import evaluate_model
from grpo.launch.paths import base_model_dir
from tests.helpers import ROOT, small_config

pytestmark = pytest.mark.slow


def test_report_numbers_equal_a_recomputation_from_the_samples_file(tmp_path):
    cfg = small_config(tmp_path)
    model = base_model_dir(cfg)
    report = evaluate_model(
        cfg, str(model), ["synthetic", "gsm8k"], str(tmp_path / "ev"), samples=4, limit=10,
        progress=False,
    )  # fmt: skip
    lines = (tmp_path / "ev" / "samples.jsonl").read_text().splitlines()
    recs = [json.loads(x) for x in lines]
    assert len(recs) == 2 * 10 * 4
    for name in ("synthetic", "gsm8k"):
        again = summarize([r for r in recs if r["set"] == name])
        for k, v in report["sets"][name].items():
            if isinstance(v, float):
                assert again[k] == pytest.approx(v), (name, k)
    assert (tmp_path / "ev" / "report.md").read_text().count("|") > 10
    # deterministic for a fixed seed
    again = evaluate_model(
        cfg, str(model), ["synthetic"], str(tmp_path / "ev2"), samples=4, limit=10,
        progress=False,
    )  # fmt: skip
    assert again["sets"]["synthetic"] == report["sets"]["synthetic"]


def test_math500_has_subject_and_level_breakdown(tmp_path):
    # MATH-500 in the tiny model's characters: longer than the default 512
    cfg = small_config(tmp_path, "eval.max_new_tokens=8", "grpo.max_prompt_length=4096")
    rep = evaluate_model(
        cfg, str(base_model_dir(cfg)), ["math500"], str(tmp_path / "m"), limit=12, progress=False
    )
    assert rep["sets"]["math500"]["by_subject"] and rep["sets"]["math500"]["by_level"]


def test_bad_set_paths_and_columns_are_named(tmp_path):
    cfg = small_config(tmp_path)
    with pytest.raises(DataError, match="nope.jsonl: file not found"):
        eval_set(str(tmp_path / "nope.jsonl"), cfg)
    f = tmp_path / "set.jsonl"
    f.write_text('{"question": "1+1", "final": "2"}\n{"question": "2+2"}\n')
    with pytest.raises(DataError, match=r"row 0: missing column 'prompt'"):
        eval_set(str(f), cfg)
    with pytest.raises(DataError, match=r"row 1: missing column 'final'"):
        eval_set(f"{f}:prompt=question,answer=final", cfg)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "1", "answer": "1"}\n{"prompt": \n')
    with pytest.raises(DataError, match="bad.jsonl: line 2: not valid JSON"):
        read_rows(bad)
    dup = tmp_path / "dup.jsonl"
    dup.write_text(
        '{"id": 1, "prompt": "a", "answer": "1"}\n{"id": 1, "prompt": "b", "answer": "2"}\n'
    )
    with pytest.raises(DataError, match="row 1: duplicated id '1'"):
        eval_set(str(dup), cfg)


def test_cli_refuses_a_broken_config_naming_the_field(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "flows.cli", "sft", "--set", "grpo.lr=-1", "--set", "sft.bogus=1",
         "--set", "deepspeed.nproc=3"],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 2
    assert "grpo.lr: Input should be greater than 0" in out.stderr
    assert "sft.bogus: unknown key" in out.stderr


def test_model_directory_without_tokenizer_is_refused(tmp_path):
    from grpo.models.loading import ModelDirError, load_tokenizer

    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text("{}")
    with pytest.raises(ModelDirError, match="no tokenizer"):
        load_tokenizer(tmp_path / "m")


def test_cli_evaluate_on_gsm8k(tmp_path):
    cfg = small_config(tmp_path)
    model = base_model_dir(cfg)
    out = subprocess.run(
        [sys.executable, "-m", "flows.cli", "evaluate", "--model", str(model), "--sets", "gsm8k",
         "--limit", "50", "--out", str(tmp_path / "e"), "--baseline", str(model),
         "--set", "grpo.max_prompt_length=1024"],  # GSM8K in characters: up to 848
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    assert "| gsm8k | 50 |" in out.stdout
    assert "gsm8k            +0.000 [+0.000, +0.000]" in out.stdout  # a model against itself

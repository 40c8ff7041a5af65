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
from tests.helpers import ROOT, perturbed_model, small_config

pytestmark = pytest.mark.slow


def test_report_numbers_equal_a_recomputation_from_the_samples_file(tmp_path):
    cfg = small_config(tmp_path, "model.tiny.max_position_embeddings=1024")  # GSM8K fits
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
        assert report["sets"][name]["left_out"] == 0.0
        for k, v in report["sets"][name].items():
            if isinstance(v, float) and k != "left_out":
                assert again[k] == pytest.approx(v), (name, k)
    assert (tmp_path / "ev" / "report.md").read_text().count("|") > 10
    # deterministic for a fixed seed
    again = evaluate_model(
        cfg, str(model), ["synthetic"], str(tmp_path / "ev2"), samples=4, limit=10,
        progress=False,
    )  # fmt: skip
    assert again["sets"]["synthetic"] == report["sets"]["synthetic"]


def test_math500_has_subject_and_level_breakdown(tmp_path):
    # MATH-500 in the tiny model's characters: a context of 4096 positions holds them
    cfg = small_config(tmp_path, "eval.max_new_tokens=8", "model.tiny.max_position_embeddings=4096")
    rep = evaluate_model(
        cfg, str(base_model_dir(cfg)), ["math500"], str(tmp_path / "m"), limit=12, progress=False
    )
    m = rep["sets"]["math500"]
    recs = [json.loads(x) for x in (tmp_path / "m" / "samples.jsonl").open()]
    assert len(recs) == 12
    # the groups are the problems' own subjects and levels (as the data file has them), and
    # each group's accuracy is its problems' share answered correctly
    rows = [json.loads(x) for x in (ROOT / "data/math500/test.jsonl").open()]
    by_id = {r["unique_id"]: r for r in rows}
    for key in ("subject", "level"):
        assert set(m[f"by_{key}"]) == {str(by_id[r["id"]][key]) for r in recs}
        for group, acc in m[f"by_{key}"].items():
            mine = [r["correct"] for r in recs if str(r[key]) == group]
            assert acc == pytest.approx(sum(mine) / len(mine)), (key, group)


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
        [sys.executable, "-m", "cli.main", "sft", "--set", "grpo.lr=-1", "--set", "sft.bogus=1",
         "--set", "deepspeed.nproc=3"],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 2
    assert "grpo.lr: Input should be greater than 0" in out.stderr
    assert "sft.bogus: unknown key" in out.stderr
    assert "Traceback" not in out.stderr and out.stderr.startswith("error: ")
    # --debug: the same error with its traceback, raised (exit 1), for a bug report
    debug = subprocess.run(
        [sys.executable, "-m", "cli.main", "--debug", "sft", "--set", "grpo.lr=-1"],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert debug.returncode == 1
    assert "Traceback (most recent call last)" in debug.stderr
    assert "grpo.config.ConfigError: invalid config" in debug.stderr


def test_model_directory_without_tokenizer_is_refused(tmp_path):
    from grpo.models.loading import ModelDirError, load_tokenizer

    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text("{}")
    with pytest.raises(ModelDirError, match="no tokenizer"):
        load_tokenizer(tmp_path / "m")


def test_cli_evaluate_on_gsm8k(tmp_path):
    import json

    # GSM8K in characters: up to 848 tokens, which a context of 1024 holds
    cfg = small_config(tmp_path, "model.tiny.max_position_embeddings=1024")
    model = base_model_dir(cfg)
    other = perturbed_model(model, tmp_path / "other")
    out = subprocess.run(
        [sys.executable, "-m", "cli.main", "evaluate", "--model", str(model), "--sets", "gsm8k",
         "--limit", "50", "--out", str(tmp_path / "e"), "--baseline", str(other)],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    assert "| gsm8k | 50 |" in out.stdout and "left out" not in out.stderr
    mine, theirs = (
        [json.loads(x) for x in (tmp_path / d / "samples.jsonl").open()]
        for d in ("e", "e_baseline")
    )
    # the baseline is the other model, on the same problems in the same order
    assert json.loads((tmp_path / "e_baseline" / "report.json").read_text())["model"] == str(other)
    assert [r["id"] for r in mine] == [r["id"] for r in theirs] and len(mine) == 50
    assert sum(a["completion"] != b["completion"] for a, b in zip(mine, theirs)) > 25
    # the paired line: neither untrained model solves a GSM8K problem, so 0 with no spread
    diff = sum(a["correct"] for a in mine) - sum(b["correct"] for b in theirs)
    assert diff == 0 and "gsm8k            +0.000 [+0.000, +0.000]" in out.stdout
    # both models' own tables are printed, and the report holds the baseline's numbers beside
    # the model's and the paired difference
    assert out.stdout.count("| gsm8k | 50 |") == 2 and f"Model: `{other}`" in out.stdout
    assert out.stdout.index(f"Model: `{other}`") < out.stdout.index("paired 95% CI")
    report = json.loads((tmp_path / "e" / "report.json").read_text())
    assert report["model"] == str(model) and report["baseline"]["model"] == str(other)
    base = report["baseline"]["sets"]["gsm8k"]
    assert base["num_problems"] == 50
    assert base["accuracy"] == sum(b["correct"] for b in theirs) / 50
    assert report["paired_vs_baseline"]["gsm8k"]["strict"]["n"] == 50


def test_prompts_longer_than_evaluation_holds_are_left_out_and_reported(tmp_path):
    """The tiny model holds 256 positions, less the new tokens for the prompt.
    GSM8K's longer problems (in characters) are left out by id and counted, never dropped
    silently; training prompts keep grpo.max_prompt_length."""
    import io
    from contextlib import redirect_stderr

    from grpo.models.prompts import eval_prompt_limit, model_context

    cfg = small_config(tmp_path)
    model = base_model_dir(cfg)
    limit = 256 - (cfg.eval.max_new_tokens or cfg.grpo.max_completion_length)
    assert eval_prompt_limit(cfg, model_context(model)) == limit
    err = io.StringIO()
    with redirect_stderr(err):
        rep = evaluate_model(cfg, str(model), ["gsm8k"], str(tmp_path / "e"), limit=40,
                             progress=False)  # fmt: skip
    m = rep["sets"]["gsm8k"]
    assert m["left_out"] > 0 and m["num_problems"] + m["left_out"] == 40
    assert len(m["left_out_ids"]) == m["left_out"]
    assert (
        f"gsm8k: {int(m['left_out'])} of 40 prompts are longer than the {limit} tokens"
        in err.getvalue()
    )
    assert m["left_out_ids"][0] in err.getvalue()


def test_two_models_called_policy_get_their_own_report_directory(tmp_path):
    """Every GRPO run's model is `.../policy`: named by the base name alone, the second
    evaluation overwrote the first's report.json."""
    from grpo.eval.run import default_report_dir

    cfg = small_config(tmp_path)
    a, b = tmp_path / "run1" / "policy", tmp_path / "run2" / "policy"
    assert default_report_dir(cfg, a) != default_report_dir(cfg, b)
    assert default_report_dir(cfg, a).name.startswith("policy-")
    assert default_report_dir(cfg, a) == default_report_dir(cfg, tmp_path / "run2/../run1/policy")


def test_token_counts_of_the_fast_path_equal_the_tokenizers_own(tmp_path):
    """Validation counts prompt tokens with the Rust tokenizer alone (twice as fast on a
    million rows): the counts must be transformers' own (the chat template is rendered into
    the text before either counts)."""
    from grpo.models.loading import load_tokenizer
    from grpo.models.prompts import prompt_token_counts, render_prompt

    prompts = ["12+34=", "What is 7 * 8?  Think.", "x" * 300, "é ü 😀"]
    cfg = small_config(tmp_path)
    tok = load_tokenizer(base_model_dir(cfg))
    assert tok.backend_tokenizer is not None  # the fast path is the one taken
    own = [len(tok(render_prompt(tok, p, cfg), add_special_tokens=False)["input_ids"])
           for p in prompts]  # fmt: skip
    assert prompt_token_counts(tok, cfg, prompts) == own
    assert own[2] >= 300  # one token per character in the tiny model

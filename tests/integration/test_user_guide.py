"""docs/USER_GUIDE.md's own-data and own-reward recipe, as written: the files its heredocs
write, checked by the pipeline's own checks (preflight, the data files, Great Expectations'
validation) and its reward function called as the trainer calls it. The commands themselves are
parsed by tests/unit/test_docs_commands.py; the files task trains end to end in
tests/integration/test_real_model_path.py."""

import re
import sys

import pytest

from tests.helpers import ROOT

pytestmark = pytest.mark.slow

GUIDE = ROOT / "docs" / "USER_GUIDE.md"


def _write_heredocs(where) -> list[str]:  # noqa: ANN001
    written = []
    for path, body in re.findall(r"cat > (\S+) <<'EOF'\n(.*?)\nEOF\n", GUIDE.read_text(), re.S):
        (where / path).parent.mkdir(parents=True, exist_ok=True)
        (where / path).write_text(body + "\n")
        written.append(path)
    return written


def test_the_guides_data_config_and_reward_pass_the_pipelines_checks(tmp_path, monkeypatch):
    from grpo.config import load_config
    from grpo.data.sets import eval_set, training_sets
    from grpo.launch.preflight import preflight
    from reward_fns import resolve
    from tasks.validation import validate_datasets

    written = _write_heredocs(tmp_path)
    assert set(written) == {"my_data/train.jsonl", "my_data/sft.jsonl", "my_data/test.jsonl",
                            "configs/my.yaml", "my_rewards.py"}  # fmt: skip
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))  # the guide's PYTHONPATH=.
    cfg = load_config("configs/my.yaml", [f"output_dir={tmp_path / 'runs'}"])
    assert cfg.data.task == "files" and cfg.grpo.reward_funcs[0] == "my_rewards:exact_answer"
    preflight(cfg)  # the rewards import, the files parse, the model fits
    sets = training_sets(cfg)
    assert (len(sets["train"]), len(sets["sft"]), len(sets["sft_val"])) == (4, 7, 1)
    validate_datasets(cfg, tmp_path / "docs")  # raises on any failed expectation
    # the reward as the trainer calls it: keyword arguments, dataset columns as lists
    fn = resolve("my_rewards:exact_answer", max_completion_length=64, overlong_cache=0)
    rows = eval_set("my_data/test.jsonl", cfg)
    answers = [r["answer"] for r in rows]
    got = fn(completions=["<think>9 x 9</think><answer>81</answer>", "<answer>99</answer>"],
             prompts=[r["prompt"] for r in rows], answer=answers, solution=answers,
             id=[r["id"] for r in rows])  # fmt: skip
    assert got == [1.0, 0.0]


def test_a_guide_reward_that_cannot_be_imported_stops_before_anything_runs(tmp_path,
                                                                          monkeypatch):  # fmt: skip
    from grpo.config import load_config
    from grpo.launch.preflight import PreflightError, preflight

    _write_heredocs(tmp_path)
    monkeypatch.chdir(tmp_path)  # without PYTHONPATH=. the module is not importable
    monkeypatch.delitem(sys.modules, "my_rewards", raising=False)
    cfg = load_config("configs/my.yaml", [f"output_dir={tmp_path / 'runs'}"])
    with pytest.raises(PreflightError, match="my_rewards.*PYTHONPATH"):
        preflight(cfg)

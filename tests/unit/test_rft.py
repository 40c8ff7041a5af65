"""RFT's rules by hand: what it keeps, how many completions it may sample, which prompts each
round takes, and a whole two-round run on the tiny model that keeps only what the verifier
marked correct."""

import json

import pytest

from grpo.config import ConfigError, load_config
from grpo.data.order import prompt_indices
from grpo.engine.rft import completion_budget, keep_correct, round_plan


def test_only_distinct_correct_completions_are_kept_at_most_m_a_prompt():
    recs = [
        {"id": "p1", "completion": "<answer>5</answer>", "correct": True},
        {"id": "p1", "completion": "<answer>5</answer>", "correct": True},  # a repeat
        {"id": "p1", "completion": "<answer>6</answer>", "correct": False},
        {"id": "p1", "completion": "2+3=5 <answer>5</answer>", "correct": True},
        {"id": "p1", "completion": "so <answer>5</answer>", "correct": True},  # over m = 2
        {"id": "p2", "completion": "<answer>5</answer>", "correct": True},  # same text, other id
        {"id": "p3", "completion": "<answer>1</answer>", "correct": False},
    ]
    kept = keep_correct(recs, 2)
    assert [(r["id"], r["completion"]) for r in kept] == [
        ("p1", "<answer>5</answer>"), ("p1", "2+3=5 <answer>5</answer>"),
        ("p2", "<answer>5</answer>")]  # fmt: skip
    assert all(r["correct"] for r in kept)


def test_the_budget_is_grpos_sampled_completions():
    cfg = load_config(None, ["grpo.steps=5", "grpo.prompts_per_step=4", "grpo.num_generations=8"])
    assert completion_budget(cfg) == 5 * 4 * 8
    # dynamic sampling drew 1, 2 and 3 rounds of 4 x 8 at its three steps
    assert completion_budget(cfg, [32.0, 64.0, 96.0]) == 192


def test_each_round_takes_the_next_prompts_of_grpos_own_stream():
    cfg = load_config(None, ["grpo.steps=6", "grpo.prompts_per_step=4", "grpo.num_generations=4",
                             "rft.enabled=true", "rft.rounds=3"])  # fmt: skip
    plan = round_plan(cfg, completion_budget(cfg), 50)
    # 96 completions / (3 rounds x 4 samples) = 8 prompts a round: GRPO's steps 0-5 in order
    grpo_stream = [i for s in range(6) for i in prompt_indices(s, 0, 4, 1, 50, cfg.seed)]
    assert plan == [grpo_stream[0:8], grpo_stream[8:16], grpo_stream[16:24]]
    with pytest.raises(ValueError, match="less than one prompt a round"):
        round_plan(cfg, 10, 50)


def test_rft_settings_need_rft_on_and_method_rft_is_rft_alone():
    with pytest.raises(ConfigError, match="rft.rounds is set but would be ignored"):
        load_config(None, ["rft.rounds=3"])
    with pytest.raises(ConfigError, match="remove rft.enabled"):
        load_config(None, ["method=rft", "rft.enabled=true"])
    assert load_config(None, ["method=rft", "rft.rounds=3"]).rft.rounds == 3


@pytest.mark.slow
def test_two_rounds_keep_only_what_the_verifier_marked_correct(tmp_path):
    """Two rounds on 1-digit sums from a tiny model fine-tuned briefly on worked solutions (so
    that some samples are right): every kept completion is one the verifier (math-verify on the
    extracted answer) marks correct, the rounds sample exactly the budget and fine-tune on what
    they kept, and the selected round is the selection rule's."""
    from grpo.data.sets import training_sets
    from grpo.engine.rft import train_rft
    from grpo.engine.sft import train_fixed_steps
    from grpo.launch.paths import base_model_dir
    from reward_fns import is_correct
    from tests.helpers import small_config

    cfg = small_config(tmp_path, "rft.enabled=true", "rft.rounds=2", "data.num_select=4",
                       "grpo.eval_every=1", "grpo.num_generations=8", "grpo.prompts_per_step=4",
                       "data.max_digits=1", "data.ood_digits=2", "data.num_sft=20",
                       "data.num_sft_val=8", "data.num_train=12", "data.num_heldout=4",
                       "data.num_heldout_ood=4", "sft.batch_size=8")  # fmt: skip
    sets = training_sets(cfg)
    start = tmp_path / "start"
    train_fixed_steps(cfg, base_model_dir(cfg), start, sets, 400, lr=3e-3, progress=False)
    summary = train_rft(cfg, start, tmp_path / "rft", sets, budget=64, progress=False)
    rounds = [json.loads(x) for x in (tmp_path / "rft_metrics.jsonl").open()]
    assert [r["round"] for r in rounds] == [0, 1, 2]
    assert sum(r.get("sampled", 0) for r in rounds) == summary["sampled"] == 64
    assert all(r["kept"] <= r["correct"] for r in rounds[1:])
    curve = [(r["round"], r["select_accuracy"]) for r in rounds]
    best = max(a for _, a in curve)
    assert summary["selection"]["selected_step"] == min(s for s, a in curve if a == best)
    assert (tmp_path / "rft" / "config.json").is_file()
    assert (tmp_path / "rft_last" / "config.json").is_file()
    # every sampled completion's verdict is the verifier's, and only correct ones were kept
    for i in (1, 2):
        sampled = [
            json.loads(x) for x in (tmp_path / "rft_rounds" / f"round-{i}_samples.jsonl").open()
        ]
        kept = [json.loads(x) for x in (tmp_path / "rft_rounds" / f"round-{i}_kept.jsonl").open()]
        assert len(sampled) == 32 and len({s["id"] for s in sampled}) == 4  # 4 prompts x 8
        assert all(s["correct"] == is_correct(s["completion"], s["gold"]) for s in sampled)
        assert all(is_correct(k["completion"], k["gold"]) for k in kept)
        assert len(kept) == rounds[i]["kept"] <= rounds[i]["correct"]
    # the model sampled right answers, and the rounds trained on them
    assert rounds[1]["kept"] > 0 and rounds[1]["sft_steps"] > 0

"""TRL users' code in our trainer: reward functions from TRL's docs and TRL itself, unchanged,
on plain and chat-format prompts; a TRL-named config; dynamic sampling's early stop; the clamp
and sampler-vs-trainer metrics in metrics.jsonl."""

import json

import pytest

from grpo.launch.paths import base_model_dir
from tests.helpers import ROOT, small_config
from tests.realistic_model import build_realistic_model

pytestmark = pytest.mark.slow
DOC = "tests.trl_doc_rewards"


def _lines(path):
    return [json.loads(x) for x in path.open()]


def _train(cfg, policy, out):
    from grpo.engine.loop import Trainer

    result = Trainer(cfg, policy, out).train(progress=False)
    return result, _lines(out / "metrics.jsonl")


def test_trl_doc_functions_get_trls_arguments_on_plain_prompts(tmp_path):
    from tests import trl_doc_rewards

    trl_doc_rewards.SEEN.clear()
    cfg = small_config(
        tmp_path,
        f"grpo.reward_funcs=[{DOC}:reward_len, {DOC}:soft_overlong, {DOC}:uses_everything]",
        "grpo.reward_weights=[0.1, 1.0, 1.0]", "grpo.log_completions_every=1", "grpo.mu=2",
    )  # fmt: skip
    _, metrics = _train(cfg, base_model_dir(cfg), tmp_path / "grpo")
    assert [m["step"] for m in metrics] == [1, 2]
    seen = trl_doc_rewards.SEEN
    assert [s["step"] for s in seen] == [0, 1] and seen[0]["max_steps"] == 2
    first = seen[0]
    n = len(first["completions"])  # 2 prompts x 4 completions
    assert n == 8 and all(isinstance(c, str) for c in first["completions"])
    assert first["prompts"][0] == first["prompts"][3] and "+" in first["prompts"][0]
    assert first["solution"][0].isdigit()  # the gold answer, open-r1's column
    assert "worked_solution" not in first["columns"] and "answer" in first["columns"]
    assert all(isinstance(i, int) for i in first["ids"][0])
    # the soft overlong punishment from TRL, and the doc's length reward, were scored
    # an untrained model runs long: past 24 - 8 = 16 tokens the penalty is below 0
    assert -1.0 <= metrics[0]["rewards/soft_overlong/mean"] < 0
    assert metrics[0]["completions/max_length"] > 16
    for call, m in zip(seen, metrics, strict=True):  # the doc's reward, recomputed
        lens = [-abs(20 - len(c)) for c in call["completions"]]
        assert m["rewards/reward_len/mean"] == pytest.approx(sum(lens) / len(lens))
    # log_metric and log_extra reach metrics.jsonl and completions.jsonl
    assert [m["my_metric"] for m in metrics] == [0.5, 1.5]
    samples = _lines(tmp_path / "grpo" / "completions.jsonl")
    assert all(s["n_chars"] == len(s["completion"]) for s in samples)
    # the clamp and sampler-vs-trainer metrics, every step
    for m in metrics:
        assert m["clamp/log_ratio_frac"] == 0.0
        assert m["logprob_gap/mean"] <= m["logprob_gap/max"] < 1e-3  # fp32, same weights
        # TRL's names for the same measures
        assert m["sampling/sampling_logp_difference/max"] == m["logprob_gap/max"]


def test_trls_own_rewards_on_chat_format_prompts(tmp_path):
    """accuracy_reward and think_format_reward read completion[0]["content"]: with the chat
    template on, completions and prompts come in TRL's conversational form."""
    from tests import trl_doc_rewards

    trl_doc_rewards.SEEN.clear()
    model = build_realistic_model(tmp_path / "model")
    cfg = small_config(
        tmp_path, f"model.path={model}", "model.chat_template=true", "sft.enabled=false",
        "data.task=files", f"data.train_path={ROOT / 'data/gsm8k/train.jsonl'}",
        "data.gsm8k_solutions=true", "grpo.max_prompt_length=1500",
        "grpo.reward_funcs=[trl.rewards:accuracy_reward, trl.rewards:think_format_reward, "
        f"{DOC}:format_reward_func, {DOC}:uses_everything]",
        "grpo.reward_weights=[1.0, 0.5, 0.5, 1.0]", "grpo.max_completion_length=12",
    )  # fmt: skip
    _, metrics = _train(cfg, model, tmp_path / "grpo")
    assert [m["step"] for m in metrics] == [1, 2]
    # each logged mean is TRL's function recomputed on what it was given (None: not scored)
    from trl.rewards import accuracy_reward, think_format_reward

    fns = {"accuracy_reward": accuracy_reward, "think_format_reward": think_format_reward,
           "format_reward_func": trl_doc_rewards.format_reward_func}  # fmt: skip
    for seen, m in zip(trl_doc_rewards.SEEN, metrics, strict=True):
        for name, fn in fns.items():
            vals = [v for v in fn(seen["completions"], solution=seen["solution"]) if v is not None]
            assert m[f"rewards/{name}/mean"] == pytest.approx(sum(vals) / len(vals)), name
    first = trl_doc_rewards.SEEN[0]
    assert first["completions"][0][0]["role"] == "assistant"
    assert [m["role"] for m in first["prompts"][0]] == ["system", "user"]
    assert first["solution"][0] == first["solution"][0].strip() and first["solution"][0]


def test_a_trl_named_config_trains(tmp_path):
    from grpo.config import load_config
    from tests.helpers import SMALL

    trl_yaml = tmp_path / "trl.yaml"
    trl_yaml.write_text(
        "max_steps: 2\nlearning_rate: 1.0e-3\nlr_scheduler_type: constant\nnum_iterations: 2\n"
        "importance_sampling_level: sequence\nscale_rewards: batch\nepsilon: 0.2\n"
        "epsilon_high: 0.28\nnum_generations: 4\nsave_steps: 1\nsave_total_limit: 1\n"
        "eval_steps: 0\nbeta: 0.04\nwarmup_steps: 0\nvllm_importance_sampling_correction: true\n"
        "vllm_importance_sampling_mode: token_truncate\nvllm_importance_sampling_cap: 2.0\n"
        "top_k: 20\ntop_p: 0.95\n"
    )
    given = ("grpo.steps", "grpo.num_generations", "grpo.eval_every", "grpo.checkpoint")
    small = [s for s in SMALL if not s.startswith(given)]
    cfg = load_config(trl_yaml, [*small, f"output_dir={tmp_path}"])
    g = cfg.grpo
    assert (g.steps, g.mu, g.importance_level, g.loss_type, g.advantage_mode) == (
        2,
        2,
        "sequence",
        "grpo",
        "batch_std",
    )
    _, metrics = _train(cfg, base_model_dir(cfg), tmp_path / "grpo")
    assert [m["step"] for m in metrics] == [1, 2]
    assert "kl" in metrics[-1] and "clamp/k3_frac" in metrics[-1]
    # the rollout correction on, with top-k/top-p sampling: the sampler and the trainer are the
    # same weights and both read the truncated distribution, so the weights sit at 1 within the
    # kernels' numerics, none reaches the cap, the mismatch's KL is tiny and (k3) never
    # negative; the second pass (mu 2) reads the moved policy, whose truncation leaves out
    # some drawn tokens (on-policy the two agree exactly: tests/unit/test_sampler.py)
    assert g.rollout_correction and g.rollout_correction_mode == "truncate" and g.truncates
    for m in metrics:
        assert m["truncation/outside_frac"] < 0.5
        assert m["rollout_correction/weight_mean"] == pytest.approx(1.0, abs=1e-2)
        assert m["rollout_correction/over_threshold_frac"] == 0.0
        # TRL's summary of the same weights: within [C_min, C_max] = (0, 2], around their mean
        lo, mean, hi = (m[f"sampling/importance_sampling_ratio/{k}"] for k in ("min", "mean",
                                                                                "max"))  # fmt: skip
        assert lo <= mean <= hi <= 2.0 and mean == pytest.approx(1.0, abs=1e-2)
        # k3 = r - 1 - log r is about (log r)^2 / 2 a token, so its mean is at most about half
        # the largest gap squared; the mean k1 (signed) is at most the mean |gap|
        assert m["mismatch/kl_k3"] <= 0.6 * m["logprob_gap/max"] ** 2 + 1e-12
        assert abs(m["mismatch/kl_k1"]) <= m["logprob_gap/mean"] + 1e-12
    # learning_rate, lr_scheduler_type and warmup_steps reached the optimizer: 1e-3 throughout
    assert [m["learning_rate"] for m in metrics] == pytest.approx([1e-3, 1e-3])


@pytest.mark.parametrize(("reward", "rounds"), [("reward_len", 1), ("constant", 3)])
def test_dynamic_sampling_stops_when_the_first_round_fills_the_batch(tmp_path, reward, rounds):
    """Completion lengths differ within a group, so reward_len makes every group informative
    and round 1 fills the batch; a constant reward never does, and all 3 rounds run."""
    cfg = small_config(
        tmp_path, f"grpo.reward_funcs=[{DOC}:{reward}]", "grpo.reward_weights=[1.0]",
        "grpo.dynamic_sampling=true", "grpo.max_sampling_rounds=3", "grpo.steps=1",
    )  # fmt: skip
    _, metrics = _train(cfg, base_model_dir(cfg), tmp_path / "grpo")
    m = metrics[-1]
    assert m["sampling/rounds"] == rounds
    if reward == "constant":
        assert m["sampled/frac_reward_zero_std"] == 1.0 and m["frac_reward_zero_std"] == 1.0
    else:
        # before filtering, what was sampled; after, the kept batch: both fully informative
        assert m["sampled/frac_reward_zero_std"] == m["frac_reward_zero_std"] == 0.0
        assert m["completions_per_second"] > 0

"""One source per concept: defaults, allowed names and the reference decision."""

import inspect
import re

import pytest
import torch

from grpo.config import Config, ConfigError, GRPOConfig, load_config
from tests.helpers import ROOT


def test_the_default_run_is_the_typed_defaults():
    # configs/tiny.yaml holds nothing: `make run` runs exactly Config()
    assert load_config(ROOT / "configs" / "tiny.yaml") == Config()


def test_function_defaults_agree_with_the_config():
    from grpo.algo.loss import policy_loss
    from grpo.models.generate import generate

    g = GRPOConfig()
    loss_defaults = {
        k: p.default for k, p in inspect.signature(policy_loss).parameters.items()
        if p.default is not inspect.Parameter.empty and p.default is not None
    }  # fmt: skip
    assert loss_defaults == {
        "loss_type": g.loss_type, "objective": g.policy_objective, "params": g.objective_params(),
        "beta": g.beta, "entropy_coef": g.entropy_coef, "importance_level": g.importance_level,
    }  # fmt: skip
    gen = inspect.signature(generate).parameters
    for k in ("temperature", "top_p", "top_k"):
        assert gen[k].default == getattr(g, k), k


def test_allowed_names_come_from_the_registries():
    from grpo.algo.advantages import ADVANTAGE_ESTIMATORS, advantage_modes
    from grpo.algo.loss import LOSS_AGGREGATIONS, loss_aggregation

    assert set(advantage_modes()) == {*ADVANTAGE_ESTIMATORS, "process"}
    for mode in advantage_modes():
        load_config(None, [f"grpo.advantage_mode={mode}"])
    with pytest.raises(ConfigError, match=r"advantage_mode.*use one of \['zscore'"):
        load_config(None, ["grpo.advantage_mode=bogus"])
    with pytest.raises(ConfigError, match="loss_type"):
        load_config(None, ["grpo.loss_type=sum_of_everything"])
    # a newly registered aggregation becomes a valid config value, with no list to edit
    loss_aggregation("sum_of_everything")(lambda per_token, m, max_len, num_items: per_token.sum())
    try:
        g = load_config(None, ["grpo.loss_type=sum_of_everything"]).grpo
        assert g.loss_type == "sum_of_everything"
        # and the loss reduces with it: the plain sum of the per-token terms
        from grpo.algo.loss import aggregate

        per_token, mask = torch.tensor([[1.0, 2.0], [3.0, 4.0]]), torch.ones(2, 2)
        assert float(aggregate(per_token, mask, g.loss_type, 2, 4.0)) == 10.0
    finally:
        del LOSS_AGGREGATIONS["sum_of_everything"]


def test_unknown_reward_names_are_refused_before_anything_starts():
    with pytest.raises(ConfigError, match=r"reward function 'acuracy'.*use one of \['accuracy'"):
        load_config(None, ["grpo.reward_funcs=[acuracy]", "grpo.reward_weights=[1]"])
    # import paths are resolved when training starts
    load_config(None, ["grpo.reward_funcs=['my_pkg.rewards:f']", "grpo.reward_weights=[1]"])


def test_one_decision_whether_a_reference_exists():
    assert not GRPOConfig().uses_reference
    assert GRPOConfig(beta=0.01).uses_reference


def test_sft_has_its_own_gradient_clipping():
    from grpo.engine.deepspeed_setup import deepspeed_config

    cfg = load_config(None, ["sft.max_grad_norm=5.0", "grpo.max_grad_norm=0.5"])
    ds = deepspeed_config(
        cfg, micro_batch=1, grad_accum=1, lr=1.0, weight_decay=0.0,
        max_grad_norm=cfg.sft.max_grad_norm,
    )  # fmt: skip
    assert ds["gradient_clipping"] == 5.0


TRL_YAML = """\
# a TRL GRPOConfig, flat, with the settings this project supports
max_steps: 7
learning_rate: 1.0e-4
lr_scheduler_type: constant
epsilon: 0.1
epsilon_high: 0.3
num_iterations: 2
importance_sampling_level: token
scale_rewards: none
num_generations: 4
max_completion_length: 32
beta: 0.0
loss_type: bnpo
mask_truncated_completions: true
save_steps: 5
save_total_limit: 1
eval_steps: 0
seed: 3
bf16: true
"""


def test_a_trl_named_config_loads_as_ours(tmp_path):
    from grpo.config import load_config
    from grpo.config.trl_names import TRL_ALIASES

    p = tmp_path / "trl.yaml"
    p.write_text(TRL_YAML)
    cfg = load_config(p)
    ours = load_config(None, [
        "grpo.steps=7", "grpo.lr=1.0e-4", "grpo.lr_schedule=constant", "grpo.eps_low=0.1",
        "grpo.eps_high=0.3", "grpo.mu=2", "grpo.advantage_mode=center", "grpo.num_generations=4",
        "grpo.max_completion_length=32", "grpo.loss_type=bnpo",
        "grpo.mask_truncated_completions=true", "grpo.checkpoint_every=5",
        "grpo.keep_checkpoints=1", "grpo.eval_every=0", "seed=3", "model.dtype=bfloat16",
    ])  # fmt: skip
    assert cfg == ours
    # the same names inside the grpo section work too
    assert load_config(None, ["grpo.learning_rate=0.5"]).grpo.lr == 0.5
    # the docs' table lists every alias
    table = (ROOT / "docs" / "TRL.md").read_text()
    for trl, mine in TRL_ALIASES.items():
        assert f"| `{trl}` | `grpo.{mine}` |" in table


@pytest.mark.parametrize(
    ("override", "says"),
    [
        ("grpo.use_vllm=true", "use_vllm' is not supported here; use model.generation_engine"),
        ("per_device_train_batch_size=8", "use grpo.prompts_per_step"),
        ("fp16=true", "fp16 training needs loss scaling"),
        ("model.dtype=float16", "fp16 training needs loss scaling"),
        ("grpo.scale_rewards=maybe", "scale_rewards: 'maybe'; expected one of group, batch, none"),
    ],
)
def test_trl_settings_we_do_not_have_are_refused_by_name(override, says):
    from grpo.config import ConfigError, load_config

    with pytest.raises(ConfigError, match=re.escape(says)):
        load_config(None, [override])


def test_one_setting_under_two_names_is_refused():
    from grpo.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="'learning_rate' and 'lr' are the same setting"):
        load_config(None, ["grpo.lr=0.1", "grpo.learning_rate=0.2"])


def test_a_hostfile_whose_ranks_do_not_split_the_prompts_is_refused(tmp_path):
    from grpo.config import load_config
    from grpo.launch.preflight import PreflightError, check_world_size, hostfile_world_size

    hosts = tmp_path / "hostfile"
    hosts.write_text("# two nodes\nnode-0 slots=2\nnode-1 slots=1\n")
    assert hostfile_world_size(hosts) == 3
    cfg = load_config(None, [f"deepspeed.hostfile={hosts}"])  # 32 prompts over 3 ranks
    with pytest.raises(PreflightError, match=r"\(32\) must be divisible by the ranks of .*\(3\)"):
        check_world_size(cfg)
    hosts.write_text("node-0 slots=4\nnode-1 slots=4\n")
    check_world_size(cfg)  # 8 ranks: 4 prompts each
    hosts.write_text("node-0 gpus=4\n")
    with pytest.raises(PreflightError, match="line 1: expected 'hostname slots=N'"):
        hostfile_world_size(hosts)


def test_the_readmes_trl_example_loads(tmp_path):
    text = (ROOT / "README.md").read_text()
    block = text.split("# configs/my.yaml: TRL names")[1].split("```")[0]
    p = tmp_path / "my.yaml"
    p.write_text(block.split("\n", 1)[1])
    cfg = load_config(p)
    assert cfg.model.path == "/models/Qwen2.5-0.5B-Instruct"
    assert (cfg.grpo.lr, cfg.grpo.steps, cfg.grpo.advantage_mode) == (1e-6, 500, "zscore")
    assert cfg.grpo.reward_funcs[0] == "trl.rewards:accuracy_reward"


def test_more_synthetic_problems_than_distinct_sums_are_refused_before_drawing():
    # 1-2 digit numbers: 100 values, 5,050 sums a+b (either order); the defaults want 5,500
    with pytest.raises(ConfigError, match=r"5500 problems, but 1-2 digit numbers make only 5050"):
        load_config(None, ["data.max_digits=2", "data.ood_digits=3"])
    cfg = load_config(None, ["data.max_digits=2", "data.ood_digits=3", "data.num_train=2000"])
    assert cfg.data.num_train == 2000


@pytest.mark.parametrize(
    ("overrides", "named"),
    [
        (
            ["model.lora.r=8"],
            "model.lora.r is set but would be ignored: it needs model.lora.enabled",
        ),
        (["grpo.max_sampling_rounds=2"], "grpo.max_sampling_rounds .* grpo.dynamic_sampling=true"),
        (["grpo.eval_every=0", "grpo.eval_limit=5"], "grpo.eval_limit .* grpo.eval_every > 0"),
        (["grpo.overlong_cache=4"], "grpo.overlong_cache .* soft_overlong in grpo.reward_funcs"),
    ],
)
def test_a_setting_of_a_switched_off_part_is_refused_naming_the_switch(overrides, named):
    with pytest.raises(ConfigError, match=named):
        load_config(None, overrides)


def test_the_same_settings_with_their_switch_on_load():
    cfg = load_config(None, ["model.lora.enabled=true", "model.lora.r=8"])
    assert cfg.model.lora.r == 8
    cfg = load_config(None, ["grpo.dynamic_sampling=true", "grpo.max_sampling_rounds=2"])
    assert cfg.grpo.max_sampling_rounds == 2
    # a written config holds every field at its value: those at their defaults load, so a
    # run's own config.yaml (what its ranks and a resume read) always loads again
    cfg = load_config(None, ["model.lora.r=16", "grpo.max_sampling_rounds=3"])
    assert not cfg.model.lora.enabled


def test_a_pass_k_limit_without_pass_k_is_refused():
    # a setting that would be ignored is an error
    with pytest.raises(ConfigError, match="eval.pass_k_limit is set but eval.pass_k is 0"):
        load_config(None, ["eval.pass_k_limit=100"])
    assert load_config(None, ["eval.pass_k=8", "eval.pass_k_limit=100"]).eval.pass_k_limit == 100

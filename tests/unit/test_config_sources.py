"""One source per concept: defaults, allowed names and the reference decision."""

import inspect

import pytest

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
        "loss_type": g.loss_type, "eps_low": g.eps_low, "eps_high": g.eps_high,
        "beta": g.beta, "importance_level": g.importance_level,
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
        assert load_config(None, ["grpo.loss_type=sum_of_everything"]).grpo.loss_type
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

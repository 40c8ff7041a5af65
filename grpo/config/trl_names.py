"""TRL GRPOConfig's names for our settings: accepted beside ours, or refused with what to use.

A TRL user's YAML loads when it sets what we support: the names below are renamed to ours
before validation, at the top level (TRL configs are flat) or in the `grpo` section. A TRL
setting we do not have is refused by name with the setting to use instead (docs/TRL.md has the
table).
"""

from __future__ import annotations

from typing import Any

from reward_fns.errors import UserError

# TRL GRPOConfig name -> our grpo.<name>
TRL_ALIASES: dict[str, str] = {
    "max_steps": "steps",
    "learning_rate": "lr",
    "lr_scheduler_type": "lr_schedule",
    "epsilon": "eps_low",
    "epsilon_high": "eps_high",
    "importance_sampling_level": "importance_level",
    "num_iterations": "mu",
    "save_steps": "checkpoint_every",
    "save_total_limit": "keep_checkpoints",
    "eval_steps": "eval_every",
    "soft_punish_cache": "overlong_cache",
    "sapo_temperature_pos": "sapo_tau_pos",
    "sapo_temperature_neg": "sapo_tau_neg",
    "vllm_importance_sampling_correction": "rollout_correction",
    "vllm_importance_sampling_cap": "rollout_correction_threshold",
    "vllm_importance_sampling_clip_max": "rollout_correction_threshold",
    "vllm_importance_sampling_clip_min": "rollout_correction_min_threshold",
}

# TRL's vllm_importance_sampling_mode names a level and a mode in one value; TRL's sequence
# level is the product of the token ratios, our rollout_correction_level sequence as well
TRL_IS_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")

# TRL's loss_type values that are objectives here: loss_type -> (policy_objective, loss_type).
# TRL aggregates cispo over the global batch's tokens (our dapo) and sapo per sequence (grpo).
TRL_OBJECTIVES: dict[str, tuple[str, str]] = {"cispo": ("cispo", "dapo"), "sapo": ("sapo", "grpo")}

# TRL's scale_rewards value -> our grpo.advantage_mode
SCALE_REWARDS: dict[Any, str] = {
    "group": "zscore",
    True: "zscore",
    "batch": "batch_std",
    "none": "center",
    False: "center",
}

# TRL names that live elsewhere in our config: name -> (section, field)
TRL_ELSEWHERE: dict[str, tuple[str, str]] = {
    "model_name_or_path": ("model", "path"),
}

# TRL settings we do not have -> what to use instead
UNSUPPORTED: dict[str, str] = {
    "per_device_train_batch_size": "grpo.prompts_per_step (global prompts per step; a step "
    "trains on prompts_per_step x num_generations completions)",
    "gradient_accumulation_steps": "grpo.micro_batch_size (completions per forward/backward; "
    "accumulation follows from it)",
    "generation_batch_size": "grpo.prompts_per_step",
    "steps_per_generation": "grpo.mu (updates per rollout batch)",
    "num_train_epochs": "grpo.steps (max_steps)",
    "warmup_ratio": "grpo.warmup_steps",
    "use_vllm": "model.generation_engine (generation runs in the training process)",
    "vllm_mode": "model.generation_engine",
    "gradient_checkpointing": "nothing: not supported yet",
    "logging_steps": "nothing: every step is logged",
    "report_to": "nothing: MLflow always records (tracking.*)",
    "delta": "nothing: two-sided clipping (INTELLECT-2) is not supported",
    "sync_ref_model": "nothing: the reference is fixed",
    "use_liger_loss": "nothing: the loss is grpo.algo.loss.policy_loss",
    "top_entropy_quantile": "nothing: not supported",
}
FP16_REFUSED = (
    "fp16 training needs loss scaling, which is not wired here; use bfloat16 (GPUs since "
    "Ampere) or float32"
)


class TRLNameError(UserError, ValueError):
    """A TRL setting that has no counterpart here, or one given under two names."""


def rename_trl_keys(data: dict[str, Any]) -> dict[str, Any]:
    """A copy of a `grpo` section (or a flat TRL config) with TRL's names turned into ours."""
    out = dict(data)
    if out.get("loss_type") in TRL_OBJECTIVES:
        if "policy_objective" in out:
            raise TRLNameError(
                f"loss_type {out['loss_type']!r} (TRL) and policy_objective are the same "
                "setting; give one"
            )
        objective = out["loss_type"]
        out["policy_objective"], out["loss_type"] = TRL_OBJECTIVES[objective]
        # TRL's cispo reads epsilon_high as the weight's cap itself, not a distance from 1
        if objective == "cispo" and "epsilon_high" in out:
            out["cispo_max_weight"] = out.pop("epsilon_high")
    for trl, ours in TRL_ALIASES.items():
        if trl in out:
            if out[trl] is None and ours == "rollout_correction_threshold":
                raise TRLNameError(f"{trl}: None (no upper bound) is not supported here; give "
                                   "a number > 1 (TRL's default is 3.0)")  # fmt: skip
            if ours in out:
                raise TRLNameError(f"{trl!r} and {ours!r} are the same setting; give one")
            out[ours] = out.pop(trl)
    if "vllm_importance_sampling_mode" in out:
        value = out.pop("vllm_importance_sampling_mode")
        if value not in TRL_IS_MODES:
            raise TRLNameError(f"vllm_importance_sampling_mode: {value!r}; expected one of "
                               f"{', '.join(TRL_IS_MODES)}")  # fmt: skip
        for ours in ("rollout_correction_level", "rollout_correction_mode"):
            if ours in out:
                raise TRLNameError(f"vllm_importance_sampling_mode and {ours} are the same "
                                   "setting; give one")  # fmt: skip
        out["rollout_correction_level"], _, out["rollout_correction_mode"] = value.partition("_")
    if "scale_rewards" in out:
        value = out.pop("scale_rewards")
        if value not in SCALE_REWARDS:
            raise TRLNameError(f"scale_rewards: {value!r}; expected one of group, batch, none")
        if "advantage_mode" in out:
            raise TRLNameError("scale_rewards and advantage_mode are the same setting; give one")
        out["advantage_mode"] = SCALE_REWARDS[value]
    for name in out:
        if name in UNSUPPORTED:
            raise TRLNameError(
                f"{name}: TRL's {name!r} is not supported here; use {UNSUPPORTED[name]}"
            )
    return out


def hoist_flat_trl_keys(data: dict[str, Any], grpo_fields: set[str]) -> dict[str, Any]:
    """A flat TRL-style config: GRPO settings (ours or TRL's names) written at the top level
    move into the `grpo` section; TRL names of other sections move there (model_name_or_path,
    bf16: true is model.dtype bfloat16); fp16: true is refused."""
    out = dict(data)
    section = dict(out.get("grpo") or {})
    trl_only = {"scale_rewards", "vllm_importance_sampling_mode"}
    movable = (grpo_fields | set(TRL_ALIASES) | set(UNSUPPORTED) | trl_only) - {
        "seed",
        "output_dir",
    }
    for key in [k for k in out if k in movable]:
        if key in section:
            raise TRLNameError(f"{key!r} is given at the top level and in grpo; give one")
        section[key] = out.pop(key)
    if out.pop("fp16", False):
        raise TRLNameError(f"fp16: {FP16_REFUSED}")
    if out.pop("bf16", False):
        out["model"] = {**(out.get("model") or {}), "dtype": "bfloat16"}
    for trl, (sec, field) in TRL_ELSEWHERE.items():
        if trl in out:
            out[sec] = {**(out.get(sec) or {}), field: out.pop(trl)}
    if section:
        out["grpo"] = section
    return out

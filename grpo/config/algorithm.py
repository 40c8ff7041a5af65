"""The GRPO stage's settings. Names of loss types, advantage modes and reward functions are
checked against their registries (grpo.algo, reward_fns.registry), never against a list here."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, ValidationInfo, field_validator, model_validator

from grpo.algo.loss import ObjectiveParams
from grpo.config.base import Strict, one_of
from grpo.config.trl_names import rename_trl_keys

# upper bounds on counts, far above any real run, so that a typo (an extra three zeros) is
# refused by name at once instead of running for years or dying at a failed allocation
MAX_STEPS = 10_000_000
MAX_BATCH = 1_000_000  # prompts x completions of one step
MAX_TOKENS = 1_048_576  # a million tokens: beyond every released model's context


class GRPOConfig(Strict):
    steps: int = Field(100, gt=0, le=MAX_STEPS)
    prompts_per_step: int = Field(32, gt=0, le=MAX_BATCH, description="global, across ranks")
    num_generations: int = Field(8, ge=2, le=MAX_BATCH, description="G, completions per prompt")
    max_completion_length: int = Field(48, gt=0, le=MAX_TOKENS)
    temperature: float = Field(1.0, gt=0)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=0, description="0 disables top-k")
    lr: float = Field(3e-4, gt=0)
    warmup_steps: int = Field(10, ge=0)
    lr_schedule: Literal["constant", "cosine", "linear"] = "cosine"
    weight_decay: float = Field(0.0, ge=0)
    max_grad_norm: float = Field(1.0, gt=0)
    beta: float = Field(0.0, ge=0, description="KL weight; 0 never loads the reference")
    eps_low: float = Field(
        0.2, gt=0, lt=1, description="clip range below 1 (unset with importance_level sequence: "
        "3e-4, the GSPO paper's)",
    )  # fmt: skip
    eps_high: float = Field(
        0.28, gt=0, description="clip range above 1 (clip-higher, DAPO; unset with "
        "importance_level sequence: 4e-4, the GSPO paper's)",
    )  # fmt: skip
    policy_objective: str = Field(
        "clip",
        description="a name in grpo.algo.loss.POLICY_OBJECTIVES: clip (PPO), cispo (MiniMax-M1: "
        "clipped, detached importance weight) or sapo (soft sigmoid gate)",
    )
    cispo_max_weight: float = Field(5.0, gt=0, description="cispo: the importance weight's cap")
    sapo_tau_pos: float = Field(1.0, gt=0, description="sapo: gate temperature where A > 0")
    sapo_tau_neg: float = Field(1.05, gt=0, description="sapo: gate temperature where A < 0")
    entropy_coef: float = Field(
        0.0, ge=0, description="entropy bonus: minus this times the token entropy joins the "
        "loss (aggregated like it); 0 off",
    )  # fmt: skip
    loss_type: str = Field(
        "dapo",
        description="a name in grpo.algo.loss.LOSS_AGGREGATIONS; unset with importance_level "
        "sequence it is grpo (each sequence weighted equally, as the GSPO paper)",
    )
    importance_level: str = Field("token", description="token, or sequence (GSPO)")
    advantage_mode: str = Field(
        "zscore", description="a name in grpo.algo.advantages.ADVANTAGE_ESTIMATORS, or process"
    )
    process_reward: str = Field(
        "column_steps", description="step-level reward for advantage_mode 'process'"
    )
    # process defaults: the best process form measured (benchmarks/PROCESS.md), DeepSeekMath's
    # sum plus the outcome advantage; the paper's own form is process_outcome_weight 0
    process_advantage: Literal["sum", "mean"] = Field(
        "sum",
        description="process mode: a token's advantage is the sum (DeepSeekMath) or the mean of "
        "the normalised rewards of the steps ending at or after it",
    )
    process_outcome_weight: float = Field(
        1.0,
        ge=0,
        description="process mode: plus this weight times the outcome advantage (z-score of the "
        "weighted reward_funcs), so the format and other outcome rewards still count",
    )
    mu: int = Field(1, ge=1, description="policy updates per rollout batch")
    old_logprobs: Literal["recompute", "sampler"] = Field(
        "recompute",
        description="pi_old for mu > 1: the training forward of the first pass (recompute, "
        "free: it runs anyway) or the sampler's log-probs (sampler)",
    )
    rollout_correction: bool = Field(
        False,
        description="weight each token's loss by pi_old / mu, the trainer's probability of the "
        "sampled token over the sampler's (importance sampling: TRL "
        "vllm_importance_sampling_correction, verl rollout_is); the mismatch is logged "
        "either way (mismatch/*)",
    )
    rollout_correction_level: Literal["token", "sequence", "geometric"] = Field(
        "token",
        description="a weight per token (token), the product of a sequence's token weights on "
        "all its tokens (sequence: TRL's sequence_* modes, verl's sequence level), or their "
        "geometric mean (geometric: ours, the same weight for any length at the same per-token "
        "mismatch)",
    )
    rollout_correction_mode: Literal["truncate", "mask"] = Field(
        "truncate",
        description="a weight above the threshold is cut to it (TIS) or its token or sequence "
        "is masked out (MIS, IcePop)",
    )
    rollout_correction_threshold: float = Field(
        2.0, gt=1, description="C_max: the largest importance weight kept (TRL's "
        "vllm_importance_sampling_clip_max, also read under its deprecated name _cap; verl's "
        "rollout_is_threshold)",
    )  # fmt: skip
    rollout_correction_min_threshold: float | None = Field(
        None, gt=0, lt=1, description="C_min: the smallest importance weight kept, truncated up "
        "to it or masked below it (TRL's vllm_importance_sampling_clip_min); none by default",
    )  # fmt: skip
    async_rollouts: bool = Field(
        False,
        description="sample in a process of its own, max_staleness steps ahead of the learner, "
        "while it updates (verl's one-step-off, TRL's AsyncGRPOTrainer); turns "
        "rollout_correction on unless it is set. Stale samples need small steps: on SmolLM2 it "
        "learned worse than sync where one update moved log pi by 0.03-0.04 nats a token "
        "(logprob_gap/mean) and as well as sync at 0.014 (benchmarks/ASYNC.md)",
    )
    max_staleness: int = Field(
        1,
        ge=0,
        description="async_rollouts: each step trains on groups sampled with the weights of "
        "exactly this many updates before (fewer in the first steps); TRL's max_staleness. 0: "
        "the sampler process samples each step with the current weights while the learner "
        "waits, bit-identical to the synchronous loop (a check of the async machinery)",
    )
    rollout_engine: Literal["policy", "llama_cpp"] = Field(
        "policy",
        description="what samples the rollouts: the policy itself (model.generation_engine: "
        "the fast sampler or transformers generate), or llama.cpp in a process of its own "
        "(Llama/Qwen2 family; weights synced each step; needs the llama-cpp extra; turns "
        "rollout_correction on unless it is set; benchmarks/ENGINE.md)",
    )
    llama_cpp_dtype: Literal["float32", "float16"] = Field(
        "float32",
        description="rollout_engine llama_cpp: the engine's weight matrices in this dtype "
        "(float16 halves the sync and widens the mismatch, which rollout_correction weights)",
    )
    sampler_dtype: Literal["model", "float32", "bfloat16", "float16"] = Field(
        "model",
        description="async_rollouts: the sampler's weights in this dtype (model: model.dtype); "
        "bfloat16 for GPUs "
        "(slower on CPUs without bf16 kernels, benchmarks/BF16.md); rollout_correction "
        "weights the mismatch",
    )
    sampler_threads: int = Field(
        0,
        ge=0,
        description="async_rollouts: CPU threads of the sampler process; 0: half of the "
        "rank's threads, at least 1 (the learner keeps the rest)",
    )
    micro_batch_size: int = Field(
        256, gt=0, description="completions per forward/backward (256: one per step on CPU)"
    )
    bucket_tokens: int = Field(
        2048,
        ge=0,
        description="the update's and pi_ref's forward runs rows sorted by length, in buckets "
        "of at most this many padded tokens, so short rows do not pay the longest one's "
        "padding; 0: one padded batch per micro-batch",
    )
    logits_budget_mib: float = Field(
        256,
        ge=0,
        description="the largest float32 [tokens, vocabulary] logits block the update's LM head "
        "makes at once: above it the head runs in chunks, checkpointed (recomputed in the "
        "backward); 0: no limit, all logits kept for the backward",
    )
    skip_zero_advantage: bool = Field(
        True,
        description="beta 0 + dapo: no forward/backward for completions with zero advantage "
        "(their gradient is exactly zero); False trains on them as TRL does",
    )
    mask_truncated_completions: bool = Field(
        False,
        description="completions without EOS within max_completion_length add no loss and no "
        "tokens to the normaliser (DAPO overlong filtering)",
    )
    max_prompt_length: int = Field(
        512,
        gt=0,
        le=MAX_TOKENS,
        description="prompt tokens (chat template included); longer prompts are "
        "refused by data validation",
    )
    dynamic_sampling: bool = Field(False, description="drop zero-std groups and sample again")
    max_sampling_rounds: int = Field(3, ge=1)
    reward_funcs: list[str] = Field(
        ["accuracy", "format"], description="registered names or 'package.module:function'"
    )
    reward_weights: list[float] = [1.0, 0.1]
    overlong_cache: int = Field(0, ge=0, description="soft_overlong: length of the penalty ramp")
    reward_timeout_s: float = Field(
        60.0, gt=0, description="time limit per call of a user reward function"
    )
    checkpoint_every: int = Field(50, gt=0)
    keep_checkpoints: int = Field(2, ge=1)
    checkpoint_models: bool = Field(
        True,
        description="a checkpoint step that is also evaluated in-run (eval_every) writes the "
        "policy as a model directory too, logged to MLflow as a model of the run with its step "
        "and its in-run accuracy (as many kept as keep_checkpoints)",
    )
    log_completions_every: int = Field(25, gt=0)
    eval_every: int = Field(50, ge=0, description="greedy held-out accuracy every K steps; 0 off")
    eval_limit: int = Field(300, gt=0, description="held-out problems for the in-run curve")
    on_nonfinite: Literal["skip", "stop"] = "skip"

    @model_validator(mode="before")
    @classmethod
    def _trl_names(cls, data: Any) -> Any:
        return rename_trl_keys(data) if isinstance(data, dict) else data

    @property
    def truncates(self) -> bool:
        """Sampling truncates the distribution (top-k or top-p): the sampler's and the
        trainer's log-probs are then both over what it keeps."""
        return self.top_k > 0 or self.top_p < 1.0

    @property
    def scores_truncated(self) -> bool:
        """The trainer scores its tokens over the sampler's truncated distribution only where
        its log-probs meet the sampler's in a ratio: the rollout correction, or pi_old taken
        from the sampler. Otherwise top-k/top-p shape sampling only, as in TRL."""
        return self.truncates and (
            self.rollout_correction or (self.old_logprobs == "sampler" and self.mu > 1)
        )

    @property
    def uses_reference(self) -> bool:
        """The one decision whether a frozen reference model is loaded and the KL term is in
        the loss: only for beta > 0."""
        return self.beta > 0

    @property
    def uses_entropy_bonus(self) -> bool:
        return self.entropy_coef > 0

    def objective_params(self) -> ObjectiveParams:
        return ObjectiveParams(
            eps_low=self.eps_low, eps_high=self.eps_high, cispo_max_weight=self.cispo_max_weight,
            sapo_tau_pos=self.sapo_tau_pos, sapo_tau_neg=self.sapo_tau_neg,
        )  # fmt: skip

    @field_validator(
        "loss_type", "policy_objective", "importance_level", "advantage_mode", "process_reward"
    )
    @classmethod
    def _registered(cls, v: str, info: ValidationInfo) -> str:
        return one_of(info.field_name, v, _registered_names()[info.field_name])

    @field_validator("reward_funcs")
    @classmethod
    def _reward_funcs(cls, v: list[str]) -> list[str]:
        from reward_fns import REWARD_FUNCS

        for name in v:
            if ":" not in name:  # import paths are resolved (and checked) when training starts
                one_of("reward function", name, sorted(REWARD_FUNCS))
        return v

    @model_validator(mode="after")
    def _check(self) -> GRPOConfig:
        if self.importance_level == "sequence":
            # GSPO's own settings where the user gave none: sequences weighted equally (a
            # token-weighted default would weight by length), and clip widths for a sequence
            # ratio, whose spread is far narrower than a token's (the paper, section 5.1)
            for name, value in (("loss_type", "grpo"), ("eps_low", 3e-4), ("eps_high", 4e-4)):
                if name not in self.model_fields_set:
                    object.__setattr__(self, name, value)
        if len(self.reward_weights) != len(self.reward_funcs):
            raise ValueError(
                f"reward_weights has {len(self.reward_weights)} entries for "
                f"{len(self.reward_funcs)} reward_funcs"
            )
        if self.prompts_per_step * self.num_generations > MAX_BATCH:
            raise ValueError(
                f"prompts_per_step x num_generations = "
                f"{self.prompts_per_step * self.num_generations:,} completions a step, more "
                f"than {MAX_BATCH:,}"
            )
        if ((self.async_rollouts and self.max_staleness > 0 or self.rollout_engine != "policy")
                and "rollout_correction" not in self.model_fields_set):  # fmt: skip
            # stale rollouts, and another engine's numerics, are off-policy: corrected unless
            # the user says otherwise
            object.__setattr__(self, "rollout_correction", True)
        if self.rollout_correction and self.mu > 1 and self.old_logprobs == "sampler":
            raise ValueError(
                "rollout_correction with old_logprobs sampler: pi_old is then the sampler's "
                "log-probs and every weight is 1; use old_logprobs recompute"
            )
        if "soft_overlong" in self.reward_funcs and not (
            0 < self.overlong_cache <= self.max_completion_length
        ):
            raise ValueError("soft_overlong needs 0 < overlong_cache <= max_completion_length")
        return self


def _registered_names() -> dict[str, tuple[str, ...]]:
    """The allowed values of each registry-named field, read from the registries."""
    from grpo.algo.advantages import advantage_modes
    from grpo.algo.loss import IMPORTANCE_LEVELS, LOSS_AGGREGATIONS, POLICY_OBJECTIVES
    from reward_fns import PROCESS_REWARDS

    return {
        "loss_type": tuple(LOSS_AGGREGATIONS),
        "policy_objective": tuple(POLICY_OBJECTIVES),
        "importance_level": IMPORTANCE_LEVELS,
        "advantage_mode": advantage_modes(),
        "process_reward": tuple(PROCESS_REWARDS),
    }

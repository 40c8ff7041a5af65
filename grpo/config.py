"""The one typed config: every stage, the DeepSpeed JSON and the MLflow params derive from it.

Loaded from YAML (configs/*.yaml) with `--set section.key=value` overrides; unknown keys and
impossible values are refused with a message naming the field.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator


class ConfigError(ValueError):
    """A config file or override is invalid; the message names the field."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class TinyModelConfig(_Strict):
    """The embedded default model, built locally (no hub): a small Qwen2."""

    hidden_size: int = Field(128, gt=0, description="width of the transformer")
    num_layers: int = Field(4, gt=0)
    num_heads: int = Field(4, gt=0)
    num_kv_heads: int = Field(2, gt=0)
    intermediate_size: int = Field(384, gt=0)
    max_position_embeddings: int = Field(256, gt=0)


class ModelConfig(_Strict):
    path: str | None = Field(
        None, description="local Hugging Face model directory; None builds the tiny model"
    )
    tiny: TinyModelConfig = TinyModelConfig()
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    chat_template: bool = Field(False, description="wrap prompts in the tokenizer's chat template")
    system_prompt: str | None = None
    generation_engine: Literal["auto", "fast", "hf"] = Field(
        "auto",
        description="rollouts and evaluation: grpo.decoding (fast, Qwen2/Llama family), "
        "transformers generate (hf), or fast when the architecture is supported (auto)",
    )


class DataConfig(_Strict):
    task: Literal["synthetic", "files"] = Field(
        "synthetic", description="synthetic arithmetic (embedded default) or your own files"
    )
    seed: int = 1234
    num_sft: int = Field(400, ge=8, description="worked solutions for SFT (synthetic)")
    num_sft_val: int = Field(200, ge=8, description="held-back worked solutions, SFT early stop")
    num_train: int = Field(4000, ge=1, description="answer-only RL prompts (synthetic)")
    num_heldout: int = Field(1000, ge=1, description="in-distribution held-out (synthetic)")
    num_heldout_ood: int = Field(500, ge=1, description="harder held-out (synthetic)")
    min_digits: int = Field(1, ge=1)
    max_digits: int = Field(3, ge=1)
    ood_digits: int = Field(4, ge=1, description="digits of the out-of-distribution set")
    sft_path: str | None = Field(None, description="JSONL/Parquet of worked solutions (files)")
    train_path: str | None = Field(None, description="JSONL/Parquet of RL prompts (files)")
    prompt_column: str = "prompt"
    answer_column: str = "answer"
    solution_column: str = "solution"
    gsm8k_solutions: bool = Field(
        False, description="files: GSM8K rows ('question', 'answer' with '#### x')"
    )

    @model_validator(mode="after")
    def _check(self) -> DataConfig:
        if self.min_digits > self.max_digits:
            raise ValueError("min_digits must be <= max_digits")
        if self.ood_digits <= self.max_digits:
            raise ValueError("ood_digits must exceed max_digits (the OOD set is harder)")
        if self.task == "files" and not self.train_path:
            raise ValueError("train_path is required when task is 'files'")
        return self


class SFTConfig(_Strict):
    enabled: bool = Field(True, description="False: use model.path as the reference as is")
    lr: float = Field(3e-3, gt=0)
    batch_size: int = Field(32, gt=0)
    max_epochs: int = Field(200, gt=0)
    eval_every: int = Field(25, gt=0, description="steps between validation losses")
    patience: int = Field(4, ge=1, description="validations without improvement before stopping")
    warmup_steps: int = Field(20, ge=0)
    weight_decay: float = Field(0.0, ge=0)


class GRPOConfig(_Strict):
    steps: int = Field(200, gt=0)
    prompts_per_step: int = Field(8, gt=0, description="global, across ranks")
    num_generations: int = Field(8, ge=2, description="G, completions per prompt")
    max_completion_length: int = Field(48, gt=0)
    temperature: float = Field(1.0, gt=0)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=0, description="0 disables top-k")
    lr: float = Field(2e-4, gt=0)
    warmup_steps: int = Field(10, ge=0)
    lr_schedule: Literal["constant", "cosine", "linear"] = "constant"
    weight_decay: float = Field(0.0, ge=0)
    max_grad_norm: float = Field(1.0, gt=0)
    beta: float = Field(0.0, ge=0, description="KL weight; 0 never loads the reference")
    eps_low: float = Field(0.2, gt=0, lt=1)
    eps_high: float | None = Field(0.28, gt=0)
    loss_type: Literal["grpo", "bnpo", "dr_grpo", "dapo"] = "dapo"
    importance_level: Literal["token", "sequence"] = "token"
    advantage_mode: Literal["zscore", "center", "loo", "process"] = "zscore"
    process_reward: str = Field(
        "arithmetic_steps", description="step-level reward for advantage_mode 'process'"
    )
    mu: int = Field(1, ge=1, description="policy updates per rollout batch")
    micro_batch_size: int = Field(64, gt=0, description="completions per forward/backward")
    skip_zero_advantage: bool = Field(
        True,
        description="beta 0 + dapo: no forward/backward for completions with zero advantage "
        "(their gradient is exactly zero); False trains on them as TRL does",
    )
    dynamic_sampling: bool = Field(False, description="drop zero-std groups and sample again")
    max_sampling_rounds: int = Field(3, ge=1)
    reward_funcs: list[str] = ["accuracy", "format"]
    reward_weights: list[float] = [1.0, 0.1]
    overlong_cache: int = Field(0, ge=0, description="soft_overlong: length of the penalty ramp")
    reward_timeout_s: float = Field(
        60.0, gt=0, description="time limit per call of a user reward function"
    )
    checkpoint_every: int = Field(50, gt=0)
    keep_checkpoints: int = Field(2, ge=1)
    log_completions_every: int = Field(25, gt=0)
    eval_every: int = Field(50, ge=0, description="greedy held-out accuracy every K steps; 0 off")
    eval_limit: int = Field(300, gt=0, description="held-out problems for the in-run curve")
    on_nonfinite: Literal["skip", "stop"] = "skip"

    @model_validator(mode="after")
    def _check(self) -> GRPOConfig:
        if len(self.reward_weights) != len(self.reward_funcs):
            raise ValueError(
                f"reward_weights has {len(self.reward_weights)} entries for "
                f"{len(self.reward_funcs)} reward_funcs"
            )
        from reward_fns.process import PROCESS_REWARDS

        if self.process_reward not in PROCESS_REWARDS:
            raise ValueError(
                f"process_reward {self.process_reward!r} unknown; "
                f"use one of {list(PROCESS_REWARDS)}"
            )
        if "soft_overlong" in self.reward_funcs and not (
            0 < self.overlong_cache <= self.max_completion_length
        ):
            raise ValueError("soft_overlong needs 0 < overlong_cache <= max_completion_length")
        return self


class DeepSpeedConfig(_Strict):
    zero_stage: Literal[0, 1, 2, 3] = 0
    offload_optimizer: bool = False
    nproc: int = Field(1, ge=1, description="ranks on this node (GPUs, or CPU processes)")
    hostfile: str | None = Field(None, description="DeepSpeed hostfile for several nodes")
    master_port: int = Field(29511, gt=1024, lt=65536)
    timeout_s: int = Field(600, gt=0, description="collective timeout: a dead rank fails others")


class EvalConfig(_Strict):
    sets: list[str] = ["synthetic", "synthetic_ood"]
    samples: int = Field(1, ge=1, description="n samples per problem (pass@k, maj@k)")
    temperature: float = Field(1.0, gt=0)
    limit: int | None = Field(None, gt=0)
    batch_size: int = Field(256, gt=0)
    max_new_tokens: int | None = Field(None, gt=0, description="None: max_completion_length")
    few_shot: int = Field(0, ge=0, description="worked SFT examples placed before each prompt")


class TrackingConfig(_Strict):
    tracking_uri: str | None = Field(None, description="None: sqlite mlflow.db in the project")
    experiment: str = "grpo"
    registered_model: str = "grpo-tiny-math"
    promotion_metric: str = "eval/synthetic/accuracy"
    promotion_margin: float = 0.0


class Config(_Strict):
    run_name: str = "tiny"
    seed: int = 0
    output_dir: str = "runs"
    device: Literal["auto", "cpu", "cuda"] = "auto"
    model: ModelConfig = ModelConfig()
    data: DataConfig = DataConfig()
    sft: SFTConfig = SFTConfig()
    grpo: GRPOConfig = GRPOConfig()
    deepspeed: DeepSpeedConfig = DeepSpeedConfig()
    eval: EvalConfig = EvalConfig()
    tracking: TrackingConfig = TrackingConfig()

    @model_validator(mode="after")
    def _check(self) -> Config:
        world = self.deepspeed.nproc
        if self.grpo.prompts_per_step % world:
            raise ValueError(
                f"grpo.prompts_per_step ({self.grpo.prompts_per_step}) must be divisible by "
                f"deepspeed.nproc ({world})"
            )
        if not self.sft.enabled and not self.model.path:
            raise ValueError("sft.enabled=false needs model.path (a reference to start from)")
        return self

    def run_dir(self) -> Path:
        return Path(self.output_dir) / self.run_name

    def digest(self, *sections: str) -> str:
        """Stable hash of the named sections (all when none): cache keys, run tags."""
        dump = self.model_dump(mode="json")
        part = {k: dump[k] for k in sections} if sections else dump
        return hashlib.sha256(json.dumps(part, sort_keys=True).encode()).hexdigest()[:16]

    def flat(self) -> dict[str, Any]:
        """Dotted key -> value, for MLflow params."""
        out: dict[str, Any] = {}

        def walk(prefix: str, node: Any) -> None:
            if isinstance(node, dict):
                for k, v in node.items():
                    walk(f"{prefix}.{k}" if prefix else k, v)
            else:
                out[prefix] = node

        walk("", self.model_dump(mode="json"))
        return out


def _format_errors(err: ValidationError, source: str) -> str:
    lines = [f"invalid config ({source}):"]
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"]) or "(top level)"
        msg = e["msg"].replace("Value error, ", "")
        if e["type"] == "extra_forbidden":
            msg = "unknown key"
        lines.append(f"  {loc}: {msg}")
    return "\n".join(lines)


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply `a.b=c` overrides; values are parsed as YAML (numbers, bools, lists)."""
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"--set {item!r}: expected key=value")
        key, _, raw = item.partition("=")
        try:
            value = yaml.safe_load(raw) if raw != "" else None
        except yaml.YAMLError as e:
            raise ConfigError(f"--set {key}: cannot parse value {raw!r}: {e}") from e
        node = data
        parts = key.strip().split(".")
        for p in parts[:-1]:
            child = node.setdefault(p, {})
            if not isinstance(child, dict):
                raise ConfigError(f"--set {key}: {p!r} is not a section")
            node = child
        node[parts[-1]] = value
    return data


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> Config:
    """Read a YAML config (or the defaults), apply overrides, validate."""
    data: dict[str, Any] = {}
    source = "defaults"
    if path is not None:
        source = str(path)
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file not found: {p}")
        try:
            loaded = yaml.safe_load(p.read_text())
        except yaml.YAMLError as e:
            raise ConfigError(f"{p}: not valid YAML: {e}") from e
        if loaded is not None and not isinstance(loaded, dict):
            raise ConfigError(f"{p}: expected a mapping at the top level")
        data = loaded or {}
    data = apply_overrides(data, overrides or [])
    try:
        return Config.model_validate(data)
    except ValidationError as e:
        raise ConfigError(_format_errors(e, source)) from None

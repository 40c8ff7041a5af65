"""The one typed config: every stage, the DeepSpeed JSON and the MLflow params derive from it.

The defaults are the embedded default run (`make run`): configs/tiny.yaml is empty, and a YAML
file holds only what differs from these defaults. Loaded with `--set section.key=value`
overrides; unknown keys and impossible values are refused with a message naming the field. The
names of loss types, advantage modes and reward functions come from their registries
(grpo.algo, reward_fns.registry), never from a list written here.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import Field, ValidationError, model_validator

from grpo.config.algorithm import GRPOConfig
from grpo.config.base import Strict
from grpo.config.sections import (
    DataConfig,
    DeepSpeedConfig,
    EvalConfig,
    LoRAConfig,
    ModelConfig,
    RFTConfig,
    SFTConfig,
    TinyModelConfig,
    ToolsConfig,
    TrackingConfig,
    set_label,
)
from grpo.config.trl_names import hoist_flat_trl_keys
from reward_fns.errors import UserError

__all__ = [
    "Config",
    "ConfigError",
    "DataConfig",
    "DeepSpeedConfig",
    "EvalConfig",
    "GRPOConfig",
    "LoRAConfig",
    "ModelConfig",
    "RFTConfig",
    "SFTConfig",
    "TinyModelConfig",
    "TrackingConfig",
    "apply_overrides",
    "load_config",
    "prompts_split_error",
    "set_label",
]


def prompts_split_error(prompts_per_step: int, world: int, ranks: str) -> str | None:
    """The one rule on ranks: each samples the same number of whole prompts (groups stay on one
    rank). Checked where the world size becomes known: the config (deepspeed.nproc), preflight
    (a hostfile) and the training loop (the ranks a launcher really started); `ranks` names the
    source."""
    if prompts_per_step % world:
        return f"grpo.prompts_per_step ({prompts_per_step}) must be divisible by {ranks} ({world})"
    return None


def _changed(section: Any, names: set[str]) -> list[str]:
    """The fields among `names` whose value differs from the field's default (a written config
    holds every field: one at its default says nothing the user asked for)."""
    fields = type(section).model_fields
    return sorted(n for n in names if getattr(section, n) != fields[n].get_default(
        call_default_factory=True))  # fmt: skip


def switched_off_error(cfg: Config) -> str | None:
    """A setting given for a part that its switch turns off would be ignored without a word:
    name the first such setting and its switch, or None."""
    g, lora, rft = cfg.grpo, cfg.model.lora, cfg.rft
    rules = [  # (the part is off, its settings changed from their defaults, section, switch)
        (not rft.enabled and cfg.method != "rft",
         _changed(rft, set(type(rft).model_fields) - {"enabled"}), "rft",
         "rft.enabled=true or method=rft"),
        (not lora.enabled, _changed(lora, set(type(lora).model_fields) - {"enabled"}),
         "model.lora", "model.lora.enabled=true"),
        (not g.dynamic_sampling, _changed(g, {"max_sampling_rounds"}), "grpo",
         "grpo.dynamic_sampling=true"),
        (g.eval_every == 0, _changed(g, {"eval_limit"}), "grpo", "grpo.eval_every > 0"),
        (g.eval_every == 0 and cfg.method != "rft", _changed(cfg.data, {"num_select"}), "data",
         "grpo.eval_every > 0 (the selection's cadence)"),
        ("soft_overlong" not in g.reward_funcs, _changed(g, {"overlong_cache"}), "grpo",
         "soft_overlong in grpo.reward_funcs"),
        (not g.async_rollouts, _changed(g, {"max_staleness", "sampler_threads",
         "sampler_dtype"}), "grpo",
         "grpo.async_rollouts=true"),
        (g.rollout_engine != "llama_cpp", _changed(g, {"llama_cpp_dtype"}), "grpo",
         "grpo.rollout_engine=llama_cpp"),
        (not g.rollout_correction, _changed(g, {"rollout_correction_level",
         "rollout_correction_mode", "rollout_correction_threshold",
         "rollout_correction_min_threshold"}), "grpo",
         "grpo.rollout_correction=true"),
    ]  # fmt: skip
    for off, given, section, switch in rules:
        if off and given:
            return f"{section}.{given[0]} is set but would be ignored: it needs {switch}"
    return None


def tools_error(cfg: Config) -> str | None:
    """What multi-turn rollouts with tools do not support yet, or what would go unused."""
    t, g = cfg.tools, cfg.grpo
    if cfg.data.worked_solutions == "calculator" and "calculator" not in t.functions:
        return "data.worked_solutions=calculator demonstrates a calculator call: add " \
            "calculator to tools.functions"  # fmt: skip
    if cfg.data.worked_solutions != "columns" and cfg.data.task == "files":
        return "data.worked_solutions is the synthetic and reasoning_gym tasks'; a files task's " \
            "solutions are its files' own: it would be ignored here"  # fmt: skip
    if "environment" in g.reward_funcs and not t.environment:
        return "grpo.reward_funcs names `environment` (the environment's get_reward), but " \
            "tools.environment is not set"  # fmt: skip
    if not t.active:
        if t != type(t)():
            return "tools.* is set but no tool is: give tools.functions or tools.environment"
        if cfg.eval.untooled:
            return "eval.untooled evaluates models without their tools, but no tool is set " \
                "(tools.functions or tools.environment)"  # fmt: skip
        return None
    if g.async_rollouts:
        return "tools with grpo.async_rollouts are not supported yet: the sampler process " \
            "runs single-turn completions; set grpo.async_rollouts=false"  # fmt: skip
    if g.rollout_engine != "policy":
        return f"tools with grpo.rollout_engine={g.rollout_engine} are not supported yet: " \
            "episodes are sampled by the policy; set grpo.rollout_engine=policy"  # fmt: skip
    if g.advantage_mode == "process":
        return "tools with grpo.advantage_mode=process are not supported: process rewards " \
            "score one completion's reasoning steps, not an episode's turns"  # fmt: skip
    if cfg.method == "rft" or cfg.rft.enabled:
        return "tools with RFT are not supported yet: RFT samples single-turn completions"
    return None


class ConfigError(UserError, ValueError):
    """A config file or override is invalid; the message names the field."""


class Config(Strict):
    run_name: str = "tiny"
    seed: int = 0
    output_dir: str = "runs"
    device: Literal["auto", "cpu", "cuda"] = "auto"
    model: ModelConfig = ModelConfig()
    data: DataConfig = DataConfig()
    sft: SFTConfig = SFTConfig()
    grpo: GRPOConfig = GRPOConfig()
    method: Literal["grpo", "rft"] = Field(
        "grpo",
        description="what the pipeline trains and registers: GRPO (its controls beside it), or "
        "RFT alone (rejection-sampling fine-tuning, section rft)",
    )
    rft: RFTConfig = RFTConfig()
    tools: ToolsConfig = ToolsConfig()
    deepspeed: DeepSpeedConfig = DeepSpeedConfig()
    eval: EvalConfig = EvalConfig()
    tracking: TrackingConfig = TrackingConfig()

    @model_validator(mode="before")
    @classmethod
    def _flat_trl_config(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        return hoist_flat_trl_keys(data, set(GRPOConfig.model_fields))

    @model_validator(mode="after")
    def _check(self) -> Config:
        if error := prompts_split_error(self.grpo.prompts_per_step, self.deepspeed.nproc,
                                        "deepspeed.nproc"):  # fmt: skip
            raise ValueError(error)
        gate_set = self.tracking.promotion_metric.split("/")[1]
        if gate_set not in [set_label(n) for n in self.eval.sets]:
            raise ValueError(
                f"tracking.promotion_metric is about {gate_set!r}, which eval.sets does not hold"
            )
        if not self.sft.enabled and not (self.model.path or self.model.gguf):
            raise ValueError(
                "sft.enabled=false needs model.path or model.gguf (a reference to start from)"
            )
        if self.model.lora.enabled and self.deepspeed.zero_stage == 3:
            raise ValueError(
                "model.lora with deepspeed.zero_stage 3 is refused: ZeRO-3 shards the frozen "
                "base weights that every LoRA forward needs whole (and the fast sampler merges "
                "adapters into them); LoRA's trainable and optimizer state is small, so use "
                "zero_stage 0 or 2"
            )
        if self.grpo.async_rollouts and self.deepspeed.zero_stage == 3:
            raise ValueError(
                "grpo.async_rollouts with deepspeed.zero_stage 3 is refused: the sampler process "
                "needs the whole weights after every update, which ZeRO-3 shards; use zero_stage "
                "0, 1 or 2"
            )
        if self.eval.pass_k and self.eval.samples > 1:
            raise ValueError(
                "eval.pass_k samples beside a greedy completion; with eval.samples > 1 there is "
                "no greedy one: give one of them"
            )
        if self.eval.pass_k_limit is not None and not self.eval.pass_k:
            raise ValueError("eval.pass_k_limit is set but eval.pass_k is 0: there is no sampled "
                             "pass@k to limit")  # fmt: skip
        if self.model.lora.enabled and self.data.num_select:
            raise ValueError(
                "data.num_select with model.lora is not supported: the selected step's adapter "
                "would overwrite the last one's; set data.num_select=0"
            )
        if self.model.path and self.model.gguf:
            raise ValueError("model.path and model.gguf both name the model; give one")
        if self.method == "rft" and self.rft.enabled:
            raise ValueError(
                "rft.enabled trains RFT beside GRPO; with method=rft RFT is what is trained and "
                "registered (no GRPO): remove rft.enabled"
            )
        if error := tools_error(self):
            raise ValueError(error)
        if error := switched_off_error(self):
            raise ValueError(error)
        return self

    def forward_layout(self) -> tuple[int, float]:
        """(bucket_tokens, logits_budget_mib) of the update's and pi_ref's forward. Under
        ZeRO-3 both are off: each module call gathers its sharded weights in a collective, so
        every rank must make the same calls, and the number of buckets and head chunks
        depends on each rank's own completion lengths."""
        if self.deepspeed.zero_stage == 3:
            return 0, 0.0
        return self.grpo.bucket_tokens, self.grpo.logits_budget_mib

    @property
    def has_worked_solutions(self) -> bool:
        """Whether there is SFT data (the generated tasks', or data.sft_path)."""
        return self.data.task in ("synthetic", "reasoning_gym") or bool(self.data.sft_path)

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
    """Read a YAML config (or the defaults), apply overrides, validate.

    Args:
        path: a YAML file holding only what differs from the defaults (our names, or TRL's
            GRPOConfig names, flat); None: the embedded default run.
        overrides: `section.key=value` strings, values parsed as YAML (`grpo.lr=1e-4`).

    Raises:
        ConfigError: one message naming every invalid field, unknown key or ignored setting.
    """
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

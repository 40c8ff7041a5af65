"""The config sections other than GRPO's: model, data, SFT, DeepSpeed, evaluation, tracking."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from grpo.config.base import Strict
from grpo.config.trl_names import FP16_REFUSED


class TinyModelConfig(Strict):
    """The embedded default model, built locally (no hub): a small Qwen2."""

    hidden_size: int = Field(128, gt=0, description="width of the transformer")
    num_layers: int = Field(4, gt=0)
    num_heads: int = Field(4, gt=0)
    num_kv_heads: int = Field(2, gt=0)
    intermediate_size: int = Field(384, gt=0)
    max_position_embeddings: int = Field(256, gt=0)


# every linear of a Llama/Qwen2-family block: attention (q, k, v, o) and MLP (gate, up, down)
LLAMA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


class LoRAConfig(Strict):
    """LoRA adapters (peft) on the GRPO policy; the SFT reference stays the full base model."""

    enabled: bool = Field(False, description="train LoRA adapters instead of every weight")
    r: int = Field(16, gt=0, le=4096, description="rank of each adapter")
    alpha: float = Field(32.0, gt=0, description="scale alpha / r on the adapter's output")
    dropout: float = Field(
        0.0, ge=0, lt=1,
        description="dropout on the adapters' input in the update (never while sampling): "
        "above 0 the update's pi_theta is noisier than the sampler's",
    )  # fmt: skip
    target_modules: list[str] = Field(
        default_factory=lambda: list(LLAMA_TARGETS),
        min_length=1,
        description="module names that get adapters (default: every linear of a Llama/Qwen2 block)",
    )
    train_embeddings: bool = Field(
        False, description="also train the token embeddings and LM head in full (tied stay tied)"
    )

    @field_validator("target_modules")
    @classmethod
    def _targets(cls, v: list[str]) -> list[str]:
        if "embed_tokens" in v or "lm_head" in v:
            raise ValueError(
                "embed_tokens and lm_head take no adapters here: set train_embeddings=true to "
                "train them in full"
            )
        if len(set(v)) != len(v) or any(not t.strip() for t in v):
            raise ValueError(f"expected distinct, non-empty module names, got {v}")
        return v


class ModelConfig(Strict):
    path: str | None = Field(
        None, description="local Hugging Face model directory; None builds the tiny model"
    )
    gguf: str | None = Field(
        None,
        description="a GGUF file, as a path or 'package:path' inside an installed package, "
        "converted once into a cached Hugging Face directory (instead of path)",
    )
    tiny: TinyModelConfig = TinyModelConfig()
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    chat_template: bool = Field(False, description="wrap prompts in the tokenizer's chat template")
    system_prompt: str | None = None
    generation_engine: Literal["auto", "fast", "hf"] = Field(
        "auto",
        description="rollouts and evaluation: grpo.models.sampler (fast, Qwen2/Llama family), "
        "transformers generate (hf), or fast for a supported architecture on the CPU (auto)",
    )
    lora: LoRAConfig = LoRAConfig()

    @field_validator("dtype")
    @classmethod
    def _no_fp16(cls, v: str) -> str:
        if v == "float16":
            raise ValueError(FP16_REFUSED)
        return v


class GeneratorSpec(Strict):
    """One reasoning-gym generator of a task mix (data.task reasoning_gym)."""

    name: str = Field(description="a reasoning-gym generator, e.g. chain_sum, gcd")
    weight: float = Field(1.0, gt=0, description="its share of every split, by weight")
    config: dict[str, Any] = Field(
        default_factory=dict, description="its reasoning-gym config (seed and size are ours)"
    )

    @model_validator(mode="after")
    def _check(self) -> GeneratorSpec:
        if {"seed", "size"} & set(self.config):
            raise ValueError(
                f"{self.name}: seed and size are set per split by the pipeline (data.seed and "
                "the data.num_* sizes); remove them from config"
            )
        return self


class DataConfig(Strict):
    task: Literal["synthetic", "files", "reasoning_gym"] = Field(
        "synthetic",
        description="synthetic arithmetic (embedded default), your own files, or reasoning-gym "
        "generators (data.generators)",
    )
    generators: list[GeneratorSpec] = Field(
        default_factory=list,
        description="reasoning_gym: the generators, each with a weight and its config; "
        "held-out sets are eval sets rg:<name> (data.num_heldout problems each)",
    )
    seed: int = 1234
    num_sft: int = Field(300, ge=8, description="worked solutions for SFT (synthetic)")
    num_sft_val: int = Field(200, ge=8, description="held-back worked solutions, SFT early stop")
    num_train: int = Field(4000, ge=1, description="answer-only RL prompts (synthetic)")
    num_heldout: int = Field(1000, ge=1, description="in-distribution held-out (synthetic)")
    num_heldout_ood: int = Field(500, ge=1, description="harder held-out (synthetic)")
    num_select: int = Field(
        0, ge=0,
        description="selection split (synthetic): answer-only problems, disjoint from every "
        "other set, on which GRPO's and the control's checkpoints are chosen (greedy accuracy, "
        "every grpo.eval_every / sft.eval_every steps); 0: no selection, the last step is kept",
    )  # fmt: skip
    worked_solutions: Literal["columns", "calculator"] = Field(
        "columns",
        description="synthetic: how the SFT solutions work a sum: column by column in <think>, "
        "or by calling the calculator tool and answering with its result (tools.functions "
        "must hold calculator); reasoning_gym: calculator gives demonstrations that call it "
        "with the expression that solves the problem (generators that have one: leg_counting)",
    )
    min_digits: int = Field(1, ge=1)
    max_digits: int = Field(3, ge=1)
    ood_digits: int = Field(4, ge=1, description="digits of the out-of-distribution set")
    sft_path: str | None = Field(None, description="JSONL/Parquet of worked solutions (files)")
    train_path: str | None = Field(None, description="JSONL/Parquet of RL prompts (files)")
    prompt_column: str = "prompt"
    answer_column: str = "answer"
    worked_solution_column: str = Field(
        "worked_solution",
        description="SFT files: the worked solution (`solution` is the gold answer, as in open-r1)",
    )
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
        if self.task == "reasoning_gym" and not self.generators:
            raise ValueError("data.task reasoning_gym needs data.generators (at least one)")
        if self.task != "reasoning_gym" and self.generators:
            raise ValueError(
                "data.generators is set but would be ignored: it needs data.task=reasoning_gym"
            )
        names = [g.name for g in self.generators]
        if len(set(names)) != len(names):
            raise ValueError(f"data.generators: a generator is named twice ({names})")
        if self.task == "files" and self.num_select:
            raise ValueError(
                "data.num_select draws a selection split of the synthetic task; with files, "
                "it would be ignored: set it to 0"
            )
        if self.task == "synthetic":
            # every problem is a distinct pair a+b (either order) of numbers with min_digits to
            # max_digits digits: more than exist would never finish drawing
            values = sum(10 if d == 1 else 9 * 10 ** (d - 1)
                         for d in range(self.min_digits, self.max_digits + 1))  # fmt: skip
            pairs = values * (values + 1) // 2
            wanted = (self.num_heldout + self.num_sft_val + self.num_sft + self.num_train
                      + self.num_select)  # fmt: skip
            if wanted > pairs * 0.9:  # drawing at random slows down as the pairs run out
                raise ValueError(
                    f"num_heldout + num_sft_val + num_sft + num_train + num_select = {wanted} "
                    "problems, but "
                    f"{self.min_digits}-{self.max_digits} digit numbers make only {pairs} "
                    f"distinct sums; lower them (to about {int(pairs * 0.9)}) or raise max_digits"
                )
        return self


class SandboxConfig(Strict):
    """The `python` tool's limits, per call (grpo.env.sandbox)."""

    cpu_s: int = Field(5, ge=1, description="CPU seconds")
    wall_s: float = Field(10.0, gt=0, description="wall clock, the process group killed after")
    memory_mb: int = Field(512, ge=64, description="address space")
    processes: int = Field(16, ge=1, description="processes (enforced as user nobody, root)")
    output_bytes: int = Field(8192, ge=256, description="stdout and stderr each")
    require: list[
        Literal[
            "no-network", "user-nobody", "process-limit", "read-only-filesystem", "hidden-paths"
        ]
    ] = Field(
        default_factory=list,
        description="protections the machine must give or the run is refused (they need root)",
    )


class ToolsConfig(Strict):
    """Multi-turn rollouts with tools (grpo.env): after each assistant turn, the tool calls it
    holds run and their results come back, until a turn has no call or a limit ends it."""

    functions: list[str] = Field(
        default_factory=list,
        description="stateless tools, TRL's tools=[...]: calculator, python (built in), or "
        "module:function (typed, with a docstring)",
    )
    environment: str | None = Field(
        None,
        description="module:Class, TRL's environment_factory: one instance per episode, its "
        "public methods the tools, reset(**row) before it, get_reward() scoring it (reward "
        "function `environment`)",
    )
    list_in_prompt: bool = Field(
        True,
        description="show the tools and the call format in every prompt (the chat template's "
        "tools=, or the system prompt); false: the model learns them from its SFT "
        "demonstrations alone, for a small model whose context the listing would fill",
    )  # fmt: skip
    max_turns: int = Field(4, ge=1, description="model turns an episode may take")
    max_tool_tokens: int = Field(256, ge=8, description="tokens of one tool response, cut after")
    max_calls_per_turn: int = Field(4, ge=1, description="calls run per turn; more are errors")
    sandbox: SandboxConfig = SandboxConfig()

    @property
    def active(self) -> bool:
        return bool(self.functions or self.environment)


class RFTConfig(Strict):
    """Rejection-sampling fine-tuning (RFT, expert iteration, STaR): from the same reference, on
    GRPO's answer-only prompts, in rounds: sample, keep what the verifier marks correct, SFT on
    it. A control beside GRPO (enabled), or the method itself (method: rft)."""

    enabled: bool = Field(False, description="train the RFT control beside GRPO's")
    rounds: int = Field(2, ge=1, description="sample-filter-train rounds")
    samples_per_prompt: int | None = Field(
        None, ge=1, description="k completions sampled per prompt (default grpo.num_generations)"
    )
    max_per_prompt: int = Field(
        4, ge=1, description="m: at most this many distinct correct completions kept a prompt"
    )
    epochs: int = Field(1, ge=1, description="passes over a round's kept completions")
    lr: float | None = Field(
        None, gt=0, description="peak learning rate of each round's SFT, annealed over the "
        "round (default sft.control_lr, else sft.lr)",
    )  # fmt: skip


class SFTConfig(Strict):
    enabled: bool = Field(True, description="False: use model.path as the reference as is")
    lr: float = Field(3e-3, gt=0)
    batch_size: int = Field(32, gt=0)
    max_epochs: int = Field(
        300, gt=0, description="a cap only: the validation-loss plateau ends training first"
    )
    eval_every: int = Field(25, gt=0, description="steps between validation losses")
    patience: int = Field(
        4,
        ge=1,
        description="validations without a better loss before the lr is cut (or, "
        "after the last cut, training stops; the best checkpoint is kept)",
    )
    lr_cuts: int = Field(1, ge=0, description="learning-rate cuts before a plateau stops training")
    lr_cut_factor: float = Field(0.3, gt=0, lt=1, description="multiplier of each cut")
    control: Literal["auto", "concurrent", "sequential"] = Field(
        "auto",
        description="the SFT-continued control: beside GRPO, each on half the CPU cores for the "
        "same wall time (concurrent), or after it for GRPO's seconds on the whole device "
        "(sequential); auto: concurrent for one CPU process, sequential on GPUs or several ranks",
    )
    control_steps: int | None = Field(
        None, gt=0, le=10_000_000,
        description="a fixed budget of SFT steps for the control instead of GRPO's wall time, "
        "its learning rate annealed over them; it then runs after GRPO. A wall-time control "
        "moves between runs of one seed; this one gives the same weights every time (e.g. the "
        "sft_continued/steps a run logged)",
    )  # fmt: skip
    control_lr: float | None = Field(
        None, gt=0,
        description="the control's peak learning rate (after sft.warmup_steps, then annealed "
        "over its budget); unset: sft.lr. The reference's last rate (sft.lr x lr_cut_factor per "
        "cut) continues its training where it ended instead of re-warming to where it started",
    )  # fmt: skip
    warmup_steps: int = Field(20, ge=0)
    weight_decay: float = Field(0.0, ge=0)
    max_grad_norm: float = Field(1.0, gt=0, description="gradient clipping of SFT steps")


class DeepSpeedConfig(Strict):
    zero_stage: Literal[0, 1, 2, 3] = 0
    offload_optimizer: bool = False
    nproc: int = Field(1, ge=1, description="ranks on this node (GPUs, or CPU processes)")
    hostfile: str | None = Field(None, description="DeepSpeed hostfile for several nodes")
    master_port: int | None = Field(
        None, gt=1024, lt=65536,
        description="rank 0's rendezvous port; unset: a free port is picked at each launch, so "
        "that two runs on one machine never collide",
    )  # fmt: skip
    timeout_s: int = Field(600, gt=0, description="collective timeout: a dead rank fails others")


def set_label(name: str) -> str:
    """A file-system-safe label for an eval set name or path ('data/my set.jsonl' -> 'my_set')."""
    stem = Path(name.partition(":")[0]).stem if "/" in name or "." in name else name
    return re.sub(r"[^A-Za-z0-9_-]", "_", stem)


class EvalConfig(Strict):
    sets: list[str] = ["synthetic", "synthetic_ood"]
    samples: int = Field(1, ge=1, description="n samples per problem (pass@k, maj@k)")
    pass_k: int = Field(
        0, ge=0, le=64,
        description="besides the greedy completion that gives accuracy, this many completions "
        "per problem of the first eval set sampled at grpo.temperature (the training "
        "distribution) for sampled_pass@k and sampled_maj@k; 0: none. Needs eval.samples 1",
    )  # fmt: skip
    pass_k_limit: int | None = Field(
        None, gt=0,
        description="sampled pass@k on this many problems of the first set, drawn at random "
        "with the run's seed (k samples cost k greedy evaluations); None: all of them. Greedy "
        "accuracy keeps every problem",
    )  # fmt: skip
    temperature: float = Field(1.0, gt=0)
    limit: int | None = Field(None, gt=0)
    batch_size: int = Field(256, gt=0)
    max_new_tokens: int | None = Field(None, gt=0, description="None: max_completion_length")
    few_shot: int = Field(0, ge=0, description="worked SFT examples placed before each prompt")
    untooled: bool = Field(
        False,
        description="with tools: the reference and the trained model are also evaluated "
        "without them (reference_untooled, grpo_untooled), paired on the same problems: what "
        "the tool adds, and what each model does in its head",
    )  # fmt: skip
    workers: int = Field(
        1, ge=1, le=64,
        description="evaluations the pipeline runs at once (each model's sets as parts of "
        "their own, largest first), each in its own process with an equal share of the "
        "threads: on CPU one generation loop a core does more than one loop over every core "
        "(small matmuls, Python between tokens)",
    )  # fmt: skip


class TrackingConfig(Strict):
    tracking_uri: str | None = Field(
        None, description="None: sqlite mlflow.db in the working directory"
    )
    experiment: str = "grpo-tiny"
    registered_model: str = "grpo-tiny-math"
    promotion_metric: str = Field(
        "eval/synthetic/accuracy",
        pattern=r"^eval/[^/]+/accuracy$",
        description="eval/<set>/accuracy: the gate pairs greedy correctness on the same problems",
    )
    promotion_margin: float = Field(
        0.005, ge=0, description="the 95% lower bound of candidate - champion must exceed it"
    )
    promotion: Literal["auto", "approve"] = Field(
        "auto",
        description="auto: the gate alone moves @champion; approve: the flow pauses after the "
        "gate's evidence and a person approves or rejects in the Prefect UI (needs a Prefect "
        "server, e.g. grpo serve)",
    )
    approval_timeout_s: int = Field(
        43200, gt=0, description="approve: no decision within this many seconds is a rejection"
    )

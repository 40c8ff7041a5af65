"""The trained policy as an MLflow model: loadable with mlflow.pyfunc, servable over REST.

Why a pyfunc model whose artifact is the Hugging Face directory, rather than the transformers
flavour: the flavour needs the model object in the logging process (passing a directory
fails on this stack), the directory is kept byte for byte (it is what `grpo evaluate
models:/NAME@ALIAS` reads), and one path serves every size. MLflow still loads the model once
while logging, to check the input example; the GRPO ranks have exited by then. Prediction is
greedy generation, with the model's chat template when the run used one.

    mlflow.pyfunc.load_model("models:/grpo-tiny-math@champion").predict(["12+34="])
    mlflow models serve -m models:/grpo-tiny-math@champion --env-manager local
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import mlflow.pyfunc

POLICY = "policy"  # the artifact key (and folder) of the Hugging Face directory


class PolicyModel(mlflow.pyfunc.PythonModel):
    """Prompts (a list of strings, or a DataFrame with a "prompt" column) -> completions."""

    def load_context(self, context: Any) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        path = context.artifacts[POLICY]
        self.config = dict(context.model_config or {})
        self.tok = AutoTokenizer.from_pretrained(path)
        self.tok.padding_side = "left"
        if self.tok.pad_token_id is None:
            self.tok.pad_token = self.tok.eos_token
        self.model = AutoModelForCausalLM.from_pretrained(path, use_safetensors=True)
        self.model.eval()
        self.tools = None
        if "tools" in self.config:  # trained with tools: answer in episodes that run them
            from grpo.config import Config
            from grpo.models.episodes import Toolbox

            cfg = Config.model_validate(self.config["run_config"])
            self.tools = (cfg, Toolbox(cfg))

    def predict(self, context: Any, model_input: Any, params: dict | None = None) -> list[str]:
        import torch

        if hasattr(model_input, "columns"):  # a DataFrame: the "prompt" column, or the only one
            col = "prompt" if "prompt" in model_input.columns else model_input.columns[0]
            prompts = [str(p) for p in model_input[col]]
        else:
            prompts = [str(p) for p in model_input]
        max_new = int((params or {}).get("max_new_tokens", self.config["max_new_tokens"]))
        if self.tools is not None:
            return self._episodes(prompts, max_new)
        texts = [self._render(p) for p in prompts]
        enc = self.tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
        with torch.no_grad():
            out = self.model.generate(
                **enc, max_new_tokens=max_new, do_sample=False, pad_token_id=self.tok.pad_token_id
            )
        width = enc["input_ids"].shape[1]
        return [self.tok.decode(o[width:], skip_special_tokens=True) for o in out]

    def _episodes(self, prompts: list[str], max_new: int) -> list[str]:
        """Greedy episodes with the tools the policy was trained with; each answer is the
        episode's last model turn (its calls and their results run in between)."""
        import torch

        from grpo.models.episodes import final_answer, run_tool_round
        from grpo.models.loading import eos_token_ids

        cfg, toolbox = self.tools
        rows = [{"id": str(i), "prompt": p} for i, p in enumerate(prompts)]
        with torch.no_grad():
            batch = run_tool_round(self.model, self.tok, cfg, rows, toolbox, torch.device("cpu"),
                                   eos_token_ids(self.tok, self.model), samples=1,
                                   max_tokens=max_new, do_sample=False)  # fmt: skip
        return [final_answer(e) for e in batch.episodes]

    def _render(self, problem: str) -> str:
        if not self.config.get("chat_template"):
            return problem
        messages = [
            {"role": "system", "content": self.config["system_prompt"]},
            {"role": "user", "content": problem},
        ]
        return self.tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def log_policy(
    run_id: str, policy_dir: Path, model_config: dict[str, Any], name: str = "model",
    step: int | None = None,
) -> str:  # fmt: skip
    """Log policy_dir as a pyfunc model (an MLflow 3 logged model) of the run, at its training
    step; returns its model URI (models:/m-...)."""
    import importlib.metadata as md

    import mlflow
    from mlflow.models import infer_signature

    example = ["12+34="]
    output = ["<think>4+2=6 1+3=4</think><answer>46</answer>"]
    params = {"max_new_tokens": model_config["max_new_tokens"]}
    signature = infer_signature(example, output, params=params)
    reqs = [f"{p}=={md.version(p)}" for p in ("mlflow", "torch", "transformers", "safetensors")]
    with mlflow.start_run(run_id=run_id):
        info = mlflow.pyfunc.log_model(
            name=name,
            step=step or 0,
            python_model=PolicyModel(),
            artifacts={POLICY: str(policy_dir)},
            code_paths=[str(Path(__file__).parent)],  # this package, for an isolated env
            model_config=model_config,
            signature=signature,
            input_example=example,
            pip_requirements=reqs,
        )
    return info.model_uri


def log_checkpoint_models(
    client: Any, run_id: str, out: Path, rows: list[dict[str, Any]], model_config: dict[str, Any],
    final: tuple[int, str], dataset: tuple[str, str],
) -> list[dict[str, Any]]:  # fmt: skip
    """The evaluated checkpoints (the run's snapshots/, grpo.checkpoint_models) as logged models
    of the run, each with its step, and every evaluated model's in-run accuracy (on the
    selection split when the run has one: grpo.eval.selection.curve_key) linked to it
    (model_id, the in-run set as the dataset) so that the experiment's Models tab lists them
    with it. `final` is the run's own model (step, URI), logged already: linked, not logged
    again. Returns [{step, model_uri, accuracy}] in step order."""
    from grpo.engine.run_files import SNAPSHOTS
    from grpo.eval.selection import CHECKPOINT_KEYS, curve_key

    key = curve_key(rows)
    accuracy = {r["step"]: r[key] for r in rows if key in r}
    models = []
    for snap in sorted((out / SNAPSHOTS).glob("step-*")):
        step = int(snap.name.removeprefix("step-"))
        uri = log_policy(run_id, snap, model_config, name=f"checkpoint-{step}", step=step)
        models.append({"step": step, "model_uri": uri, "accuracy": accuracy.get(step)})
    models.append({"step": final[0], "model_uri": final[1], "accuracy": accuracy.get(final[0])})
    for m in models:
        if m["accuracy"] is not None:
            client.log_metric(
                run_id, CHECKPOINT_KEYS[key], m["accuracy"], step=m["step"],
                model_id=m["model_uri"].removeprefix("models:/"), dataset_name=dataset[0],
                dataset_digest=dataset[1],
            )  # fmt: skip
    return models


def policy_dir_of(downloaded: Path) -> Path:
    """The Hugging Face directory inside a downloaded MLflow model (MLmodel says where), or
    the directory itself when it is one already."""
    import yaml

    mlmodel = downloaded / "MLmodel"
    if not mlmodel.is_file():
        return downloaded
    flavor = yaml.safe_load(mlmodel.read_text())["flavors"]["python_function"]
    return downloaded / flavor["artifacts"][POLICY]["path"]

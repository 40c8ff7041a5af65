"""Small configs shared by the slow tests: the real code paths on a very small model."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from pathlib import Path

from grpo.config import Config, load_config

ROOT = Path(__file__).resolve().parents[1]

SMALL = [
    "model.tiny.hidden_size=32",
    "model.tiny.num_layers=2",
    "model.tiny.num_heads=2",
    "model.tiny.num_kv_heads=1",
    "model.tiny.intermediate_size=64",
    "data.num_sft=64",
    "data.num_sft_val=16",
    "data.num_train=64",
    "data.num_heldout=24",
    "data.num_heldout_ood=12",
    "sft.max_epochs=2",
    "sft.eval_every=2",
    "grpo.steps=2",
    "grpo.prompts_per_step=2",
    "grpo.num_generations=4",
    "grpo.max_completion_length=24",
    "grpo.eval_every=0",
    "grpo.checkpoint_every=1",
]


def small_config(tmp: Path, *extra: str) -> Config:
    return load_config(ROOT / "configs" / "tiny.yaml", [*SMALL, f"output_dir={tmp}", *extra])


def kill_after(step: int, pid: Callable[[], int]) -> Callable[[int, int, bool], None]:
    """A trainer's on_step callback that SIGKILLs the process pid() once `step` steps are done
    (a sampler or engine process dying in the middle of a run)."""
    import signal

    def on_step(done: int, _steps: int, _finished: bool) -> None:
        if done == step:
            os.kill(pid(), signal.SIGKILL)

    return on_step


def fixed_rollout(tok, completions: list[str], prompt: str = "12+34=", group_size=None):  # noqa: ANN201
    """A Rollout of given completion texts (right-padded, each ending with EOS) after one prompt.

    Lets a test drive the update on known completions instead of sampled ones. One group of all
    completions unless group_size says otherwise.
    """
    import torch

    from grpo.models.generate import Rollout

    p = tok([prompt] * len(completions), return_tensors="pt", add_special_tokens=False)
    seqs = [tok(x, add_special_tokens=False)["input_ids"] + [tok.eos_token_id] for x in completions]
    ids = torch.full((len(seqs), max(map(len, seqs))), tok.pad_token_id)
    mask = torch.zeros_like(ids)
    for i, s in enumerate(seqs):
        ids[i, : len(s)], mask[i, : len(s)] = torch.tensor(s), 1
    no_trunc = torch.zeros(len(seqs), dtype=torch.bool)
    return Rollout(
        p["input_ids"], p["attention_mask"], ids, mask, no_trunc, torch.zeros(ids.shape),
        group_size or len(completions),
    )  # fmt: skip


def per_token(adv, ro):  # noqa: ANN201
    """Outcome advantages [N] broadcast over the rollout's completion tokens [N, C], as the
    scoring step does."""
    return adv.unsqueeze(1).expand(ro.completion_ids.shape)


@contextlib.contextmanager
def tracking_uri(uri: str) -> Iterator[str]:
    """MLFLOW_TRACKING_URI set to uri for the block, the previous value restored after."""
    old = os.environ.get("MLFLOW_TRACKING_URI")
    os.environ["MLFLOW_TRACKING_URI"] = uri
    try:
        yield uri
    finally:
        if old is None:
            os.environ.pop("MLFLOW_TRACKING_URI", None)
        else:
            os.environ["MLFLOW_TRACKING_URI"] = old


def by_stage(runs: list) -> dict:  # noqa: ANN201
    """A pipeline's stage runs by their stage (the `stage` tag): their names carry the
    pipeline's name (`<parent name>/grpo`)."""
    return {r.data.tags["stage"]: r for r in runs if "stage" in r.data.tags}


def new_experiment(client, uri: str, name: str) -> str:  # noqa: ANN001
    """An experiment of a test's own store whose artifacts stay beside that store, as the
    pipeline's do, not in the project's ./mlruns (MLflow's default for a sqlite store)."""
    from tasks.tracking import artifact_location

    return client.create_experiment(name, artifact_location=artifact_location(uri))


def perturbed_model(model: Path, out: Path) -> Path:
    """The model with its weights moved: another model, with other greedy completions (an
    untrained tiny model of another seed repeats the same token as this one)."""
    import torch

    from grpo.models.loading import load_model, load_tokenizer, save_model_dir

    m = load_model(model, trainable=False)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in m.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.5)
    return save_model_dir(m, load_tokenizer(model), out)

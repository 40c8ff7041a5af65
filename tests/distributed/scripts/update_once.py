"""One GRPO update on a fixed global batch, this rank's share of it; saves the policy.

Run as one process or as ranks (grpo.launch.runner.launches); the test compares the saved weights.
Arguments: one or more (config, base model, output directory) triples, each a fresh Trainer
from its base, one after the other in the same process group (the ranks' start-up, most of a
launch's time, is paid once for all of them). Rank 0 also saves the whole gradient as the
optimizer step sees it (grads.safetensors): Adam's step hardly depends on a gradient's scale,
so equal weights after one step cannot show a gradient off by the world size.
"""

import sys
from pathlib import Path

import torch
from deepspeed.utils import safe_get_full_grad
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from grpo.config import load_config  # noqa: E402
from grpo.engine.deepspeed_setup import save_policy  # noqa: E402
from grpo.engine.distributed import finish_distributed  # noqa: E402
from grpo.engine.loop import Trainer  # noqa: E402
from tests.helpers import fixed_rollout, per_token  # noqa: E402


def main() -> None:
    # the launcher adds --local_rank=N
    args = [a for a in sys.argv[1:] if not a.startswith("--local_rank")]
    for i in range(0, len(args), 3):
        update_once(*args[i : i + 3])
    finish_distributed()  # as the worker does: a rank exiting with the group alive can abort


def update_once(cfg_path: str, base: str, out: str) -> None:
    cfg = load_config(cfg_path)
    t = Trainer(cfg, base, Path(out) / "work")
    texts = ["<think>1</think><answer>46</answer>", "<answer>4</answer>", "46", "<think>9+9"] * 2
    g = torch.Generator().manual_seed(0)
    adv = torch.randn(len(texts), generator=g)  # [N] global advantages
    # zero advantages are skipped (exact, beta = 0 + dapo): one skipped row on rank 0 and every
    # row of rank 1, which then makes only zero-gradient backward calls
    adv[1] = 0.0
    adv[4:] = 0.0
    n = len(texts) // t.world
    ro = fixed_rollout(t.tok, texts, group_size=n)  # each rank's share is whole groups
    mine = torch.arange(t.rank * n, (t.rank + 1) * n)
    share = ro.select(mine)
    grads: dict[str, torch.Tensor] = {}
    step = t.engine.step

    def step_after_saving_grads() -> None:
        if t.engine.is_gradient_accumulation_boundary():  # collective under ZeRO: every rank
            for name, p in t.engine.module.named_parameters():
                g = safe_get_full_grad(p)  # None for a frozen weight (LoRA's base)
                if g is not None:
                    grads[name] = g.detach().clone()
        step()

    t.engine.step = step_after_saving_grads
    t.update(share, per_token(adv[mine], share), None)
    if t.rank == 0:
        save_file(grads, str(Path(out) / "grads.safetensors"))
    save_policy(t.engine, t.tok, Path(out) / "policy", t.rank, cfg.deepspeed.zero_stage)


if __name__ == "__main__":
    main()

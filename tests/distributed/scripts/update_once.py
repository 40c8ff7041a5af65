"""One GRPO update on a fixed global batch, this rank's share of it; saves the policy.

Run as one process or under the DeepSpeed launcher; the test compares the saved weights.
"""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from grpo.config import load_config  # noqa: E402
from grpo.distributed import save_policy  # noqa: E402
from grpo.rollout import Rollout  # noqa: E402
from grpo.trainer import Trainer  # noqa: E402


def main() -> None:
    # the launcher adds --local_rank=N
    cfg_path, base, out = [a for a in sys.argv[1:] if not a.startswith("--local_rank")]
    cfg = load_config(cfg_path)
    t = Trainer(cfg, base, Path(out) / "work")
    texts = ["<think>1</think><answer>46</answer>", "<answer>4</answer>", "46", "<think>9+9"] * 2
    g = torch.Generator().manual_seed(0)
    adv = torch.randn(len(texts), generator=g)  # [N] global advantages
    tok = t.tok
    seqs = [tok(x, add_special_tokens=False)["input_ids"] + [tok.eos_token_id] for x in texts]
    width = max(map(len, seqs))
    ids = torch.full((len(seqs), width), tok.pad_token_id)
    mask = torch.zeros_like(ids)
    for i, s in enumerate(seqs):
        ids[i, : len(s)], mask[i, : len(s)] = torch.tensor(s), 1
    p = tok(["12+34="] * len(texts), return_tensors="pt", add_special_tokens=False)
    ro = Rollout(p["input_ids"], p["attention_mask"], ids, mask,
                 torch.zeros(len(texts), dtype=torch.bool), torch.zeros(ids.shape))  # fmt: skip
    n = len(texts) // t.world
    mine = torch.arange(t.rank * n, (t.rank + 1) * n)
    t.update(ro.select(mine), adv[mine], None)
    save_policy(t.engine, t.tok, Path(out) / "policy", t.rank, cfg.deepspeed.zero_stage)


if __name__ == "__main__":
    main()

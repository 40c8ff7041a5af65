"""Fingerprint of a short GRPO run: did a refactor change any number?

Trains `--steps` GRPO steps from one fixed reference with `grpo train` and prints the sha256 of
the final weights (every tensor), of the step metrics without their timings, and of the logged
completions. Two checkouts that print the same lines train bit-identically. Usage:

    python benchmarks/refactor_check.py --policy runs/tiny/sft/<key> --out /tmp/a [--set k=v ...]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
from pathlib import Path

TIMED = ("time/", "step_time", "tokens_per_second", "completions_per_second")


def fingerprint(out: Path) -> dict[str, str]:
    from safetensors.torch import load_file

    tensors = load_file(str(out / "policy" / "model.safetensors"))
    w = hashlib.sha256()
    for k in sorted(tensors):
        w.update(k.encode() + tensors[k].float().numpy().tobytes())
    rows = [json.loads(x) for x in (out / "metrics.jsonl").open()]
    metrics = [{k: v for k, v in r.items() if not k.startswith(TIMED)} for r in rows]
    comp = (out / "completions.jsonl").read_bytes()
    return {
        "weights": w.hexdigest()[:16],
        "metrics": hashlib.sha256(json.dumps(metrics, sort_keys=True).encode()).hexdigest()[:16],
        "completions": hashlib.sha256(comp).hexdigest()[:16],
        "final_reward": f"{metrics[-1]['reward']:.6f}",
        "final_loss": f"{metrics[-1]['loss']:.9f}",
    }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--policy", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--set", action="append", default=[])
    a = p.parse_args()
    sets = [f"grpo.steps={a.steps}", "grpo.log_completions_every=1", *a.set]
    cmd = [sys.executable, "-m", "cli.main", "train", "--policy", a.policy, "--out", a.out]
    for s in sets:
        cmd += ["--set", s]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    print(json.dumps({"sets": a.set, **fingerprint(Path(a.out))}))


if __name__ == "__main__":
    main()

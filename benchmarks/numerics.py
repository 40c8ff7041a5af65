"""Which CPU kernels a seed's numbers depend on, and what pinning them costs.

The same seed gave other numbers on another x86-64 CPU (issue #24): torch picks its vectorised
kernels by instruction set (ATEN_CPU_CAPABILITY), MKL its matmul code path (MKL_CBWR), oneDNN
its ISA (ONEDNN_MAX_CPU_ISA). For each variant of the environment this script builds an SFT
reference for a fixed number of steps (`grpo sft --force`, no plateau stop) and trains GRPO steps
from it (`grpo train`), timing both (the stages' own seconds) and hashing the weights. Variants
run interleaved, `--repeats` times, medians reported beside the native kernels'.

A variant whose hash differs from the native one changed the kernels on this CPU; two repeats of
one variant with one hash show it is deterministic. Usage:

    python benchmarks/numerics.py --work /tmp/numerics --report benchmarks/NUMERICS.md
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

PINNED = ("MKL_CBWR", "ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA")


def native_capability() -> str:
    """The instruction set torch picks on this CPU when nothing pins it (AVX512, AVX2, ...)."""
    env = {k: v for k, v in os.environ.items() if k not in PINNED}
    probe = [sys.executable, "-c", "import torch; print(torch.backends.cpu.get_cpu_capability())"]
    return subprocess.run(probe, env=env, capture_output=True, text=True).stdout.strip()


def variants(native: str) -> dict[str, dict[str, str]]:
    """Each environment measured. The project pins AVX2 itself when a variable is unset
    (grpo.launch.environment), so the native kernels are asked for by name."""
    free = {"ATEN_CPU_CAPABILITY": native.lower(), "MKL_CBWR": "AUTO"}
    return {
        f"native ({native})": free,
        "MKL_CBWR=AVX2": {**free, "MKL_CBWR": "AVX2"},
        "ATEN_CPU_CAPABILITY=avx2": {**free, "ATEN_CPU_CAPABILITY": "avx2"},
        "ONEDNN_MAX_CPU_ISA=AVX2": {**free, "ONEDNN_MAX_CPU_ISA": "AVX2"},
        "all three (AVX2)": {"MKL_CBWR": "AVX2", "ATEN_CPU_CAPABILITY": "avx2",
                             "ONEDNN_MAX_CPU_ISA": "AVX2"},
        # what grpo.launch.environment pins when nothing is set
        "the project's default (ATEN avx2, MKL AVX2)": {"MKL_CBWR": "AVX2",
                                                        "ATEN_CPU_CAPABILITY": "avx2"},
        # MKL's vendor-neutral branch (SSE2 code, documented to agree on Intel and non-Intel
        # CPUs): the candidate where the AVX2 branch differs between vendors
        "ATEN avx2, MKL COMPATIBLE": {"MKL_CBWR": "COMPATIBLE", "ATEN_CPU_CAPABILITY": "avx2"},
    }  # fmt: skip


def weights_hash(path: Path) -> str:
    from safetensors.torch import load_file

    tensors = load_file(str(path))
    h = hashlib.sha256()
    for k in sorted(tensors):
        h.update(k.encode() + tensors[k].float().numpy().tobytes())
    return h.hexdigest()[:12]


def run(cmd: list[str], env: dict[str, str]) -> None:
    out = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if out.returncode:
        sys.exit(f"{' '.join(cmd[:4])} failed:\n{out.stderr[-2000:]}")


def one(work: Path, name: str, extra: dict[str, str], a: argparse.Namespace) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in PINNED}
    env.update(extra)
    sets = [f"output_dir={work}", f"sft.max_epochs={a.sft_epochs}", "sft.patience=100000",
            f"grpo.steps={a.grpo_steps}", "grpo.eval_every=0", *a.set]  # fmt: skip
    flags = [x for s in sets for x in ("--set", s)]
    cli = [sys.executable, "-m", "cli.main"]
    run([*cli, "sft", "--force", *flags], env)
    (ref,) = [p.parent for p in work.glob("sft/*/model.safetensors")]
    sft = json.loads((ref / "sft_summary.json").read_text())
    run([*cli, "train", "--policy", str(ref), "--out", str(work / "grpo"), *flags], env)
    grpo = json.loads((work / "grpo" / "train_summary.json").read_text())
    probe = [sys.executable, "-c", "import torch; print(torch.backends.cpu.get_cpu_capability())"]
    isa = subprocess.run(probe, env=env, capture_output=True, text=True).stdout.strip()
    return {"variant": name, "isa": isa, "sft_s": sft["seconds"], "sft_steps": sft["steps"],
            "grpo_s": grpo["seconds"], "sft_hash": weights_hash(ref / "model.safetensors"),
            "grpo_hash": weights_hash(work / "grpo" / "policy" / "model.safetensors")}  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--work", required=True, help="scratch directory (models, runs)")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--sft-epochs", type=int, default=20, help="SFT epochs (about 10 steps each)")
    p.add_argument("--grpo-steps", type=int, default=10)
    p.add_argument("--set", action="append", default=[], help="more config overrides")
    p.add_argument("--report", help="write the markdown table here too")
    p.add_argument("--only", action="append", default=[],
                   help="run only the variants whose name contains this (repeatable)")  # fmt: skip
    a = p.parse_args()
    rows, todo = [], variants(native_capability())
    if a.only:  # the first one left is the baseline of the time and "same as" columns
        todo = {k: v for k, v in todo.items() if any(o in k for o in a.only)}
    for r in range(a.repeats):
        for i, (name, extra) in enumerate(todo.items()):
            t = time.time()
            rows.append(one(Path(a.work) / f"v{i}-r{r}", name, extra, a))
            print(json.dumps(rows[-1]), f"({time.time() - t:.0f}s)", flush=True)
    base = [x for x in rows if x["variant"] == next(iter(todo))]
    base_sft = statistics.median(x["sft_s"] for x in base)
    base_grpo = statistics.median(x["grpo_s"] for x in base)
    lines = [
        "| variant | torch ISA | SFT s (median) | GRPO s (median) | time vs first row "
        "| SFT weights | GRPO weights | same as first row | repeats agree |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name in todo:
        mine = [x for x in rows if x["variant"] == name]
        sft_s = statistics.median(x["sft_s"] for x in mine)
        grpo_s = statistics.median(x["grpo_s"] for x in mine)
        ratio = (sft_s + grpo_s) / (base_sft + base_grpo)
        hashes = {(x["sft_hash"], x["grpo_hash"]) for x in mine}
        same = hashes == {(base[0]["sft_hash"], base[0]["grpo_hash"])}
        lines.append(
            f"| {name} | {mine[0]['isa']} | {sft_s:.1f} | {grpo_s:.1f} | {ratio:.3f}x "
            f"| {mine[0]['sft_hash']} | {mine[0]['grpo_hash']} | {'yes' if same else 'no'} "
            f"| {'yes' if len(hashes) == 1 else 'no'} |"
        )
    table = "\n".join(lines)
    print(table)
    if a.report:
        Path(a.report).write_text(table + "\n")


if __name__ == "__main__":
    main()

"""How long the pipeline's data validation takes on a large training file.

Writes a JSONL file of N arithmetic rows (prompt, integer answer), then runs the validation
stage (tasks.validation.validate_datasets: parsing, token counts, the Great Expectations suites,
Data Docs) on it as the training set, in a fresh process each time, and prints the wall seconds
of each run and their median. Usage:

    python benchmarks/validation_scale.py --rows 1000000 --repeat 2 --work /tmp/valscale
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

RUN = """
import sys, time
sys.path.insert(0, {root!r})
from grpo.config import load_config
from tasks.validation import validate_datasets
cfg = load_config(None, ["data.task=files", "data.train_path={data}", "sft.enabled=false",
                         "model.path={model}", "output_dir={work}"])
t = time.perf_counter()
validate_datasets(cfg, __import__("pathlib").Path({work!r}) / "docs")
print("inner", time.perf_counter() - t)
"""


def write_rows(path: Path, n: int) -> None:
    r = random.Random(0)
    with path.open("w") as f:
        for i in range(n):
            a, b = r.randint(0, 10**6), r.randint(0, 10**6)
            f.write(json.dumps({"id": f"r{i}", "prompt": f"{a}+{b}=", "answer": str(a + b)}) + "\n")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=1_000_000)
    p.add_argument("--repeat", type=int, default=2)
    p.add_argument("--work", type=Path, default=Path("/tmp/valscale"))
    a = p.parse_args()
    a.work.mkdir(parents=True, exist_ok=True)
    data = a.work / f"train_{a.rows}.jsonl"
    if not data.exists():
        write_rows(data, a.rows)
    sys.path.insert(0, str(ROOT))
    from grpo.config import load_config
    from grpo.launch.paths import base_model_dir

    model = base_model_dir(load_config(None, [f"output_dir={a.work}"]))
    walls = []
    for _ in range(a.repeat):
        code = RUN.format(root=str(ROOT), data=data, model=model, work=str(a.work))
        t0 = time.perf_counter()
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
        walls.append(time.perf_counter() - t0)
        if out.returncode != 0:
            sys.exit(out.stderr[-3000:])
        inner = [ln for ln in out.stdout.splitlines() if ln.startswith("inner")][-1]
        print(f"{a.rows:,} rows: {walls[-1]:.1f} s wall (process start included), "
              f"validate_datasets {float(inner.split()[1]):.1f} s")  # fmt: skip
    print(f"median wall {statistics.median(walls):.1f} s over {len(walls)} runs")


if __name__ == "__main__":
    main()

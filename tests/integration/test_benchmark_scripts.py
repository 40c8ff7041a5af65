"""The prepared benchmark scripts still run (on the CPU, with tiny shapes)."""

import json
import os
import subprocess
import sys

import pytest

from tests.helpers import ROOT

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("lora", [[], ["--lora", "4"]])
def test_gpu_check_runs_on_the_cpu(tmp_path, lora):
    out = tmp_path / "gpu.md"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), "--smoke", "--out", str(out),
         *lora],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(proc.stdout[proc.stdout.index("{") :])
    for engine in ("fast", "hf"):
        e = result["engines"][engine]
        assert e["tokens_per_s"] > 0
        assert e["logp_gap_max"] < 1e-4  # fp32 on the CPU: both engines agree with the forward
    assert result["update"]["grad_norm"] > 0
    # the async estimate is the picked engine's sampling plus the update, against the longer
    x = result["async_split"]
    sample_s, update_s = result["engines"][x["engine"]]["seconds"], result["update"]["seconds"]
    assert x["sync_step_s"] == pytest.approx(sample_s + update_s, abs=0.01)
    assert x["split_step_s"] == pytest.approx(max(sample_s, update_s), abs=0.01)
    assert "| fast |" in out.read_text() and "| hf |" in out.read_text()
    # LoRA: the fast sampler merged the adapters, which moved off zero (else the gap check
    # would pass on the base model's weights)
    assert (result["lora_r"] == 4) == bool(lora)
    assert (result["trainable"] < result["params_M"] * 1e6 / 2) == bool(lora)


def test_process_vs_outcome_runs_and_reports(tmp_path):
    """The three-way comparison on a tiny model for 2 steps: a table row per variant and the
    control, paired differences, the plot."""
    from grpo.launch.paths import base_model_dir
    from tests.helpers import SMALL, small_config

    ref = base_model_dir(small_config(tmp_path))
    sets = [x for s in SMALL if not s.startswith("deepspeed") for x in ("--set", s)]
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "process_vs_outcome.py"), "--reference",
         str(ref), "--variant", "outcome=", "--variant",
         "process=grpo.advantage_mode=process;grpo.process_outcome_weight=0.5", *sets,
         "--set", f"output_dir={tmp_path}",
         "--out", str(tmp_path / "out"), "--report-dir", str(tmp_path)],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = (tmp_path / "PROCESS.md").read_text()
    for name in ("| outcome |", "| process |", "| sft_continued |"):
        assert name in report
    assert (tmp_path / "process_curves.png").stat().st_size > 10_000
    rows = [json.loads(x) for x in (tmp_path / "out" / "results.jsonl").open()]
    assert "synthetic_vs_outcome" in rows[1] and rows[2]["seconds"] == rows[0]["seconds"]


def test_utilization_counts_the_matmuls_of_both_phases(tmp_path):
    """On the default model at a quarter of its batch (8 prompts x 8): enough matmul work
    (several GFLOP a phase) for the report's rounded cells to check its arithmetic."""
    import yaml

    out, config = tmp_path / "util.md", tmp_path / "util.yaml"
    config.write_text(yaml.safe_dump({"grpo": {"prompts_per_step": 8}}))
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "utilization.py"), "--repeats", "1",
         "--config", str(config), "--out", str(out)],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    import re

    from grpo.config import load_config

    text = out.read_text()
    rows = {line.split("|")[1].strip(): line.split("|") for line in text.splitlines()
            if line.startswith("| sampling") or line.startswith("| update")}  # fmt: skip
    assert set(rows) == {"sampling", "update"}
    # the counted FLOPs against a count by hand from the model's shape: every completion token
    # passes each block's linears (q, k, v, o, gate, up, down) forward when sampled, and
    # forward and backward (3x) in the update; prompts and attention only add to that. A
    # counter that missed addmm or linear, or counted m k n without the 2, falls below.
    t = load_config(None).model.tiny
    kv = t.hidden_size // t.num_heads * t.num_kv_heads
    per_block = 2 * t.hidden_size * t.hidden_size + 2 * t.hidden_size * kv
    per_block += 3 * t.hidden_size * t.intermediate_size
    linear = per_block * t.num_layers
    tokens = float(re.search(r"about ([0-9.]+) completion tokens", text).group(1))
    floor = {"sampling": 2 * linear * tokens / 1e9, "update": 6 * linear * tokens / 1e9}
    for phase, cells in rows.items():
        gflop, calls = float(cells[3]), int(cells[4].split()[0])
        assert calls > 0
        assert floor[phase] <= gflop <= 4 * floor[phase] + 0.5, (phase, gflop, floor[phase])


def test_the_engine_benchmark_compares_every_engine_and_loop(tmp_path):
    pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed")
    out = tmp_path / "engine.md"
    small = ["grpo.prompts_per_step=2", "grpo.num_generations=2", "grpo.max_completion_length=8",
             "model.tiny.num_layers=1", "data.num_sft=16", "data.num_sft_val=8"]  # fmt: skip
    scratch = tmp_path / "tmp"  # its runs' temporary directory, which it must remove
    scratch.mkdir()
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "engine.py"), "--repeats", "1", "--steps",
         "1", "--out", str(out), *[x for s in small for x in ("--set", s)]],
        capture_output=True, text=True, timeout=300, env={**os.environ, "TMPDIR": str(scratch)},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert not list(scratch.glob("grpo-engine-*"))
    raw = json.loads(proc.stdout[proc.stdout.index("raw: ") + 5 :].splitlines()[0])
    assert set(raw["speed"]) == {"fast", "hf", "llama_cpp float32", "llama_cpp float16"}
    assert all(v[0] > 0 for v in raw["speed"].values())
    assert set(raw["loops"]) == {"policy (fast), sync", "llama_cpp float32, sync",
                                 "llama_cpp float32, async"}  # fmt: skip
    text = out.read_text()
    assert "| fast | " in text and " 1.00x |" in text and "| float16 |" in text


def test_the_calculator_rule_moves_its_demonstrations_the_way_it_failed():
    # tools_headroom.next_demos's doctests: the benchmarks folder is outside pytest's testpaths
    proc = subprocess.run([sys.executable, "-m", "doctest", "tools_headroom.py"],
                          cwd=ROOT / "benchmarks", capture_output=True, text=True,
                          timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]

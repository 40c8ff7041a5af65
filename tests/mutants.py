"""Each strengthened test against a deliberately broken copy of the code: every one must fail.

    .venv/bin/python tests/mutants.py [INDEX ...]

For each mutant: a git worktree of HEAD, one edit that breaks what the test is named for, the
test run on that copy (one process). Prints one line per mutant: "killed" when the test failed
as it must, "SURVIVED" when it passed (the test checks less than its name says).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
INT = "tests/integration/"
LORA = INT + "test_lora_training.py::"
MUTANTS = [
    ("@champion set against the gate's decision", "tasks/registry.py",
     '    if promoted:\n        c.set_registered_model_alias(name, "champion"',
     '    if not promoted:\n        c.set_registered_model_alias(name, "champion"',
     INT + "test_pipeline.py::test_end_to_end_logs_registers_and_loads"),
    ("only the first EOS id ends the mask", "grpo/models/generate.py",
     "torch.tensor(eos_ids, device=ids.device).view(-1))",
     "torch.tensor(eos_ids, device=ids.device).view(-1)[:1])",
     INT + "test_real_model_path.py::test_both_engines_stop_at_either_eos_id_and_never_past_it"),
    ("credentials matched by substring (drops eval.max_new_tokens)", "tasks/tracking/params.py",
     "return any(w in SECRET_WORDS for w in words)",
     "return any(w in key.lower().rsplit('.', 1)[-1] for w in SECRET_WORDS)",
     INT + "test_resume.py::test_secrets_never_become_mlflow_params"),
    ("a non-finite loss reaches backward", "grpo/engine/update.py",
     "                loss = _zero_gradient_loss(engine, g, plan, ro, mask, adv, ref_logps, "
     "num_items)\n"
     "            engine.backward",
     "            engine.backward",
     INT + "test_faults.py::test_non_finite_loss_is_skipped_or_stops_keeping_the_checkpoint"),
    ("reward means over n - 1", "grpo/engine/rollout_metrics.py",
     'out[f"rewards/{name}/mean"] = s / c', 'out[f"rewards/{name}/mean"] = s / max(c - 1, 1)',
     INT + "test_trl_compat.py::test_trl_doc_functions_get_trls_arguments_on_plain_prompts"),
    ("the control's mode in the SFT cache key", "grpo/launch/paths.py",
     'keyed = cfg.model_copy(update={"sft": cfg.sft.model_copy(update={"control": "auto"})})',
     "keyed = cfg",
     INT + "test_install.py::test_wheel_and_source_pipelines_share_a_fresh_store"),
    ("the fast sampler ignores LoRA adapters", "grpo/models/lora.py",
     "    if module.disable_adapters or module.merged:\n        return w",
     "    if True:\n        return w",
     "tests/unit/test_lora.py::test_sampling_the_adapted_policy_matches_its_teacher_forced_forward"),
    ("a LoRA reference with its adapters on", "grpo/engine/reference.py",
     "            with lora.adapters_off(self.model):\n"
     "                return self._logps(ro, micro)",
     "            return self._logps(ro, micro)",
     LORA + "test_lora_update_moves_only_adapters_and_the_reference_stays_the_base"),
    ("LoRA checkpoints hold the frozen base", "grpo/engine/checkpoint.py",
     "    return any(not p.requires_grad for p in module.parameters())", "    return False",
     LORA + "test_lora_run_resumes_bit_identically_and_saves_merged_model_and_adapter"),
 ("the training forward reads each token's own position", "grpo/models/forward.py",
     "    return packed, attn, rows, cols, prompt_mask.sum(1)[rows] + cols - 1",
     "    return packed, attn, rows, cols, prompt_mask.sum(1)[rows] + cols",
     "tests/unit/test_forward.py::test_buckets_and_chunked_head_match_one_padded_forward"),
    ("the update's LM head runs on every position", "grpo/models/forward.py",
     '    inner = model._modules.get("module") if isinstance(model, torch.nn.Module) else None',
     "    inner = None",
     INT + "test_trainer.py::test_one_grpo_update_raises_the_rewarded_completion"),
    ("ranks import mlflow with DeepSpeed", "grpo/launch/environment.py",
     '    sys.modules["mlflow"] = None  # type: ignore[assignment]\n', "",
     "tests/unit/test_environment.py::test_a_rank_imports_deepspeed_without_mlflow_and_can_still_"
     "import_it"),
    ("a GGUF conversion leaves gguf's reader cached", "grpo/models/gguf.py",
     "        gguf.GGUFReader, gguf.get_tensor_name_map = reader, name_map", "        pass",
     "tests/unit/test_gguf.py::test_a_conversion_parses_the_file_once_and_puts_gguf_back_however_"
     "it_ends"),
]  # fmt: skip


def run(index: int) -> str:
    what, path, old, new, test = MUTANTS[index]
    copy = Path(tempfile.mkdtemp(prefix="grpo-mutant-")) / "tree"
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "-q", "--detach", str(copy)],
                   check=True)  # fmt: skip
    try:
        src = (copy / path).read_text()
        if src.count(old) != 1:
            return f"[{index}] {what}: the code to break is no longer there ({path})"
        (copy / path).write_text(src.replace(old, new))
        env = {**os.environ, "PYTHONPATH": str(copy)}
        cmd = [sys.executable, "-m", "pytest", "-q", "-n", "0", "-x", "-p", "no:randomly", test]
        out = subprocess.run(cmd, cwd=copy, env=env, capture_output=True, text=True)
        verdict = (
            "killed"
            if out.returncode == 1
            else ("SURVIVED" if out.returncode == 0 else f"error (exit {out.returncode})")
        )
        return f"[{index}] {what}: {verdict} ({test.split('::')[1]})"
    finally:
        subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(copy)])
        shutil.rmtree(copy.parent, ignore_errors=True)


def main() -> None:
    picked = [int(a) for a in sys.argv[1:]] or range(len(MUTANTS))
    for i in picked:
        print(run(i), flush=True)


if __name__ == "__main__":
    main()

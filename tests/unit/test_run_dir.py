"""The guard on GRPO run directories (grpo.launch.run_dir), on files laid out as a run
leaves them."""

import json

import pytest

from grpo.launch.run_dir import RunDirError, prepare_run_dir
from tests.helpers import small_config


def _a_run(out, steps: int, ckpt: int | None) -> None:
    out.mkdir(parents=True)
    (out / "metrics.jsonl").write_text("".join(json.dumps({"step": s}) + "\n"
                                               for s in range(1, steps + 1)))  # fmt: skip
    if ckpt is not None:
        (out / "checkpoints" / f"step{ckpt:07d}").mkdir(parents=True)
        (out / "checkpoints" / "latest").write_text(f"step{ckpt:07d}")


def test_a_new_or_empty_directory_needs_no_flag(tmp_path):
    cfg = small_config(tmp_path)
    prepare_run_dir(tmp_path / "new", cfg, resume=False, overwrite=False)
    (tmp_path / "empty").mkdir()
    prepare_run_dir(tmp_path / "empty", cfg, resume=False, overwrite=False)


def test_an_existing_run_is_refused_then_deleted_only_with_overwrite(tmp_path):
    cfg, out = small_config(tmp_path), tmp_path / "run"
    _a_run(out, steps=4, ckpt=4)
    (out / "notes.txt").write_text("mine")
    with pytest.raises(RunDirError, match="4 steps logged, last checkpoint at step 4"):
        prepare_run_dir(out, cfg, resume=False, overwrite=False)
    with pytest.raises(RunDirError, match="choose one"):
        prepare_run_dir(out, cfg, resume=True, overwrite=True)
    assert (out / "metrics.jsonl").exists()
    prepare_run_dir(out, cfg, resume=False, overwrite=True)
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt"]  # only the run's own files


def test_resume_wants_metrics_that_reach_the_checkpoint(tmp_path):
    cfg, out = small_config(tmp_path), tmp_path / "run"
    _a_run(out, steps=5, ckpt=4)  # killed after step 5, before its checkpoint: resumable
    prepare_run_dir(out, cfg, resume=True, overwrite=False)
    (out / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2}\n')
    with pytest.raises(RunDirError, match=r"step 4 but metrics.jsonl holds steps 1\.\.2"):
        prepare_run_dir(out, cfg, resume=True, overwrite=False)
    (out / "metrics.jsonl").write_text("".join(f'{{"step": {s}}}\n' for s in (1, 2, 1, 2)))
    with pytest.raises(RunDirError, match="not one run"):  # two runs' lines, 4 of them
        prepare_run_dir(out, cfg, resume=True, overwrite=False)


def test_resume_refuses_a_config_that_trains_another_run(tmp_path):
    from grpo.launch.paths import write_config

    cfg, out = small_config(tmp_path), tmp_path / "run"
    _a_run(out, steps=2, ckpt=2)
    write_config(cfg, out / "config.yaml")
    # how often it saves or evaluates may change; the learning rate may not
    later = small_config(tmp_path, "grpo.checkpoint_every=7", "grpo.eval_every=3")
    prepare_run_dir(out, later, resume=True, overwrite=False)
    other = small_config(tmp_path, "grpo.lr=0.5", "seed=3")
    with pytest.raises(RunDirError, match=r"grpo.lr .* -> 0.5, seed 0 -> 3"):
        prepare_run_dir(out, other, resume=True, overwrite=False)


def test_a_run_the_disk_cannot_hold_is_refused_before_it_starts(tmp_path):
    """On the real disk under tmp_path: a model whose files (sparse: they take no space) are as
    large as the free space cannot fit its checkpoints; a small one can; a resumed run's
    checkpoints count as written."""
    import shutil

    from grpo.launch.run_dir import bytes_at_least, check_free_space

    cfg = small_config(tmp_path)
    model, out = tmp_path / "model", tmp_path / "run"
    model.mkdir()
    weights = model / "model.safetensors"
    weights.write_bytes(b"0" * 1000)
    check_free_space(out, model, cfg)  # a small model: nothing said
    free = shutil.disk_usage(tmp_path).free
    with weights.open("r+b") as f:
        f.truncate(free // 2)
    with pytest.raises(RunDirError, match=r"run: .* GiB free, .* at least .* lower grpo.keep"):
        check_free_space(out, model, cfg)
    # a resume whose checkpoints already hold all but a little of what the run writes
    (out / "checkpoints").mkdir(parents=True)
    with (out / "checkpoints" / "state.pt").open("wb") as f:
        f.truncate(bytes_at_least(free // 2, cfg) - 1000)
    check_free_space(out, model, cfg)

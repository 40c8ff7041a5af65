"""grpo.async_rollouts end to end, in the test process: the sampler process samples ahead with
weights exactly max_staleness updates old, a run stopped by Ctrl-C ends its sampler and resumes
bit-identically, and a killed sampler ends the run in one line (on a LoRA policy, with
transformers' generate)."""

import json

import pytest
import torch
from safetensors.torch import load_file

from grpo.engine.async_rollouts import RolloutSamplerError, weights_version
from grpo.engine.loop import Trainer
from grpo.launch.paths import base_model_dir
from grpo.models.forward import completion_logprobs
from grpo.models.loading import load_model
from tests.helpers import kill_after, small_config

pytestmark = pytest.mark.slow

DOC = "tests.trl_doc_rewards"
# completion lengths differ within a group: every group has something to learn; uses_everything
# logs a metric from the sampler process
FAST = ("grpo.lr=0.01", "grpo.warmup_steps=0", "grpo.lr_schedule=constant",
        f"grpo.reward_funcs=[{DOC}:reward_len, {DOC}:uses_everything]")  # fmt: skip
TIMES = ("time/", "step_time", "tokens_per_second", "completions_per_second")


@pytest.fixture
def threads():
    """The Trainer gives the sampler half of this process's threads; the next test gets all."""
    n = torch.get_num_threads()
    yield n
    torch.set_num_threads(n)


class Recording(Trainer):
    """Keeps each step's rollout and the weights its update started from."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.seen = []  # step s: (weights after s updates, the rollout step s trained on)

    def update(self, ro, adv, ref_logps):
        mod = self.engine.module
        before = {n: p.detach().clone() for n, p in mod.state_dict().items()}
        self.seen.append((before, ro))
        return super().update(ro, adv, ref_logps)


def _gap(model, weights, ro, temperature):
    """Mean |log pi - log mu| of the rollout's tokens, pi = model with those weights."""
    model.load_state_dict(weights)
    with torch.no_grad():
        logps, _ = completion_logprobs(model, ro.prompt_ids, ro.prompt_mask, ro.completion_ids,
                                       ro.completion_mask, temperature)  # fmt: skip
    m = ro.completion_mask.float()
    return float(((logps - ro.sampling_logps).abs() * m).sum() / m.sum())


def _metrics(out):
    rows = [json.loads(x) for x in (out / "metrics.jsonl").open()]
    return [{k: v for k, v in r.items() if not k.startswith(TIMES)} for r in rows]


def test_async_steps_are_exactly_k_stale_and_a_stopped_run_resumes_bit_identically(
    tmp_path, threads
):
    cfg = small_config(tmp_path, "grpo.async_rollouts=true", "grpo.max_staleness=2",
                       "grpo.steps=4", "grpo.checkpoint_every=2", *FAST)  # fmt: skip
    base = base_model_dir(cfg)
    whole_run = Recording(cfg, base, tmp_path / "whole")
    whole_run.train(progress=False)
    rows = _metrics(tmp_path / "whole")
    # step s is sampled with the weights of max(0, s - 2) updates: what was logged, and what
    # the sampler's log-probs say (those weights give them to numerics; the learner's own,
    # two updates on, do not)
    assert [r["async/staleness"] for r in rows] == [0.0, 1.0, 2.0, 2.0]
    model, seen, temp = load_model(base, cfg.model.dtype), whole_run.seen, cfg.grpo.temperature
    for s, (_, ro) in enumerate(seen):
        assert _gap(model, seen[weights_version(s, 2)][0], ro, temp) < 1e-4, s
    assert _gap(model, seen[3][0], seen[3][1], temp) > 1e-3
    # the first step's sampler had the learner's own weights (the gap is numerics only); the
    # last one's were two updates old at lr 0.01, and the correction weighted them
    assert rows[0]["logprob_gap/mean"] < 1e-4 < rows[3]["logprob_gap/mean"]
    # the kernels' share, measured in the sampler at its own weights, stays at numerics while
    # the staleness adds the policy's movement
    assert all(r["async/numeric_gap/mean"] < 1e-4 for r in rows)
    assert rows[3]["logprob_gap/mean"] > 10 * rows[3]["async/numeric_gap/mean"]
    # the correction acted: the stale step's weights spread around 1 (a correction that did
    # nothing would give exactly 1 everywhere), while the first step's sit at 1 to numerics
    last = rows[3]
    assert last["sampling/importance_sampling_ratio/min"] < 0.999
    assert last["sampling/importance_sampling_ratio/max"] > 1.001
    assert last["sampling/importance_sampling_ratio/max"] <= 2.0  # truncated at C = 2
    assert rows[0]["rollout_correction/weight_mean"] == pytest.approx(1.0, abs=1e-4)
    # what the reward functions logged in the sampler process reaches the learner's metrics
    assert [r["my_metric"] for r in rows] == [0.5, 1.5, 2.5, 3.5]

    def interrupt(done: int, _steps: int, _finished: bool) -> None:
        if done == 2:  # after step 2's checkpoint, which holds steps 3 and 4 sampled ahead
            raise KeyboardInterrupt

    cut = Trainer(cfg, base, tmp_path / "cut")
    with pytest.raises(KeyboardInterrupt):
        cut.train(progress=False, on_step=interrupt)
    assert cut.rollouts is not None and not cut.rollouts.proc.is_alive()
    Trainer(cfg, base, tmp_path / "cut").train(resume=True, progress=False)
    whole = load_file(tmp_path / "whole" / "policy" / "model.safetensors")
    resumed = load_file(tmp_path / "cut" / "policy" / "model.safetensors")
    assert all(torch.equal(whole[k], resumed[k]) for k in whole)
    assert _metrics(tmp_path / "cut") == rows


def test_a_killed_sampler_ends_the_run_in_one_line(tmp_path, threads):
    # transformers' generate() as the sampler's engine (the other test uses the fast one), on a
    # LoRA policy: the sampler receives the adapters only, for step 2 before the kill
    cfg = small_config(tmp_path, "grpo.async_rollouts=true", "grpo.steps=4",
                       "model.generation_engine=hf", "model.lora.enabled=true", "model.lora.r=2",
                       "model.lora.alpha=4")  # fmt: skip
    t = Trainer(cfg, base_model_dir(cfg), tmp_path / "grpo")
    with pytest.raises(RolloutSamplerError) as e:
        t.train(progress=False, on_step=kill_after(1, lambda: t.rollouts.proc.pid))
    msg = str(e.value)
    assert len(msg.splitlines()) == 1, msg
    assert "died with exit code -9" in msg and "--resume" in msg, msg


def test_async_with_staleness_0_is_bit_identical_to_the_synchronous_loop(tmp_path, threads):
    """max_staleness 0: the sampler process samples each step with the learner's current
    weights (through the same shared buffers) while the learner waits: the same weights and
    the same metrics as the synchronous loop, bit for bit."""
    sync = small_config(tmp_path, "grpo.steps=3", *FAST)
    base = base_model_dir(sync)
    Trainer(sync, base, tmp_path / "sync").train(progress=False)
    stale0 = small_config(tmp_path, "grpo.steps=3", "grpo.async_rollouts=true",
                          "grpo.max_staleness=0", *FAST)  # fmt: skip
    Trainer(stale0, base, tmp_path / "async0").train(progress=False)
    a = load_file(tmp_path / "sync" / "policy" / "model.safetensors")
    b = load_file(tmp_path / "async0" / "policy" / "model.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not all(torch.equal(a[k], load_file(base / "model.safetensors")[k]) for k in a)
    rows = [{k: v for k, v in r.items() if not k.startswith("async/")}
            for r in _metrics(tmp_path / "async0")]  # fmt: skip
    assert rows == _metrics(tmp_path / "sync")
    assert [r["async/staleness"] for r in _metrics(tmp_path / "async0")] == [0.0] * 3

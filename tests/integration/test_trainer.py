"""The GRPO trainer on a real tiny Qwen2: one step learns, beta = 0 loads no reference."""

import math

import pytest
import torch

from grpo.engine.update import metric_keys, trained_rows
from grpo.launch.paths import base_model_dir
from grpo.models.forward import causal_lm
from grpo.models.generate import Rollout
from tests.helpers import fixed_rollout, per_token, small_config

pytestmark = pytest.mark.slow


def _seq_logp(trainer, ro: Rollout, i: int) -> float:
    from grpo.algo.logprobs import token_logprobs
    from grpo.models.forward import completion_logits

    with torch.no_grad():
        logits = completion_logits(
            trainer.engine.module, ro.prompt_ids, ro.prompt_mask, ro.completion_ids,
            ro.completion_mask,
        )  # fmt: skip
        lp = token_logprobs(logits, ro.completion_ids) * ro.completion_mask
    return float(lp[i].sum())


def test_one_grpo_update_raises_the_rewarded_completion(tmp_path):
    from grpo.engine.loop import Trainer

    cfg = small_config(tmp_path, "grpo.lr=0.01", "grpo.warmup_steps=0", "grpo.lr_schedule=constant")
    t = Trainer(cfg, base_model_dir(cfg), tmp_path / "grpo")
    assert t.reference is None  # beta = 0: the reference model is never loaded
    assert "kl" not in metric_keys(cfg.grpo)
    ro = fixed_rollout(t.tok, ["<think>4+2=6</think><answer>46</answer>", "<answer>99</answer>"])
    before = [p.detach().clone() for p in t.engine.module.parameters()]
    lp_good, lp_bad = _seq_logp(t, ro, 0), _seq_logp(t, ro, 1)
    # through the DeepSpeed engine, the LM head runs on the completion tokens only: the
    # model's own call of it gets none (the fast path, not the every-position fallback)
    head_rows: list[int] = []
    hook = causal_lm(t.engine).lm_head.register_forward_hook(
        lambda _m, args, _out: head_rows.append(args[0].reshape(-1, args[0].shape[-1]).shape[0])
    )
    m = t.update(ro, per_token(torch.tensor([1.0, -1.0]), ro), None)
    hook.remove()
    assert head_rows == [0, int(ro.completion_mask.sum())]
    after = list(t.engine.module.parameters())
    assert any(not torch.equal(a, b) for a, b in zip(before, after))
    assert _seq_logp(t, ro, 0) > lp_good
    assert _seq_logp(t, ro, 1) < lp_bad
    assert m["grad_norm"] > 0 and m["learning_rate"] == pytest.approx(0.01)


def test_beta_positive_loads_a_frozen_reference(tmp_path):
    from grpo.engine.loop import Trainer

    cfg = small_config(tmp_path, "grpo.beta=0.04")
    t = Trainer(cfg, base_model_dir(cfg), tmp_path / "grpo")
    assert t.reference is not None and "kl" in metric_keys(cfg.grpo)
    assert not any(p.requires_grad for p in t.reference.model.parameters())
    # the KL of the policy to itself (the reference is the starting policy) is exactly 0
    ro = fixed_rollout(t.tok, ["<answer>46</answer>", "<answer>4</answer>"])
    ref_logps = t.reference.logps(ro, micro=2)
    m = t.update(ro, per_token(torch.tensor([1.0, -1.0]), ro), ref_logps)
    assert m["kl"] == pytest.approx(0.0, abs=1e-6)


def test_prompt_order_is_deterministic_and_covers_the_epoch():
    from grpo.data.order import prompt_indices

    seen = [i for s in range(5) for i in prompt_indices(s, 0, 4, 1, 20, seed=3)]
    assert sorted(seen) == list(range(20))  # one epoch, every prompt once
    assert prompt_indices(2, 0, 4, 1, 20, 3) == prompt_indices(2, 0, 4, 1, 20, 3)
    two_ranks = prompt_indices(1, 0, 2, 2, 20, 3) + prompt_indices(1, 1, 2, 2, 20, 3)
    assert two_ranks == prompt_indices(1, 0, 4, 1, 20, 3)  # ranks split the same global batch


def test_process_supervision_and_dynamic_sampling_steps_run(tmp_path):
    from grpo.engine.loop import Trainer

    cfg = small_config(
        tmp_path, "grpo.advantage_mode=process", "grpo.dynamic_sampling=true",
        "grpo.max_sampling_rounds=2", "grpo.steps=2", "grpo.mu=2",
    )  # fmt: skip
    out = Trainer(cfg, base_model_dir(cfg), tmp_path / "grpo").train(progress=False)
    m = out["final"]
    assert m["step"] == 2 and m["grad_norm"] >= 0
    assert (tmp_path / "grpo" / "policy" / "model.safetensors").exists()
    import json

    rows = [json.loads(x) for x in (tmp_path / "grpo" / "metrics.jsonl").open()]
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        # another round only while the batch still holds groups with nothing to learn, and
        # never more than max_sampling_rounds; the kept batch is then fully informative
        assert 1 <= r["sampling/rounds"] <= 2
        assert r["frac_reward_zero_std"] == 0.0 or r["sampling/rounds"] == 2
        if r["sampling/rounds"] == 2:
            assert r["sampled/frac_reward_zero_std"] > 0  # round 1 left groups to replace


def test_process_advantages_map_characters_to_tokens(tmp_path):
    from grpo.engine.scoring import token_advantages
    from grpo.models.loading import load_tokenizer

    # DeepSeekMath's form: summed step advantages, no outcome term
    cfg = small_config(tmp_path, "grpo.advantage_mode=process", "grpo.num_generations=2",
                       "grpo.process_advantage=sum", "grpo.process_outcome_weight=0")  # fmt: skip
    tok = load_tokenizer(base_model_dir(cfg))
    texts = ["<think>1+2=3</think><answer>3</answer>", "<think>1+2=4</think><answer>4</answer>"]
    ro = fixed_rollout(tok, texts)
    rows = [{"prompt": "1+2=", "answer": "3"}] * 2
    adv = token_advantages(cfg.grpo, ro, torch.zeros(2), rows, texts, tok)
    # pooled step rewards (1, 1, 0, 0): mean 0.5, std 0.5 -> +1 / -1 (up to eps)
    # completion 0: step "1+2=3" ends at token 5 (<think> is one token), answer at the end
    assert adv[0, 0].item() == pytest.approx(2.0, rel=1e-3)  # both steps end at/after t=0
    assert adv[0, 6].item() == pytest.approx(1.0, rel=1e-3)  # only the final-answer step
    assert adv[1, 0].item() == pytest.approx(-2.0, rel=1e-3)
    n0 = int(ro.lengths[0])
    # the last step runs to the EOS: stopping is reinforced even with no outcome term
    assert adv[0, n0 - 1].item() == pytest.approx(1.0, rel=1e-3)
    assert adv[1, int(ro.lengths[1]) - 1].item() == pytest.approx(-1.0, rel=1e-3)
    assert adv[0, n0:].abs().sum() == 0  # padding after the EOS: nothing
    # plus half the outcome advantage: outcome rewards (1, 0) z-score to +1 / -1 (up to eps),
    # over each completion's own tokens only
    g = cfg.grpo.model_copy(update={"process_outcome_weight": 0.5})
    both = token_advantages(g, ro, torch.tensor([1.0, 0.0]), rows, texts, tok)
    expected = 0.5 * torch.tensor([[1.0], [-1.0]]) * ro.completion_mask
    torch.testing.assert_close(both - adv, expected, atol=1e-3, rtol=0)


def test_skipping_zero_advantage_rows_gives_the_same_update(tmp_path):
    """beta = 0 + dapo: rows with zero advantage are not run, and the weights come out the same.

    6 rows, micro-batches of 2: trained on all rows, 3 micro-batches; with skipping, the 3 rows
    with a non-zero advantage fill 2 micro-batches and the third is a zero-gradient call.
    """
    from grpo.engine.loop import Trainer

    texts = ["<answer>46</answer>", "<answer>4</answer>", "46", "<think>9+9", "<answer>", "x"]
    adv = torch.tensor([1.0, 0.0, -0.5, 0.0, 0.0, 2.0])
    weights = {}
    for skip in (True, False):
        cfg = small_config(
            tmp_path / str(skip), "grpo.lr=0.01", "grpo.warmup_steps=0",
            "grpo.prompts_per_step=1", "grpo.num_generations=6", "grpo.micro_batch_size=2",
            f"grpo.skip_zero_advantage={skip}",
        )  # fmt: skip
        t = Trainer(cfg, base_model_dir(cfg), tmp_path / str(skip) / "grpo")
        ro = fixed_rollout(t.tok, texts)
        assert trained_rows(cfg.grpo, per_token(adv, ro), ro.completion_mask).tolist() == (
            [0, 2, 5] if skip else list(range(6))
        )
        # a NaN advantage is trained on, so that its non-finite loss is seen and handled
        nan_adv = torch.tensor([[float("nan")], [0.0], [1.0]])
        ones = torch.ones(3, 1)
        assert trained_rows(cfg.grpo, nan_adv, ones).tolist() == ([0, 2] if skip else [0, 1, 2])
        t.update(ro, per_token(adv, ro), None)
        weights[skip] = [p.detach().clone() for p in t.engine.module.parameters()]
    for a, b in zip(weights[True], weights[False], strict=True):
        # float noise only: the two runs batch the rows differently (different matmul shapes),
        # and Adam's first step divides each gradient by its own size, so a weight whose
        # gradient is near zero can move by a visible fraction of lr = 0.01 on noise alone.
        # 1e-4 is 1% of one step; training a skipped row (or skipping a trained one) moves
        # weights by the whole step.
        torch.testing.assert_close(a, b, atol=1e-4, rtol=0)


def test_a_seeded_run_is_reproducible(tmp_path):
    """Same config and seed, twice: SFT gives the same weights, GRPO (sampling, dynamic
    sampling rounds, process advantages, mu = 2) the same weights and the same metrics, so the
    held-out numbers of the default run repeat."""
    import json

    from grpo.data.sets import training_sets
    from grpo.engine.loop import Trainer
    from grpo.engine.sft import train_reference
    from grpo.models.loading import load_model

    weights, metrics = [], []
    for i in range(2):
        cfg = small_config(
            tmp_path / str(i), "grpo.advantage_mode=process", "grpo.process_outcome_weight=0.5",
            "grpo.dynamic_sampling=true", "grpo.mu=2", "grpo.steps=2",
        )  # fmt: skip
        ref = tmp_path / str(i) / "ref"
        train_reference(cfg, base_model_dir(cfg), ref, training_sets(cfg), progress=False)
        Trainer(cfg, ref, tmp_path / str(i) / "grpo").train(progress=False)
        model = load_model(tmp_path / str(i) / "grpo" / "policy", trainable=False)
        weights.append([p.detach().clone() for p in model.parameters()])
        lines = [json.loads(x) for x in (tmp_path / str(i) / "grpo" / "metrics.jsonl").open()]
        metrics.append([{k: v for k, v in m.items() if "time" not in k and "per_second" not in k}
                        for m in lines])  # fmt: skip
    assert all(torch.equal(a, b) for a, b in zip(*weights, strict=True))
    assert metrics[0] == metrics[1]


def test_the_control_follows_the_grpo_run_it_runs_beside(tmp_path):
    """The control stops at the step after the followed run says done, its rate annealed by
    that run's progress; the trainer writes the file it follows, done at the end."""
    import json
    import threading

    from grpo.data.sets import training_sets
    from grpo.engine.loop import Trainer
    from grpo.engine.pace import mark_done, read_pace, write_pace
    from grpo.engine.sft import train_control

    cfg = small_config(tmp_path, "sft.warmup_steps=0", "sft.eval_every=1000")
    sets = training_sets(cfg)
    pace = tmp_path / "pace.json"
    mark_done(pace)
    done = train_control(cfg, base_model_dir(cfg), tmp_path / "c1", sets, follow=pace)
    assert done["steps"] == 1 and (tmp_path / "c1" / "config.json").exists()
    # a budget of 0 s (a resumed GRPO run with no steps left) is one step too, never endless
    zero = train_control(cfg, base_model_dir(cfg), tmp_path / "c0", sets, max_seconds=0.0)
    assert zero["steps"] == 1
    # no budget at all would train for ever: refused before anything is loaded
    with pytest.raises(ValueError, match="one budget"):
        train_control(cfg, base_model_dir(cfg), tmp_path / "none", sets)
    assert not (tmp_path / "none").exists()

    write_pace(pace, 1, 2)  # half way: cos(pi / 2) -> half the learning rate
    timer = threading.Timer(3.0, mark_done, [pace])
    timer.start()
    out = train_control(cfg, base_model_dir(cfg), tmp_path / "c2", sets, follow=pace)
    timer.join()
    seen = [json.loads(x) for x in (tmp_path / "c2_metrics.jsonl").open()]
    assert out["steps"] > 1 and len(seen) == 1  # one validation: the final one, when stopped
    assert seen[0]["lr"] == pytest.approx(cfg.sft.lr * 0.5)
    assert read_pace(pace) == (0.5, True)

    pace_file = tmp_path / "grpo" / "pace.json"
    on_step = lambda done, total, finished: write_pace(pace_file, done, total, finished)  # noqa: E731
    Trainer(cfg, base_model_dir(cfg), tmp_path / "grpo").train(progress=False, on_step=on_step)
    assert read_pace(pace_file) == (1.0, True)


def test_the_sequential_control_runs_its_seconds_or_steps_in_a_worker_process(tmp_path):
    """sft.control sequential (GPUs, several ranks): the worker's control stage trains for the
    given seconds, anneals to zero and leaves its weights and summary. With a step budget
    (sft.control_steps) it takes exactly that many steps, anneals to zero at the last, and
    gives the same weights as the same control trained in this process: what a wall-time
    control cannot (its step count moves with the machine's speed)."""
    import json

    from grpo.data.sets import training_sets
    from grpo.engine.sft import train_control, train_reference
    from grpo.launch.runner import run_control

    cfg = small_config(tmp_path, "sft.warmup_steps=0")
    ref = tmp_path / "ref"
    train_reference(cfg, base_model_dir(cfg), ref, training_sets(cfg), progress=False)
    summary = run_control(cfg, ref, tmp_path / "ctl", seconds=3.0, log=lambda s: None)
    assert summary["steps"] > 1 and summary["seconds"] >= 3.0
    assert (tmp_path / "ctl" / "config.json").exists()
    last = [json.loads(x) for x in (tmp_path / "ctl_metrics.jsonl").open()][-1]
    assert last["step"] == summary["steps"] and last["lr"] == pytest.approx(0.0, abs=1e-6)

    by_worker = run_control(cfg, ref, tmp_path / "w", steps=5, log=lambda s: None)
    here = train_control(cfg, ref, tmp_path / "h", training_sets(cfg), max_steps=5)
    assert by_worker["steps"] == here["steps"] == 5
    rows = [json.loads(x) for x in (tmp_path / "w_metrics.jsonl").open()]
    # validated at steps 2 and 4 (sft.eval_every=2) and the last; the rate recorded after
    # step k is the cosine over 5 steps at k / 5: 0.5 (1 + cos(pi k / 5)) sft.lr, 0 at the end
    assert [r["step"] for r in rows] == [2, 4, 5]
    lrs = [0.5 * (1 + math.cos(math.pi * k / 5)) * cfg.sft.lr for k in (2, 4, 5)]
    assert [r["lr"] for r in rows] == pytest.approx(lrs, abs=1e-9)
    w = (tmp_path / "w" / "model.safetensors").read_bytes()
    assert w == (tmp_path / "h" / "model.safetensors").read_bytes()
    # sft.control_lr: the same cosine from another peak (the reference's last rate, say)
    lower = small_config(tmp_path, "sft.warmup_steps=0", f"sft.control_lr={cfg.sft.lr * 0.3}")
    train_control(lower, ref, tmp_path / "low", training_sets(lower), max_steps=5)
    rows = [json.loads(x) for x in (tmp_path / "low_metrics.jsonl").open()]
    assert [r["lr"] for r in rows] == pytest.approx([0.3 * x for x in lrs], abs=1e-9)
    assert w != (tmp_path / "ctl" / "model.safetensors").read_bytes()
    with pytest.raises(ValueError, match="exactly one"):
        run_control(cfg, ref, tmp_path / "x", seconds=1.0, steps=5, log=lambda s: None)


def test_process_mode_judges_informative_groups_by_its_own_advantages(tmp_path):
    """Dynamic sampling in process mode: equal outcome rewards with different steps is a
    group to keep (weight 0); with the outcome term it takes both to be flat."""
    from grpo.engine.scoring import flat_groups

    right, slip = "<think>1+2=3</think><answer>3</answer>", "<think>1+2=4</think><answer>3</answer>"
    texts = [right, slip, right, right]
    rows = [{"prompt": "1+2=", "answer": "3"}] * 2  # one per group
    equal = torch.ones(4)
    g = small_config(tmp_path, "grpo.advantage_mode=process", "grpo.num_generations=2",
                     "grpo.process_outcome_weight=0").grpo  # fmt: skip
    assert flat_groups(g, equal, texts, rows, 2).tolist() == [False, True]
    outcome = g.model_copy(update={"advantage_mode": "zscore"})
    assert flat_groups(outcome, equal, texts, rows, 2).tolist() == [True, True]
    both = g.model_copy(update={"process_outcome_weight": 1.0})
    assert flat_groups(both, torch.tensor([1.0, 1.0, 1.0, 0.0]), texts, rows, 2).tolist() == [
        False, False,
    ]  # fmt: skip


def test_unequal_micro_batches_give_the_one_batch_gradient(tmp_path):
    """loss_type grpo, 6 rows in micro-batches of 4 (4 + 2): each micro-batch weighted by its
    share of the rows, the update equals one micro-batch of 6 (up to float noise). Equal
    weighting would count the last 2 rows twice."""
    from grpo.engine.loop import Trainer

    texts = ["<answer>46</answer>", "<answer>4</answer>", "46", "<think>9+9", "<answer>", "x"]
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5, 2.0, -2.0])
    weights = {}
    for micro in (6, 4):
        cfg = small_config(
            tmp_path / str(micro), "grpo.lr=0.01", "grpo.warmup_steps=0", "grpo.loss_type=grpo",
            "grpo.prompts_per_step=1", "grpo.num_generations=6", f"grpo.micro_batch_size={micro}",
        )  # fmt: skip
        t = Trainer(cfg, base_model_dir(cfg), tmp_path / str(micro) / "grpo")
        ro = fixed_rollout(t.tok, texts)
        m = t.update(ro, per_token(adv, ro), None)
        weights[micro] = ([p.detach().clone() for p in t.engine.module.parameters()], m["loss"])
    for a, b in zip(weights[6][0], weights[4][0], strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)
    assert weights[4][1] == pytest.approx(weights[6][1], abs=1e-5)


def test_a_reference_shorter_than_one_validation_is_still_written(tmp_path):
    """max_epochs ends SFT before its first validation: the last step is validated and saved."""
    import json

    from grpo.data.sets import training_sets
    from grpo.engine.sft import train_reference

    cfg = small_config(tmp_path, "sft.max_epochs=1", "sft.eval_every=1000")
    out = train_reference(cfg, base_model_dir(cfg), tmp_path / "ref", training_sets(cfg),
                          progress=False)  # fmt: skip
    assert out["steps"] == 2  # 64 worked solutions in batches of 32
    assert [h["step"] for h in out["history"]] == [2] and out["best_val_loss"] < 100
    assert (tmp_path / "ref" / "config.json").exists()
    logged = [json.loads(x) for x in (tmp_path / "ref_metrics.jsonl").open()]
    assert [r["step"] for r in logged] == [2]


def test_sft_stops_at_its_plateau_keeps_its_best_weights_and_force_rebuilds(tmp_path):
    """16 worked solutions at a high rate: validation loss bottoms out and the plateau (no cut
    left) stops SFT long before max_epochs. The reference on disk is the best validation's, as a
    separate forward recomputes; `grpo sft` reuses it, `grpo sft --force` rebuilds the same."""
    import json
    import subprocess
    import sys

    from transformers import AutoModelForCausalLM

    from grpo.data.sets import training_sets
    from grpo.engine.sft import _collate, _encode
    from grpo.launch.runner import run_sft
    from grpo.models.loading import load_tokenizer
    from tests.helpers import SMALL

    sets = ["data.num_sft=16", "data.num_sft_val=8", "sft.lr=0.03", "sft.eval_every=1",
            "sft.patience=2", "sft.lr_cuts=0", "sft.max_epochs=300",
            "sft.warmup_steps=0"]  # fmt: skip
    cfg = small_config(tmp_path, *sets)
    out = run_sft(cfg, log=lambda s: None)
    summary = json.loads((out / "sft_summary.json").read_text())
    losses = [h["val_loss"] for h in summary["history"]]
    assert summary["early_stopped"] and summary["steps"] < 300
    assert summary["best_val_loss"] == min(losses) < losses[0]
    assert losses[-1] >= summary["best_val_loss"]  # it ended on validations without a gain
    # the weights kept are the best validation's
    tok = load_tokenizer(out)
    model = AutoModelForCausalLM.from_pretrained(out).eval()
    batch = _collate(_encode(tok, training_sets(cfg)["sft_val"], cfg), tok.pad_token_id, "cpu")
    with torch.no_grad():
        loss = model(**batch).loss
    assert float(loss) == pytest.approx(summary["best_val_loss"], rel=1e-4)

    weights = out / "model.safetensors"
    stamp, before = weights.stat().st_mtime_ns, weights.read_bytes()
    cli = [sys.executable, "-m", "cli.main", "sft"]
    for s in [*SMALL, *sets, f"output_dir={tmp_path}"]:
        cli += ["--set", s]
    again = subprocess.run(cli, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert again.returncode == 0 and "cache hit" in again.stdout + again.stderr
    assert weights.stat().st_mtime_ns == stamp
    forced = subprocess.run([*cli, "--force"], capture_output=True, text=True, timeout=300,
                            cwd=tmp_path)  # fmt: skip
    assert forced.returncode == 0, forced.stderr[-2000:]
    assert weights.stat().st_mtime_ns != stamp and weights.read_bytes() == before  # seeded


@pytest.mark.parametrize(("source", "ratio"), [("recompute", 1.0), ("sampler", 0.904837)])
def test_old_logprobs_come_from_the_configured_source(tmp_path, source, ratio):
    """mu = 2 with a rate too small to move the weights: pi_old is the first pass's own forward
    (recompute: every ratio exactly 1) or the sampler's log-probs, here the true ones + 0.1
    (sampler: every ratio exp(-0.1) = 0.904837)."""
    from grpo.engine.loop import Trainer

    cfg = small_config(tmp_path, "grpo.mu=2", "grpo.lr=1e-12", "grpo.warmup_steps=0",
                       f"grpo.old_logprobs={source}")  # fmt: skip
    t = Trainer(cfg, base_model_dir(cfg), tmp_path / "grpo")
    ro = fixed_rollout(t.tok, ["<answer>46</answer>", "<answer>4</answer>"])
    from grpo.algo.logprobs import token_logprobs
    from grpo.models.forward import completion_logits

    with torch.no_grad():
        logits = completion_logits(t.engine.module, ro.prompt_ids, ro.prompt_mask,
                                   ro.completion_ids, ro.completion_mask)  # fmt: skip
        ro.sampling_logps = (token_logprobs(logits, ro.completion_ids) + 0.1) * ro.completion_mask
    m = t.update(ro, per_token(torch.tensor([1.0, -1.0]), ro), None)
    assert m["ratio_mean"] == pytest.approx(ratio, abs=1e-5)


def test_offloading_the_optimizer_changes_nothing_but_where_it_lives(tmp_path):
    """ZeRO-2 with the optimizer state on the CPU (offload_optimizer) takes the same step as
    without: same weights after one update."""
    from grpo.engine.loop import Trainer

    after = {}
    for offload in (False, True):
        cfg = small_config(tmp_path / str(offload), "grpo.lr=0.01", "grpo.warmup_steps=0",
                           "deepspeed.zero_stage=2",
                           f"deepspeed.offload_optimizer={offload}")  # fmt: skip
        t = Trainer(cfg, base_model_dir(cfg), tmp_path / str(offload) / "grpo")
        ro = fixed_rollout(t.tok, ["<answer>46</answer>", "<answer>4</answer>"])
        t.update(ro, per_token(torch.tensor([1.0, -1.0]), ro), None)
        after[offload] = {k: v.detach().clone() for k, v in t.engine.module.state_dict().items()}
        zero_cfg = t.engine.config["zero_optimization"]
        assert ("offload_optimizer" in zero_cfg) == offload
    base = base_model_dir(small_config(tmp_path))
    from safetensors.torch import load_file

    start = load_file(base / "model.safetensors")
    assert any(not after[False][k].equal(start[k]) for k in start)  # the step moved weights
    for k in after[False]:
        torch.testing.assert_close(after[True][k], after[False][k], atol=1e-6, rtol=1e-5)


def test_a_bfloat16_policy_trains_and_samples_close_to_its_forward(tmp_path):
    """model.dtype bfloat16: the weights stay bf16 (DeepSpeed's bf16 mode), an update moves
    them, and the sampler's log-probs agree with a teacher-forced forward to bf16's precision."""
    from grpo.algo.logprobs import token_logprobs
    from grpo.engine.loop import Trainer
    from grpo.models.forward import completion_logits
    from grpo.models.generate import generate

    cfg = small_config(tmp_path, "model.dtype=bfloat16", "grpo.lr=0.01", "grpo.warmup_steps=0")
    t = Trainer(cfg, base_model_dir(cfg), tmp_path / "grpo")
    assert {p.dtype for p in t.engine.module.parameters()} == {torch.bfloat16}
    assert t.engine.config["bf16"]["enabled"]
    ro = fixed_rollout(t.tok, ["<answer>46</answer>", "<answer>4</answer>"])
    before = [p.detach().clone() for p in t.engine.module.parameters()]
    m = t.update(ro, per_token(torch.tensor([1.0, -1.0]), ro), None)
    assert any(not torch.equal(a, b) for a, b in zip(before, t.engine.module.parameters()))
    assert math.isfinite(m["loss"]) and m["grad_norm"] > 0
    model = t.engine.module
    p = t.tok(["12+34=", "7+8="], return_tensors="pt", padding=True)
    torch.manual_seed(0)
    ro = generate(model, p["input_ids"], p["attention_mask"], num_generations=4,
                  max_completion_length=16, eos_token_id=t.tok.eos_token_id,
                  pad_token_id=t.tok.pad_token_id, engine="fast")  # fmt: skip
    with torch.no_grad():
        logits = completion_logits(model, ro.prompt_ids, ro.prompt_mask, ro.completion_ids,
                                   ro.completion_mask)  # fmt: skip
    forward = token_logprobs(logits, ro.completion_ids) * ro.completion_mask
    # bf16 keeps 8 bits of mantissa: agreement to a few 1e-2 in log-prob, not fp32's 1e-5
    torch.testing.assert_close(ro.sampling_logps.float() * ro.completion_mask, forward.float(),
                               atol=0.1, rtol=0)  # fmt: skip

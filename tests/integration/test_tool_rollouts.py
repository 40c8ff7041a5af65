"""Multi-turn rollouts in the trainer, on the real tiny Qwen2: the tool responses' tokens get no
gradient through the loss, the KL or the entropy bonus, and count in no normaliser; the engine's
turns are cut to each episode's budget; and two steps with a TRL environment class train,
score episodes by the environment's own reward and log the tool metrics."""

import pytest
import torch

from grpo.launch.paths import base_model_dir
from grpo.models.forward import causal_lm
from tests.helpers import fixed_rollout, per_token, small_config

pytestmark = pytest.mark.slow


def test_tool_tokens_get_no_gradient_and_count_in_no_normaliser(tmp_path):
    """Two episodes, each model text, a tool response, model text: the gradient of the update
    at the LM head's outputs is exactly zero on the tool tokens' rows (policy loss, k3 KL and
    the entropy bonus all read those logits) and non-zero on the model's; the entropy metric
    and the token count are the model tokens' alone."""
    from grpo.engine.loop import Trainer

    cfg = small_config(tmp_path, "grpo.beta=0.04", "grpo.entropy_coef=0.01", "grpo.loss_type=dapo",
                       "grpo.mu=1")  # fmt: skip
    t = Trainer(cfg, base_model_dir(cfg), tmp_path / "grpo")
    parts = [("<think>1+1", "<tool_response>2</tool_response>", "</think><answer>2</answer>"),
             ("<think>3+4", "<tool_response>7</tool_response>", "<answer>9</answer>")]  # fmt: skip
    ro = fixed_rollout(t.tok, ["".join(p) for p in parts])
    model = torch.zeros_like(ro.completion_mask)
    tool_rows = []
    for i, (a, tool, _b) in enumerate(parts):
        na, nt = len(t.tok(a)["input_ids"]), len(t.tok(tool)["input_ids"])
        model[i] = ro.completion_mask[i]
        model[i, na : na + nt] = 0
        tool_rows.append((na, na + nt))
    ro.model_mask = model
    ro.turn = torch.where(torch.arange(model.shape[1]) < torch.tensor([r[0] for r in tool_rows])
                          .unsqueeze(1), 1, 2) * ro.completion_mask  # fmt: skip
    ref = t.reference.logps(ro, micro=2) + 0.3  # a reference the policy is away from: k3 > 0
    head = causal_lm(t.engine).lm_head
    captured = []

    def keep(_m, _args, out):
        out.retain_grad()
        captured.append(out)

    hook = head.register_forward_hook(keep)
    m = t.update(ro, per_token(torch.tensor([1.0, -1.0]), ro), ref)
    hook.remove()
    logits = next(c for c in captured if c.grad is not None)  # the update's head call
    grad = logits.grad.reshape(-1, logits.shape[-1])
    # head rows are the completion tokens, row-major (grpo.models.forward)
    rows, cols = ro.completion_mask.bool().nonzero(as_tuple=True)
    is_tool = ro.model_mask[rows, cols] == 0
    assert int(is_tool.sum()) == sum(e - s for s, e in tool_rows) > 0
    assert torch.equal(grad[is_tool], torch.zeros_like(grad[is_tool]))
    assert bool((grad[~is_tool].abs().sum(1) > 0).all())
    # the entropy metric: over the model's tokens only
    with torch.no_grad():
        lp = torch.log_softmax(logits.detach().reshape(-1, logits.shape[-1]).float(), -1)
        ent = -(lp.exp() * lp).sum(-1)
    assert m["entropy"] == pytest.approx(float(ent[~is_tool].mean()), rel=1e-4)
    assert m["entropy"] != pytest.approx(float(ent.mean()), rel=1e-4)
    assert m["kl"] > 0 and "logprob_gap/turn_1" in m and "logprob_gap/turn_2" in m


def test_the_engine_turn_is_batched_and_cut_to_each_budget(tmp_path):
    from grpo.models.episodes import turn_engine
    from grpo.models.loading import eos_token_ids, load_model, load_tokenizer

    cfg = small_config(tmp_path, "grpo.temperature=1.0")
    model, tok = load_model(base_model_dir(cfg)), load_tokenizer(base_model_dir(cfg))
    turn = turn_engine(model, tok, cfg, torch.device("cpu"), eos_token_ids(tok, model))
    ctx = [tok("12+34=")["input_ids"], tok("1+1=")["input_ids"] + [5, 6, 7]]
    torch.manual_seed(0)
    outs = turn(ctx, [3, 20])
    assert len(outs[0].ids) <= 3 and len(outs[0].logprobs) == len(outs[0].ids)
    assert not outs[0].finished or len(outs[0].ids) < 3
    assert all(lp <= 0 for o in outs for lp in o.logprobs)


def test_two_steps_with_an_environment_class_train_and_log_the_tool_metrics(tmp_path):
    import json

    from grpo.engine.loop import Trainer

    cfg = small_config(
        tmp_path, "tools.environment=tests.tool_envs:Counter", "tools.max_turns=2",
        "grpo.reward_funcs=[environment, format]", "grpo.reward_weights=[1.0, 0.1]",
        "model.tiny.max_position_embeddings=1024", "grpo.steps=2", "grpo.log_completions_every=1",
    )  # fmt: skip
    out = Trainer(cfg, base_model_dir(cfg), tmp_path / "grpo").train(progress=False)
    rows = [json.loads(x) for x in (tmp_path / "grpo" / "metrics.jsonl").open()]
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert r["tools/turns_mean"] >= 1 and "tools/ended_by_answer" in r
        ends = sum(r[f"tools/ended_by_{w}"] for w in ("answer", "max_turns", "max_total_tokens"))
        assert ends == pytest.approx(1.0)
        assert "rewards/environment/mean" in r and r["tools/model_tokens_mean"] > 0
    comp = [json.loads(x) for x in (tmp_path / "grpo" / "completions.jsonl").open()]
    assert comp and comp[0]["completion"].startswith("[assistant] ")  # a readable transcript
    assert out["final"]["step"] == 2
    # evaluated as it was trained: greedy episodes with the same tools, graded on the last turn
    from grpo.data.sets import eval_set
    from grpo.eval.run import generate_for_rows
    from grpo.models.loading import load_model, load_tokenizer

    policy = tmp_path / "grpo" / "policy"
    rows = eval_set("synthetic", cfg)[:4]
    recs = generate_for_rows(load_model(policy, trainable=False), load_tokenizer(policy), rows,
                             cfg, torch.device("cpu"), max_new_tokens=24)  # fmt: skip
    assert sorted(r["id"] for r in recs) == sorted(r["id"] for r in rows)
    for r in recs:
        assert r["turns"] >= 1 and r["transcript"].startswith("[assistant] ")
        assert r["ended_by"] in ("answer", "max_turns", "max_total_tokens")
    from grpo.eval.metrics import summarize

    s = summarize(recs)
    assert s["turns_mean"] == sum(r["turns"] for r in recs) / 4
    assert {"tool_use_rate", "tool_calls_mean", "tool_errors_mean"} <= set(s)
    # the same model without its tools, on the same problems, paired (grpo evaluate
    # --without-tools)
    from grpo.eval.run import evaluate_against_baseline

    bare = cfg.model_copy(update={"tools": type(cfg.tools)()})
    out_dir = tmp_path / "with-without"
    report, text = evaluate_against_baseline(cfg, str(policy), str(policy), ["synthetic"],
                                             str(out_dir), limit=4, baseline_cfg=bare)  # fmt: skip
    assert report["paired_vs_baseline"]["synthetic"]["strict"]["n"] == 4
    assert "tool_use_rate" in report["sets"]["synthetic"]
    assert "tool_use_rate" not in report["baseline"]["sets"]["synthetic"]


def test_trls_documented_environment_example_trains_two_steps_unchanged(tmp_path):
    """TRL's IncrementEnv example as its docs write it (reset(self) takes no row) and its
    zero reward: two steps run, every episode gets a fresh instance, and the calls the model
    makes reach the environment's method."""
    import json

    from grpo.engine.loop import Trainer
    from grpo.models.episodes import Toolbox

    cfg = small_config(
        tmp_path, "tools.environment=tests.tool_envs:Increment", "tools.max_turns=2",
        "grpo.reward_funcs=[tests.tool_envs:no_reward]", "grpo.reward_weights=[1.0]",
        "model.tiny.max_position_embeddings=1024",
    )  # fmt: skip
    tools, env, extra = Toolbox(cfg).episode({"prompt": "Increment by two.", "answer": "2"})
    assert set(tools) == {"increment"} and extra == ""
    assert tools["increment"].fn(a=2) == 2 and tools["increment"].fn(a=3) == 5
    assert Toolbox(cfg).episode({"prompt": "x", "answer": "1"})[1]._total == 0  # fresh
    Trainer(cfg, base_model_dir(cfg), tmp_path / "grpo").train(progress=False)
    rows = [json.loads(x) for x in (tmp_path / "grpo" / "metrics.jsonl").open()]
    assert [r["step"] for r in rows] == [1, 2]
    assert all(r["reward"] == 0.0 and r["tools/turns_mean"] >= 1 for r in rows)


def test_validation_checks_the_episodes_prompts_and_that_the_environment_starts(tmp_path):
    from tasks.validation import DataValidationError, validate_datasets

    over = ("grpo.reward_funcs=[environment]", "grpo.reward_weights=[1.0]",
            "model.tiny.max_position_embeddings=1024")  # fmt: skip
    good = small_config(tmp_path, "tools.environment=tests.tool_envs:Counter", *over)
    results = validate_datasets(good, tmp_path / "docs")
    assert all(r["success"] for r in results.values())
    # the prompt GRPO sees lists the tools (a max_prompt_length below it fails), and an
    # environment that cannot start from a row fails it
    picky = small_config(tmp_path, "tools.environment=tests.tool_envs:Picky",
                         "grpo.max_prompt_length=64", *over)  # fmt: skip
    with pytest.raises(DataValidationError) as e:
        validate_datasets(picky, tmp_path / "docs2")
    assert "train: " in str(e.value) and "(prompt_tokens) failed" in str(e.value)
    assert "(episode_starts) failed" in str(e.value)

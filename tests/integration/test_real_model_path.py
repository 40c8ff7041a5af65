"""A real model's path, on a Qwen2.5-shaped stand-in built locally (tests/realistic_model.py):
BPE tokenizer and chat template, several EOS ids, offsets, logits kept, the whole pipeline."""

import json
import shutil
from pathlib import Path

import pytest
import torch

from tests.helpers import ROOT, by_stage, small_config, tracking_uri
from tests.realistic_model import build_realistic_model, digit_merging_tokenizer

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def real_dir(tmp_path_factory) -> Path:
    return build_realistic_model(tmp_path_factory.mktemp("realistic") / "model")


def _texts(n: int = 400) -> list[str]:
    gsm = [json.loads(x) for x in (ROOT / "data/gsm8k/train.jsonl").open()][:n]
    gsm += [json.loads(x) for x in (ROOT / "data/gsm8k/test.jsonl").open()][:n]
    math = [json.loads(x) for x in (ROOT / "data/math500/test.jsonl").open()][:n]
    return [r["question"] for r in gsm] + [r["answer"] for r in gsm] + [r["problem"] for r in math]


@pytest.mark.parametrize("engine", ["fast", "hf"])
def test_both_engines_stop_at_either_eos_id_and_never_past_it(real_dir, engine):
    """Two EOS ids, as Qwen2.5-Instruct has: a row ends at the first of either, or runs to the
    length limit (truncated); nothing is kept after it. The ids are the two tokens this random
    model samples most after each prompt, so that rows end at each of them."""
    from grpo.models.generate import generate
    from grpo.models.loading import load_model, load_tokenizer

    tok, model = load_tokenizer(real_dir), load_model(real_dir, trainable=False)
    p = tok(["12+34=", "What is 7 times 6?"], return_tensors="pt", padding=True)
    kw = {"num_generations": 16, "max_completion_length": 12, "pad_token_id": tok.pad_token_id,
          "engine": engine}  # fmt: skip
    torch.manual_seed(0)
    free = generate(model, p["input_ids"], p["attention_mask"], eos_token_id=-1, **kw)
    # each prompt's most sampled token, so that both ids end some rows
    eos = [int(torch.bincount(free.completion_ids[r : r + 16].flatten()).argmax()) for r in (0, 16)]
    assert eos[0] != eos[1]
    torch.manual_seed(0)
    ro = generate(model, p["input_ids"], p["attention_mask"], eos_token_id=eos, **kw)
    ended_at = []
    for i in range(ro.completion_ids.shape[0]):
        n = int(ro.completion_mask[i].sum())
        last = int(ro.completion_ids[i, n - 1])
        assert (last in eos) != bool(ro.truncated[i]), i  # stopped at an EOS, or at the limit
        assert not any(int(t) in eos for t in ro.completion_ids[i, : n - 1]), i
        assert (ro.completion_ids[i, n:] == tok.pad_token_id).all()  # padding after the end
        ended_at += [last] if last in eos else []
    assert set(ended_at) == set(eos)  # both ids end rows


def test_tokenizers_round_trip_after_save_and_reload(real_dir, tmp_path):
    from transformers import AutoTokenizer

    from grpo.data.synthetic import make_sets
    from grpo.launch.paths import base_model_dir
    from grpo.models.prompts import render_prompt

    real = AutoTokenizer.from_pretrained(real_dir)
    assert type(real).__name__ == "Qwen2Tokenizer"
    cfg = small_config(tmp_path, "model.chat_template=true")
    texts = _texts() + [render_prompt(real, "What is 2+2?", cfg)]
    bad = [t for t in texts if real.decode(real(t, add_special_tokens=False)["input_ids"]) != t]
    assert not bad, bad[:3]
    assert "<|im_start|>system\n" in texts[-1] and texts[-1].endswith("<|im_start|>assistant\n")

    # the embedded tiny tokenizer, reloaded from a model directory as every stage loads it
    tiny = AutoTokenizer.from_pretrained(base_model_dir(cfg))
    sets = make_sets(cfg.data)
    pairs = [(r["prompt"], r.get("worked_solution")) for rows in sets.values() for r in rows]
    texts = [x for pair in pairs for x in pair]
    texts = [t for t in texts if t]
    bad = [t for t in texts if tiny.decode(tiny(t, add_special_tokens=False)["input_ids"]) != t]
    assert not bad, bad[:3]
    assert " " in tiny.decode(tiny("<think>5+8=13 7+0+1=8</think>")["input_ids"])


def test_step_ends_map_to_tokens_with_bpe(real_dir):
    from transformers import AutoTokenizer

    from grpo.models.offsets import char_to_token, token_char_ends

    def check(tok, ids, text):
        ends = token_char_ends(tok, ids)
        for c in range(len(text)):
            t = char_to_token(ends, c)
            # the token at which character c is complete, and not before
            assert tok.decode(ids[: t + 1]).startswith(text[: c + 1]), (c, t)
            assert t == 0 or not tok.decode(ids[:t]).startswith(text[: c + 1]), (c, t)

    real = AutoTokenizer.from_pretrained(real_dir)
    text = "<think>Café costs €13 each; 5+8=13</think>"  # é and € span 2 and 3 byte tokens
    ids = real(text, add_special_tokens=False)["input_ids"]
    assert any(len(real.decode([i])) == 0 or "\ufffd" in real.decode([i]) for i in ids)
    check(real, ids, text)
    # digits merged into one token ("13" is one GPT-2-style BPE token)
    merged = digit_merging_tokenizer()
    text = "It costs 13 dollars, 100 in all"
    ids = merged(text)["input_ids"]
    assert "Ġ13" in merged.convert_ids_to_tokens(ids)
    check(merged, ids, text)
    # a non-canonical spelling ("1" "3" where BPE would merge "13") maps correctly too
    spelled = merged("It costs 1")["input_ids"] + merged("3 dollars")["input_ids"]
    assert merged.decode(spelled) == "It costs 13 dollars"
    check(merged, spelled, "It costs 13 dollars")
    # EOS at the end belongs to no character: the last step still ends on a real token
    eos = real.convert_tokens_to_ids("<|im_end|>")
    ends = token_char_ends(real, [*real("12")["input_ids"], eos])
    assert ends[-1] == ends[-2] == 2


def test_training_forward_keeps_only_the_completion_logits(real_dir):
    from grpo.algo.logprobs import token_logprobs
    from grpo.models.forward import completion_logits
    from grpo.models.loading import load_model

    model = load_model(real_dir, trainable=False)
    shapes = []
    model.register_forward_hook(lambda m, a, out: shapes.append(tuple(out.logits.shape)))
    torch.manual_seed(0)
    prompt = torch.randint(10, 500, (3, 30))
    pmask = torch.ones_like(prompt)
    pmask[1, :7] = 0  # left padding
    comp = torch.randint(10, 500, (3, 6))
    cmask = torch.ones_like(comp)
    cmask[2, 4:] = 0
    with torch.no_grad():
        kept = completion_logits(model, prompt, pmask, comp, cmask)
        ids = torch.cat([prompt, comp], 1)
        mask = torch.cat([pmask, cmask], 1)
        full = model(
            input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(1) - 1).clamp(min=0)
        ).logits[:, 29:35]
    assert shapes[0] == (3, 7, model.config.vocab_size)  # C + 1 positions, not P + C
    torch.testing.assert_close(
        token_logprobs(kept, comp), token_logprobs(full, comp), atol=1e-5, rtol=1e-5
    )


def test_truncated_completions_can_be_masked_out_of_the_loss(tmp_path):
    from grpo.engine.loop import Trainer
    from grpo.launch.paths import base_model_dir
    from tests.helpers import fixed_rollout, per_token

    changed = {}
    for masked in (True, False):
        cfg = small_config(
            tmp_path / str(masked), "grpo.lr=0.01", "grpo.warmup_steps=0",
            f"grpo.mask_truncated_completions={masked}",
        )  # fmt: skip
        t = Trainer(cfg, base_model_dir(cfg), tmp_path / str(masked) / "grpo")
        ro = fixed_rollout(t.tok, ["<answer>46</answer>", "<answer>4</answer>"])
        ro.truncated[0] = True  # only the completion with a non-zero advantage
        before = [p.detach().clone() for p in t.engine.module.parameters()]
        t.update(ro, per_token(torch.tensor([1.0, 0.0]), ro), None)
        after = t.engine.module.parameters()
        changed[masked] = any(not torch.equal(a, b) for a, b in zip(before, after))
    assert changed == {True: False, False: True}


def _in_hub_cache(model: Path, cache: Path, repo: str) -> None:
    """`model` laid out as the Hugging Face cache holds a downloaded repository."""
    commit = "0123456789abcdef0123456789abcdef01234567"
    root = cache / ("models--" + repo.replace("/", "--"))
    shutil.copytree(model, root / "snapshots" / commit)
    (root / "refs").mkdir()
    (root / "refs" / "main").write_text(commit)


def test_a_hub_id_not_in_the_cache_is_one_line_naming_the_way_to_get_it(tmp_path, monkeypatch):
    from grpo.launch.paths import ModelPathError, model_path_dir

    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelPathError) as e:
        model_path_dir("acme/not-downloaded")
    msg = str(e.value)
    assert "\n" not in msg and "acme/not-downloaded" in msg and "HF_HUB_OFFLINE=0" in msg


def test_the_pipeline_runs_on_a_real_architecture(real_dir, tmp_path, monkeypatch):
    """sft.enabled false, GSM8K prompts in the chat template, accuracy + format rewards, a few
    GRPO steps, evaluation on GSM8K and MATH-500 subsets; registered like the toy. MATH-500
    holds prompts longer than grpo.max_prompt_length (768 here: the training prompts list the
    tool, up to 702 tokens) in this tokenizer: validation lets them through (evaluation can hold
    2048 - 12 tokens), as it must for the shipped Qwen2.5 config. The model is named by its Hub
    id, from a Hugging Face cache, offline (a user's `model.path: Qwen/Qwen2.5-0.5B-Instruct`
    once downloaded), in every stage and rank; with the calculator tool, shown in the system
    prompt (its template has no tool use)."""
    from mlflow import MlflowClient
    from prefect.testing.utilities import prefect_test_harness

    from flows.pipeline import PipelineParams, grpo_pipeline

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    _in_hub_cache(real_dir, tmp_path / "hub", "acme/realistic-qwen")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    overrides = [
        "model.path=acme/realistic-qwen", "model.chat_template=true", "sft.enabled=false",
        "data.task=files", f"data.train_path={ROOT / 'data/gsm8k/train.jsonl'}",
        "data.gsm8k_solutions=true", "grpo.steps=2", "grpo.prompts_per_step=2",
        "grpo.num_generations=4", "grpo.max_completion_length=12", "grpo.eval_every=0",
        "grpo.checkpoint_every=2", "eval.sets=[gsm8k, math500]",
        "eval.limit=6", "eval.max_new_tokens=12", f"output_dir={tmp_path / 'runs'}",
        "tracking.registered_model=realistic-e2e", "tracking.promotion_metric=eval/gsm8k/accuracy",
        "tools.functions=[calculator]", "grpo.max_prompt_length=768",
    ]  # fmt: skip
    from grpo.config import load_config
    from grpo.data.sets import eval_set
    from grpo.models.loading import load_tokenizer
    from grpo.models.prompts import prompt_token_counts

    cfg = load_config(ROOT / "configs/tiny.yaml", overrides)
    math500 = [r["prompt"] for r in eval_set("math500", cfg)]
    assert max(prompt_token_counts(load_tokenizer(real_dir), cfg, math500)) > 768
    with tracking_uri(uri), prefect_test_harness(server_startup_timeout=120):
        result = grpo_pipeline(
            PipelineParams(config=str(ROOT / "configs/tiny.yaml"), overrides=overrides)
        )
    c = MlflowClient(uri, uri)
    parent = c.get_run(result["parent_run_id"])
    assert parent.info.status == "FINISHED"
    runs = c.search_runs(
        [parent.info.experiment_id], f"tags.mlflow.parentRunId = '{parent.info.run_id}'"
    )
    by_name = by_stage(runs)
    assert {"validate", "sft", "grpo", "evaluate"} <= set(by_name)
    assert "sft_continued" not in by_name  # no SFT: no SFT control either
    grpo_run = by_name["grpo"].info.run_id
    assert [m.step for m in c.get_metric_history(grpo_run, "reward")] == [1, 2]
    for s in ("gsm8k", "math500"):
        assert f"grpo/eval/{s}/accuracy" in parent.data.metrics
        assert parent.data.metrics[f"grpo/eval/{s}/left_out"] == 0.0
    mv = c.get_model_version_by_alias("realistic-e2e", "challenger")
    assert mv.run_id == grpo_run
    # with a tool: episodes in training (their metrics), in evaluation (tool use per set), and
    # the registered model records the tools it was trained with, schemas included
    assert "tools/turns_mean" in c.get_run(grpo_run).data.metrics
    assert "grpo/eval/gsm8k/tool_use_rate" in parent.data.metrics
    import mlflow

    with tracking_uri(uri):
        info = mlflow.models.get_model_info(f"models:/realistic-e2e/{mv.version}")
    served = info.flavors["python_function"]["config"]
    assert served["tools"]["functions"] == ["calculator"]
    assert served["tools"]["schemas"][0]["function"]["name"] == "calculator"
    # served, it answers in episodes with the calculator available (greedy; the answer is the
    # last model turn)
    with tracking_uri(uri):
        served_model = mlflow.pyfunc.load_model(f"models:/realistic-e2e/{mv.version}")
    answers = served_model.predict(["What is 6 times 7?", "Add 2 and 3."],
                                   params={"max_new_tokens": 8})  # fmt: skip
    assert len(answers) == 2 and all(isinstance(x, str) for x in answers)
    assert served_model.unwrap_python_model().tools is not None
    assert c.get_run(grpo_run).data.params["model.path"] == "acme/realistic-qwen"

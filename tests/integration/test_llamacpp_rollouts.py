"""grpo.rollout_engine llama_cpp: the engine's log-probs are the trainer's at float32 weights,
before and after a weight sync; a dead engine ends the run in one line; two-step runs (sync and
async) train with it and log the mismatch the rollout correction weights."""

import json
import os
import signal

import pytest
import torch

from grpo.config import load_config
from grpo.engine.loop import Trainer
from grpo.launch.paths import base_model_dir
from grpo.models.forward import completion_logprobs
from grpo.models.loading import eos_token_ids, load_model, load_tokenizer
from grpo.models.prompts import encode_prompts
from tests.helpers import kill_after, small_config

pytest.importorskip(
    "llama_cpp", reason="llama-cpp-python is not installed (make install-llama-cpp)"
)
from grpo.models.llamacpp_engine import EngineError, LlamaCppEngine  # noqa: E402

pytestmark = pytest.mark.slow

# float32 weights on both sides: what is left is llama.cpp's kernels against torch's
# (benchmarks/ENGINE.md has the measured gaps)
F32_BOUND = 2e-3
LENGTH = "tests.trl_doc_rewards:reward_len"


def _gap(model, ro, temperature):
    """(largest, mean) |log pi - log mu| over the rollout's tokens, pi = `model`."""
    with torch.no_grad():
        lp, _ = completion_logprobs(model, ro.prompt_ids, ro.prompt_mask, ro.completion_ids,
                                    ro.completion_mask, temperature)  # fmt: skip
    d = (lp - ro.sampling_logps).abs() * ro.completion_mask
    return float(d.max()), float(d.sum() / ro.completion_mask.sum())


@pytest.fixture
def tiny(tmp_path):
    cfg = small_config(tmp_path, "grpo.rollout_engine=llama_cpp")
    base = base_model_dir(cfg)
    return cfg, load_model(base, "float32", trainable=False), load_tokenizer(base)


def _sample(engine, cfg, model, tok, temperature=1.0, **kw):
    ids, mask = encode_prompts(tok, ["12+34=", "7+5=", "310+2="], cfg, torch.device("cpu"))
    return engine.generate(ids, mask, num_generations=4, max_completion_length=20,
                           eos_token_id=eos_token_ids(tok, model),
                           pad_token_id=tok.pad_token_id, temperature=temperature,
                           **kw)  # fmt: skip


def test_engine_logprobs_are_the_trainers_and_follow_a_sync(tiny):
    cfg, model, tok = tiny
    engine = LlamaCppEngine(model, tok, dtype="float32", threads=1)
    try:
        torch.manual_seed(0)
        ro = _sample(engine, cfg, model, tok, temperature=0.7)
        assert ro.completion_ids.shape[0] == 12 and ro.group_size == 4
        largest, _ = _gap(model, ro, 0.7)
        assert largest < F32_BOUND
        # the same seed draws the same tokens: a resumed step samples what it would have
        torch.manual_seed(0)
        assert torch.equal(_sample(engine, cfg, model, tok, temperature=0.7).completion_ids,
                           ro.completion_ids)  # fmt: skip
        before = {n: p.clone() for n, p in model.state_dict().items()}
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p) * 0.05)
        engine.sync(model)
        assert engine.bytes_synced == sum(p.numel() * 4 for p in model.parameters())
        ro = _sample(engine, cfg, model, tok, top_k=5, top_p=0.9)
        # the engine's log-probs are the new weights' (over what top-k/top-p kept), not the old
        with torch.no_grad():
            new, _ = completion_logprobs(
                model,
                ro.prompt_ids,
                ro.prompt_mask,
                ro.completion_ids,
                ro.completion_mask,
                1.0,
                truncation=(5, 0.9),
            )
        m = ro.completion_mask
        assert float(((new - ro.sampling_logps).abs() * m).max()) < F32_BOUND
        model.load_state_dict(before)
        stale, _ = _gap(model, ro, 1.0)
        assert stale > 10 * F32_BOUND
        # greedy, back at the first weights: each token is the trainer's argmax at its
        # position (or within kernel noise of a tie), and a prompt's G rows agree
        engine.sync(model)
        ro = _sample(engine, cfg, model, tok, do_sample=False)
        rows = ro.completion_ids.view(3, 4, -1)
        assert all(torch.equal(rows[i, 0], rows[i, k]) for i in range(3) for k in range(4))
        ids = torch.cat([ro.prompt_ids, ro.completion_ids], 1)
        mask = torch.cat([ro.prompt_mask, ro.completion_mask], 1)
        with torch.no_grad():
            logits = model(input_ids=ids, attention_mask=mask).logits
        p = ro.prompt_ids.shape[1]
        at = logits[:, p - 1 : -1].float()  # predicts each completion token
        chosen = at.gather(2, ro.completion_ids.unsqueeze(2)).squeeze(2)
        short = (at.max(2).values - chosen) * ro.completion_mask
        assert float(short.max()) < F32_BOUND
    finally:
        engine.close()
    assert not engine.proc.is_alive() and not engine.dir.exists()


def _small(kind: str):
    """A 2-layer model of `kind` with the tiny tokenizer; llama untied and with attention
    biases (its q/k rows and biases are permuted on the way to llama.cpp)."""
    import transformers

    from grpo.models.tiny import build_tokenizer

    tok = build_tokenizer()
    torch.manual_seed(0)
    common = dict(vocab_size=len(tok), hidden_size=32, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, intermediate_size=48,
                  max_position_embeddings=128, pad_token_id=tok.pad_token_id,
                  eos_token_id=tok.eos_token_id, bos_token_id=None)  # fmt: skip
    if kind == "qwen2":
        return transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**common)).eval(), tok
    cfg = transformers.LlamaConfig(**common, attention_bias=True, tie_word_embeddings=False)
    return transformers.LlamaForCausalLM(cfg).eval(), tok


@pytest.mark.parametrize("kind", ["qwen2", "llama"])
@pytest.mark.parametrize("adapters", [False, True])
def test_both_architectures_and_lora_adapters_sample_as_the_trainer_scores(kind, adapters):
    from grpo.config import LoRAConfig
    from grpo.models import lora

    model, tok = _small(kind)
    with torch.no_grad():  # biases away from zero, so that a wrong layout would show
        for n, p in model.named_parameters():
            if n.endswith("bias"):
                p.normal_(0, 0.1)
    if adapters:
        model = lora.wrap(model, LoRAConfig(enabled=True, r=4, alpha=8.0)).eval()
    cfg = load_config(None, ["grpo.rollout_engine=llama_cpp"])

    def perturb():
        with torch.no_grad():
            for n, p in model.named_parameters():
                if not adapters or "lora_" in n:
                    p.add_(torch.randn_like(p) * 0.05)

    perturb()
    engine = LlamaCppEngine(model, tok, dtype="float32", threads=1)
    try:
        for _ in range(2):  # as written, then after another change and a sync
            engine.sync(model)
            torch.manual_seed(0)
            largest, _ = _gap(model, _sample(engine, cfg, model, tok), 1.0)
            assert largest < F32_BOUND
            perturb()
        full = sum(p.numel() * 4 for n, p in model.named_parameters() if "lora_" not in n)
        adapter_bytes = sum(p.numel() * 4 for n, p in model.named_parameters() if "lora_" in n)
        if adapters:  # only the adapters travel (plus the file's header)
            assert adapter_bytes <= engine.bytes_synced < adapter_bytes + 16384 < full
        else:
            assert engine.bytes_synced == full
    finally:
        engine.close()


def test_float16_weights_halve_the_sync_and_widen_the_gap(tiny):
    cfg, model, tok = tiny
    gaps, synced = {}, {}
    for dtype in ("float32", "float16"):
        engine = LlamaCppEngine(model, tok, dtype=dtype, threads=1)
        try:
            engine.sync(model)
            synced[dtype] = engine.bytes_synced
            torch.manual_seed(1)
            gaps[dtype] = _gap(model, _sample(engine, cfg, model, tok), 1.0)[1]
        finally:
            engine.close()
    matrices = sum(p.numel() for p in model.parameters() if p.dim() == 2)
    assert synced["float32"] - synced["float16"] == matrices * 2
    assert gaps["float32"] < gaps["float16"] < 0.05


def test_a_dead_engine_ends_the_call_in_one_line(tiny):
    cfg, model, tok = tiny
    engine = LlamaCppEngine(model, tok, dtype="float32", threads=1)
    try:
        os.kill(engine.proc.pid, signal.SIGKILL)
        with pytest.raises(EngineError) as e:
            _sample(engine, cfg, model, tok)
    finally:
        engine.close()
    msg = str(e.value)
    assert len(msg.splitlines()) == 1, msg
    assert "llama.cpp rollout engine" in msg and "exit code -9" in msg and "--resume" in msg


@pytest.mark.parametrize("mode", ["sync", "async", "lora"])
def test_two_steps_train_on_llama_cpp_rollouts_and_log_the_mismatch(tmp_path, mode):
    extra = {
        "sync": (),
        "async": ("grpo.async_rollouts=true", "grpo.max_staleness=0"),
        "lora": ("model.lora.enabled=true", "model.lora.r=2", "model.lora.alpha=4"),
    }[mode]
    # completion lengths differ within a group: every group has something to learn
    cfg = small_config(tmp_path, "grpo.rollout_engine=llama_cpp", "grpo.lr=0.01",
                       "grpo.warmup_steps=0", f"grpo.reward_funcs=[{LENGTH}]",
                       "grpo.reward_weights=[1.0]", *extra)  # fmt: skip
    assert cfg.grpo.rollout_correction  # on by default with another engine's numerics
    base = base_model_dir(cfg)
    threads = torch.get_num_threads()
    try:
        summary = Trainer(cfg, base, tmp_path / "grpo").train(progress=False)
    finally:
        torch.set_num_threads(threads)
    assert summary["generation_engine"] == "llama_cpp"
    rows = [json.loads(x) for x in (tmp_path / "grpo" / "metrics.jsonl").open()]
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        # the weights went to the engine each step, and its samples are the trainer's up to
        # kernels: the gap is numerics, and the correction's weights sit at 1
        assert r["time/weight_sync"] > 0 and r["engine/weight_sync_mib"] > 0
        assert 0 < r["logprob_gap/mean"] < F32_BOUND
        assert (r["logprob_gap/p50"] <= r["logprob_gap/p90"] <= r["logprob_gap/p99"]
                <= r["logprob_gap/max"])  # fmt: skip
        assert abs(r["mismatch/kl_k3"]) < 1e-4
        assert r["rollout_correction/weight_mean"] == pytest.approx(1.0, abs=1e-2)
        if mode == "async":
            assert r["async/numeric_gap/mean"] < F32_BOUND
    trained = load_model(tmp_path / "grpo" / "policy", "float32").state_dict()
    start = load_model(base, "float32").state_dict()
    assert any(not torch.equal(trained[k], start[k]) for k in start)


def test_a_run_whose_engine_dies_stops_in_one_line_and_resumes(tmp_path):
    cfg = small_config(tmp_path, "grpo.rollout_engine=llama_cpp", "grpo.steps=3",
                       f"grpo.reward_funcs=[{LENGTH}]", "grpo.reward_weights=[1.0]")  # fmt: skip
    base = base_model_dir(cfg)
    t = Trainer(cfg, base, tmp_path / "grpo")
    with pytest.raises(EngineError) as e:
        t.train(progress=False, on_step=kill_after(1, lambda: t.llama.proc.pid))
    msg = str(e.value)
    assert len(msg.splitlines()) == 1 and "llama.cpp rollout engine" in msg, msg
    assert not t.llama.dir.exists()  # its file went with it
    # the checkpoint of step 1 holds: a resume starts a new engine and finishes the run
    summary = Trainer(cfg, base, tmp_path / "grpo").train(resume=True, progress=False)
    assert summary["start_step"] == 1 and summary["final"]["step"] == 3

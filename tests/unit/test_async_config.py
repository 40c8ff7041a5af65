"""grpo.async_rollouts and grpo.rollout_engine as a user sets them: what they turn on, and what
they refuse."""

import pytest

from grpo.config import ConfigError, load_config


def test_async_turns_the_correction_on_unless_the_user_set_it():
    assert not load_config(None, []).grpo.rollout_correction
    assert load_config(None, ["grpo.async_rollouts=true"]).grpo.rollout_correction
    off = load_config(None, ["grpo.async_rollouts=true", "grpo.rollout_correction=false"])
    assert not off.grpo.rollout_correction
    # staleness 0 samples with the current weights: on-policy, nothing to correct
    assert not load_config(None, ["grpo.async_rollouts=true", "grpo.max_staleness=0"]
                           ).grpo.rollout_correction  # fmt: skip
    # another engine's numerics: corrected unless the user says otherwise
    assert load_config(None, ["grpo.rollout_engine=llama_cpp"]).grpo.rollout_correction
    assert not load_config(
        None, ["grpo.rollout_engine=llama_cpp", "grpo.rollout_correction=false"]
    ).grpo.rollout_correction


def test_the_llama_cpp_engine_without_its_package_is_refused_with_the_install_line(
    tmp_path, monkeypatch
):
    """Before anything is built: preflight names the package and the make target."""
    import importlib.util

    from grpo.launch.preflight import PreflightError, check_rollout_engine

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "llama_cpp" else real(name, *a),
    )
    check_rollout_engine(load_config(None, []))  # the default engine needs nothing
    with pytest.raises(PreflightError) as e:
        check_rollout_engine(load_config(None, ["grpo.rollout_engine=llama_cpp"]))
    msg = str(e.value)
    assert len(msg.splitlines()) == 1
    assert "llama-cpp-python" in msg and "make install-llama-cpp" in msg, msg


@pytest.mark.parametrize(
    ("sets", "words"),
    [
        (["grpo.max_staleness=2"], ["grpo.max_staleness", "grpo.async_rollouts=true"]),
        (["grpo.sampler_threads=1"], ["grpo.sampler_threads", "grpo.async_rollouts=true"]),
        (["grpo.sampler_dtype=bfloat16"], ["grpo.sampler_dtype", "grpo.async_rollouts=true"]),
        (["grpo.async_rollouts=true", "deepspeed.zero_stage=3"], ["zero_stage 3", "whole"]),
        (["grpo.async_rollouts=true", "grpo.sampler_dtype=int8"], ["sampler_dtype", "float16"]),
        (["grpo.llama_cpp_dtype=float16"], ["grpo.llama_cpp_dtype", "rollout_engine=llama_cpp"]),
        (["grpo.rollout_engine=vllm"], ["rollout_engine", "llama_cpp"]),
        (
            ["grpo.rollout_engine=llama_cpp", "tools.functions=[calculator]"],
            ["tools", "rollout_engine=policy"],
        ),
    ],
)
def test_async_settings_that_cannot_work_are_refused_naming_the_field(sets, words):
    with pytest.raises(ConfigError) as e:
        load_config(None, sets)
    msg = str(e.value)
    for w in words:
        assert w in msg, msg

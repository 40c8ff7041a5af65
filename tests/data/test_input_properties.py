"""Property-based: no input makes the loaders or the config parser raise a foreign error."""

import json
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from grpo.config import ConfigError, load_config
from grpo.data.files import DataError, normalize, read_rows

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=True) | st.text(max_size=20),
    lambda kids: (
        st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=8), kids, max_size=4)
    ),
    max_leaves=12,
)
SETTINGS = settings(max_examples=150, deadline=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture])  # fmt: skip


@SETTINGS
@given(st.binary(max_size=300))
def test_read_rows_on_arbitrary_bytes_raises_only_data_error(tmp_path, blob):
    p = tmp_path / "x.jsonl"
    p.write_bytes(blob)
    try:
        rows = read_rows(p)
    except DataError as e:
        assert "x.jsonl" in str(e)
        return
    assert all(isinstance(r, dict) for r in rows)


@SETTINGS
@given(st.lists(st.dictionaries(st.sampled_from(["id", "prompt", "answer", "x"]), json_values),
                max_size=5))  # fmt: skip
def test_normalize_on_arbitrary_rows_raises_only_data_error(rows):
    try:
        out = normalize(rows, "rows.jsonl")
    except DataError as e:
        assert "rows.jsonl" in str(e)
        return
    assert len(out) == len(rows) and len({r["id"] for r in out}) == len(out)
    assert all(isinstance(r["prompt"], str) and r["prompt"].strip() for r in out)


@SETTINGS
@given(st.text(max_size=200))
def test_config_file_with_arbitrary_text_raises_only_config_error(tmp_path, text):
    p = tmp_path / "c.yaml"
    p.write_text(text)
    try:
        load_config(p)
    except ConfigError as e:
        assert str(e)


keys = st.sampled_from(
    ["grpo.lr", "grpo.steps", "sft", "model.tiny.hidden_size", "run_name.x", "a..b", "",
     "deepspeed.nproc", "grpo.reward_funcs", "eval.sets", "data.min_digits"]
)  # fmt: skip


@SETTINGS
@given(st.lists(st.tuples(keys, json_values.map(json.dumps) | st.text(max_size=10)), max_size=4))
def test_overrides_raise_only_config_error(pairs):
    try:
        load_config(Path(__file__).resolve().parents[2] / "configs" / "tiny.yaml",
                    [f"{k}={v}" for k, v in pairs])  # fmt: skip
    except ConfigError as e:
        assert str(e)


def test_deeply_nested_json_and_empty_files(tmp_path):
    deep = tmp_path / "deep.jsonl"
    deep.write_text("[" * 100_000 + "]" * 100_000 + "\n")
    try:
        read_rows(deep)
    except DataError as e:
        assert "line 1" in str(e)
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n\n")
    assert read_rows(empty) == []
    try:
        normalize([], str(empty))
    except DataError as e:
        assert "no rows" in str(e)
    else:
        raise AssertionError("an empty set must be refused")

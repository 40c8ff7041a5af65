"""Bringing a GGUF model in: every way it can be misnamed or unreadable is one clear line."""

import pytest

from grpo.models import gguf
from grpo.models.loading import ModelDirError


def test_a_missing_package_or_file_is_named(tmp_path):
    with pytest.raises(ModelDirError, match="package 'no_such_pkg_xyz' is not installed"):
        gguf.resolve_gguf("no_such_pkg_xyz:model.gguf")
    with pytest.raises(ModelDirError, match="nope.gguf: GGUF file not found"):
        gguf.resolve_gguf(str(tmp_path / "nope.gguf"))
    with pytest.raises(ModelDirError, match="GGUF file not found"):
        gguf.resolve_gguf("json:no/such/file.gguf")  # an installed package, a wrong path


def test_missing_readers_are_named_with_the_install_command(tmp_path, monkeypatch, capsys):
    from cli.main import main

    f = tmp_path / "m.gguf"
    f.write_bytes(b"GGUF")
    monkeypatch.setattr(gguf, "NEEDS", ("gguf", "no_such_reader_xyz"))
    with pytest.raises(ModelDirError, match=r"needs the package\(s\) no_such_reader_xyz: pip"):
        gguf.convert_gguf(f, tmp_path / "out")
    with pytest.raises(SystemExit) as e:
        main(["import-gguf", str(f), "--cache", str(tmp_path / "cache")])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and "no_such_reader_xyz" in err[0]
    assert not (tmp_path / "cache").exists() or not any(
        (tmp_path / "cache").glob("m-*/config.json")
    )


@pytest.mark.real
def test_a_conversion_parses_the_file_once_and_puts_gguf_back_however_it_ends(tmp_path):
    """transformers builds gguf's reader three times and its name map once per module in one
    conversion: inside it each is built once; after it, even one
    that failed, gguf's own functions are back."""
    gg = pytest.importorskip("gguf", reason="the real extra (make install-real)")
    import numpy as np

    f = tmp_path / "t.gguf"
    w = gg.GGUFWriter(str(f), "llama")
    w.add_tensor("token_embd.weight", np.zeros((4, 2), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    reader, name_map = gg.GGUFReader, gg.get_tensor_name_map
    with pytest.raises(RuntimeError, match="conversion failed"), gguf._parsed_once():
        first = gg.GGUFReader(f)
        assert gg.GGUFReader(f) is first and first.tensors[0].name == "token_embd.weight"
        arch = gg.MODEL_ARCH.LLAMA
        assert gg.get_tensor_name_map(arch, 2) is gg.get_tensor_name_map(arch, 2)
        raise RuntimeError("conversion failed")
    assert (gg.GGUFReader, gg.get_tensor_name_map) == (reader, name_map)
    assert gg.GGUFReader(f) is not gg.GGUFReader(f)

"""Our lean GGUF reader against the gguf package's GGUFReader: the same metadata values and the same tensor
bytes, on the embedded SmolLM2 file (quantized types) and on a written file with every value kind; and a
clear ValueError, never a crash, on damaged files."""

import gguf
import numpy as np
import pytest

import flash_models as fm
from flash_models.checkpoint.gguf_reader import GGUFFile


def assert_same_as_gguf_package(path):
    ours, ref = GGUFFile(path), gguf.GGUFReader(str(path))
    expected = {k: f.contents() for k, f in ref.fields.items() if not k.startswith("GGUF.")}
    assert ours.fields == expected
    assert [t.name for t in ours.tensors] == [t.name for t in ref.tensors]
    for a, b in zip(ours.tensors, ref.tensors):
        assert a.tensor_type == b.tensor_type and a.shape == tuple(b.shape.tolist()), a.name
        assert a.data.dtype == b.data.dtype and a.data.shape == b.data.shape, a.name
        assert np.array_equal(a.data, b.data), a.name
    return ours


def test_embedded_smollm2_file():
    ours = assert_same_as_gguf_package(fm.smollm2_gguf())
    assert len(ours.fields["tokenizer.ggml.tokens"]) == 49152
    assert {t.tensor_type.name for t in ours.tensors} > {"F32"}  # quantized tensors are in there too


def write_sample(path, alignment=None):
    writer = gguf.GGUFWriter(str(path), "llama")
    if alignment is not None:
        writer.add_custom_alignment(alignment)
    writer.add_string("sample.name", "héllo wörld")
    writer.add_array("sample.words", ["a", "", "ünïcode", "merge one"])
    writer.add_array("sample.ints", [1, -2, 3])
    writer.add_array("sample.floats", [0.5, -1.25])
    writer.add_bool("sample.flag", True)
    writer.add_uint32("sample.count", 7)
    writer.add_float32("sample.eps", 1e-5)
    writer.add_tensor("f32", np.arange(12, dtype=np.float32).reshape(3, 4))
    writer.add_tensor("f16", np.linspace(-1, 1, 10, dtype=np.float16))
    writer.add_tensor("i32", np.arange(6, dtype=np.int32).reshape(2, 3))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize("alignment", [None, 64])
def test_written_file_with_every_value_kind(tmp_path, alignment):
    ours = assert_same_as_gguf_package(write_sample(tmp_path / "sample.gguf", alignment))
    assert ours.fields["sample.name"] == "héllo wörld" and ours.fields["sample.flag"] is True
    assert ours.fields["sample.words"] == ["a", "", "ünïcode", "merge one"]
    np.testing.assert_array_equal(ours.tensors[0].data, np.arange(12, dtype=np.float32).reshape(3, 4))


def test_damaged_files_raise_value_error(tmp_path):
    good = write_sample(tmp_path / "good.gguf").read_bytes()
    cases = {"empty": b"", "magic": b"GGUX" + good[4:], "header": good[:10], "metadata": good[:120],
             "tensor data": good[:-40]}  # the file ends in up to 31 bytes of alignment padding
    for what, content in cases.items():
        broken = tmp_path / f"{what}.gguf"
        broken.write_bytes(content)
        with pytest.raises(ValueError, match="not a valid GGUF file"):
            GGUFFile(broken)

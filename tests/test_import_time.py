"""What ``import flash_models`` pulls in: nothing heavy until a name is used (no torch, transformers, Triton or
torch._dynamo), so scripts and the command line start at once. Checked in a fresh interpreter."""

import subprocess
import sys

import pytest

HEAVY = ("torch", "transformers", "triton", "torch._dynamo")


def _imported_after(code: str) -> list[str]:
    probe = f"import sys\n{code}\nprint(' '.join(m for m in {HEAVY!r} if m in sys.modules))"
    return subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout.split()


@pytest.mark.parametrize("code", ["import flash_models", "import flash_models.cli", "import flash_kernels",
                                  "import flash_models.checkpoint", "import flash_models.train.preflight"])
def test_import_pulls_in_nothing_heavy(code):
    assert _imported_after(code) == []


def test_names_still_resolve_on_use():
    code = ("import flash_models as fm, flash_kernels as fk\n"
            "assert 'llama' in fm.families() and 'gpt2' in fm.list_models()\n"
            "assert callable(fm.from_pretrained) and callable(fm.generation.stream) and callable(fk.rms_norm)\n"
            "assert set(fm.__all__) <= set(dir(fm)) and set(fk.__all__) <= set(dir(fk))")
    assert "torch" in _imported_after(code)


def test_unknown_name_is_an_attribute_error():
    import flash_kernels
    import flash_models

    for module in (flash_models, flash_kernels):
        with pytest.raises(AttributeError, match="no attribute 'nope'"):
            module.nope


def test_an_op_named_like_its_module_stays_the_function():
    code = ("import flash_kernels, flash_kernels.kv_append, flash_kernels.gemv\n"
            "from flash_kernels.cross_entropy import cross_entropy_ref\n"
            "import types\n"
            "for name in ('kv_append', 'gemv', 'cross_entropy', 'fused_dense', 'linear_act', 'linear_cross_entropy'):\n"
            "    assert isinstance(getattr(flash_kernels, name), types.FunctionType), name")
    _imported_after(code)

"""What ``import flash_models`` pulls in: nothing heavy until a name is used (no torch, transformers, Triton or
torch._dynamo), so scripts and the command line start at once. Checked in a fresh interpreter."""

import os
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


# transformers' config classes import its image utilities, which import torchvision where it is installed, and
# torchvision.ops imports torch._dynamo: that chain is transformers' and torchvision's, so the child hides
# torchvision, as on a machine without it, and the test sees what flash_models itself imports.
_CPU_RUN = """
import sys
sys.modules["torchvision"] = None
import torch
import flash_models as fm
model = fm.create_model("llama-1b", hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, vocab_size=101).eval()
ids = torch.randint(0, 101, (2, 7))
model(ids)
model.generate(ids, max_new_tokens=4, eos_token_id=[])
gpt2 = fm.create_model("gpt2", n_layer=2, n_embd=32, n_head=2, vocab_size=101, n_positions=32, bos_token_id=0, eos_token_id=0)
gpt2(ids, labels=ids).loss.backward()
smollm2 = fm.from_pretrained(fm.smollm2_gguf())
smollm2.generate(ids, max_new_tokens=3, eos_token_id=[])
import flash_kernels as fk
try:
    fk.rms_norm(torch.randn(3, 8), torch.ones(8), backend="triton")
except ValueError as e:  # the error says why Triton is not there and how to get its interpreter
    assert "TRITON_INTERPRET=1" in str(e) and "no CUDA GPU" in str(e), e
else:
    raise AssertionError("backend='triton' where Triton cannot run must raise")
"""


@pytest.mark.slow
def test_cpu_model_load_and_generate_import_neither_triton_nor_dynamo():
    """A CPU machine (CUDA hidden, no Triton interpreter): model creation, a GGUF load, forward, backward and
    generate run on the references, so Triton (which cannot run there) and torch._dynamo (nothing compiles)
    stay unimported: together seconds of a program's start."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # conftest sets it for the kernel tests
    env["CUDA_VISIBLE_DEVICES"] = ""
    probe = f"{_CPU_RUN}\nprint(' '.join(m for m in ('triton', 'torch._dynamo') if m in sys.modules))"
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split() == []

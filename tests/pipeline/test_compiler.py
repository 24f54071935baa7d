"""--compile and --decode compiled on a host without the compiler torch.compile's code needs: refused in one line
when the role starts, not at its first step deep in inductor."""

from __future__ import annotations

import stat
import sysconfig

import pytest
import torch
from torch._inductor import config as inductor

pytest.importorskip("transformers", reason="needs the hf extra: pip install -e '.[hf]'")

from pipeline_support import tiny_qwen2

from pipeline.models import BuiltinEngine, ModelError, compile_blocks, missing_compiler

CPU, CUDA = torch.device("cpu"), torch.device("cuda")  # a device object needs no GPU


class Tokenizer:
    pad_token_id = 0
    eos_token_id = 2


@pytest.fixture
def bare_path(tmp_path, monkeypatch):
    """A PATH with nothing on it but what a test puts there, and no compiler named by $CC or inductor's setting."""
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.delenv("CC", raising=False)
    with inductor.patch({"cpp.cxx": (None, "g++")}):
        yield tmp_path


def put(folder, name):  # type: ignore[no-untyped-def]
    tool = folder / name
    tool.write_text("#!/bin/sh\n")
    tool.chmod(tool.stat().st_mode | stat.S_IXUSR)


def test_without_a_compiler_each_device_says_which_it_needs(bare_path):
    assert missing_compiler(CPU) == "inductor's CPU code needs a C++ compiler (g++; $CXX names another): none found"
    assert missing_compiler(CUDA) == "Triton's kernels need a C compiler (clang or gcc; $CC names another): none found"
    put(bare_path, "g++")
    assert missing_compiler(CPU) is None
    put(bare_path, "gcc")
    assert missing_compiler(CUDA) is None


def test_the_compilers_named_by_cc_and_inductors_setting_are_the_ones_looked_for(bare_path, monkeypatch):
    put(bare_path, "g++")
    put(bare_path, "gcc")
    monkeypatch.setenv("CC", "my-cc")
    with inductor.patch({"cpp.cxx": (None, "my-c++")}):
        assert "(my-c++; $CXX names another)" in str(missing_compiler(CPU))
        assert "(my-cc; $CC names another)" in str(missing_compiler(CUDA))
        put(bare_path, "my-c++")
        put(bare_path, "my-cc")
        assert missing_compiler(CPU) is None and missing_compiler(CUDA) is None


def test_triton_without_pythons_headers_is_named(bare_path, monkeypatch):
    put(bare_path, "clang")
    headers = bare_path / "include"
    monkeypatch.setattr(sysconfig, "get_paths", lambda: {"include": str(headers)})
    assert (
        missing_compiler(CUDA)
        == f"Triton's kernels need Python's headers (Python.h in {headers}; the python3-dev package)"
    )
    headers.mkdir()
    (headers / "Python.h").touch()
    assert missing_compiler(CUDA) is None


def test_compiled_blocks_are_refused_where_there_is_no_compiler(bare_path):
    model = tiny_qwen2()
    with pytest.raises(
        ModelError, match=r"^--compile on cpu: inductor's CPU code needs a C\+\+ compiler .*none found; install"
    ):
        compile_blocks(model)
    assert all(block._compiled_call_impl is None for block in model.model.layers), "refused before compiling any"


def test_a_compiled_decode_is_refused_when_the_engine_is_made(bare_path):
    with pytest.raises(ModelError, match=r"^--decode compiled on cpu: inductor's CPU code needs a C\+\+ compiler"):
        BuiltinEngine(tiny_qwen2(), Tokenizer(), "compiled")
    BuiltinEngine(tiny_qwen2(), Tokenizer(), "static")  # the paths that compile nothing need no compiler

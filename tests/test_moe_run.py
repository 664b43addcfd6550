"""Experts of a mixture-of-experts model kept in CPU memory (issue 21, "Running it"): the options, the
printed flags and JSON, and a real qwen3moe GGUF loaded by the real llama.cpp with tensor buffer overrides,
on one device and on two local RPC workers (`--simulate 8,8`)."""

from __future__ import annotations

import ctypes
import json
import re
import shlex

import pytest

import ctxq
from ctxq import rpc
from ctxq.llama import backend
from ctxq.llama.overrides import cpu_buffer_type, expert_layers, expert_pattern
from ctxq.planning.plan import ExpertPlacement
from ctxq.planning.planner import plan
from ctxq.rpc import generate_greedy
from ctxq.runtime import runner
from ctxq.testing.moe import expert_bytes, tiny_moe_gguf
from ctxq.units import MiB

from .conftest import run_ctxq

PROMPT = "The river city library stood by the quiet green market in the morning"
N_PREDICT = 12
EXPERT_TENSORS = ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")
_OVERRIDDEN = re.compile(r"tensor (\S+) \(\d+ MiB \S+\) buffer type overridden to (\S+)")


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    """4 layers, 128 wide, 8 experts of width 128 (2 used), SmolLM2's tokenizer, random F16 weights."""
    return tiny_moe_gguf(tmp_path_factory.mktemp("moe") / "tiny-qwen3moe.gguf")


def _experts(layers) -> dict[str, str]:
    return {f"blk.{il}.{t}.weight": "CPU" for il in layers for t in EXPERT_TENSORS}


# --- the patterns, the flags, the JSON ----------------------------------------------------------

def test_patterns_match_expert_tensors_only():
    kinds = ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps", "ffn_gate_up_exps", "ffn_up_chexps", "ffn_gate_inp",
             "ffn_gate_inp_shexp", "ffn_up_shexp", "ffn_down_shexp", "ffn_gate", "attn_q")
    names = [f"blk.{il}.{k}.weight" for il in (1, 11) for k in kinds]
    assert [n for n in names if re.search(expert_pattern(1), n)] == [f"blk.1.{k}.weight" for k in kinds[:5]]
    assert expert_layers(names) == [1, 11]
    assert expert_layers(["blk.0.ffn_up.weight", "blk.0.ffn_up_shexp.weight", "blk.0.ffn_gate_inp.weight"]) == []


def test_flags_say_where_the_experts_are(moe):
    base = plan(moe, 1024)
    assert base.expert_layers == [0, 1, 2, 3] and base.cpu_expert_layers == [] and "moe" not in base.llama_flags()
    every = plan(moe, 1024, cpu_moe=True)
    assert every.cpu_expert_layers == [0, 1, 2, 3] and every.llama_flags().endswith(" -fa on --cpu-moe")
    assert plan(moe, 1024, n_cpu_moe=4).llama_flags().endswith(" --cpu-moe")  # all four: the same thing
    two = plan(moe, 1024, n_cpu_moe=2)
    assert two.llama_flags().endswith(" -fa on --n-cpu-moe 2")
    assert two.expert_overrides() == [r"blk\.0\.ffn_(up|down|gate|gate_up)_(ch|)exps",
                                      r"blk\.1\.ffn_(up|down|gate|gate_up)_(ch|)exps"]
    assert plan(moe, 1024, n_cpu_moe=0).cpu_expert_layers == []
    assert any("experts of 2 of 4 layers are kept in CPU memory" in n for n in two.notes)
    # Layers that are not the first N: one -ot pattern naming them, quoted for a shell, that matches their
    # expert tensors and no other tensor (llama.cpp searches every tensor name with it).
    odd = ExpertPlacement([0, 1, 2, 3], [1, 3]).apply(plan(moe, 1024))
    words = shlex.split(odd.llama_flags())
    assert words[-2] == "-ot" and words[-1] == r"blk\.(1|3)\.ffn_(up|down|gate|gate_up)_(ch|)exps=CPU"
    names = [f"blk.{il}.{k}.weight" for il in (1, 3, 11, 13, 31) for k in
             ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps", "ffn_gate_inp", "ffn_up_shexp", "attn_q")]
    matched = [n for n in names if re.search(words[-1].removesuffix("=CPU"), n)]
    assert matched == [f"blk.{il}.ffn_{k}_exps.weight" for il in (1, 3) for k in ("gate", "up", "down")]
    # A model whose layer 0 is dense (DeepSeek's leading dense blocks): experts below 3 are layers 1-2.
    lead = ExpertPlacement([1, 2, 3], [1, 2]).apply(plan(moe, 1024))
    assert lead.llama_flags().endswith(" --n-cpu-moe 3")


def test_json_carries_the_placement(moe):
    r = run_ctxq("plan", str(moe), "-c", "1024", "-ncmoe", "2", "--json")
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    assert d["expert_layers"] == [0, 1, 2, 3] and d["cpu_expert_layers"] == [0, 1]
    assert d["expert_overrides"] == [expert_pattern(0), expert_pattern(1)]
    assert d["llama_flags"].endswith("--n-cpu-moe 2")


# --- bad input: one line ------------------------------------------------------------------------

def test_n_cpu_moe_beyond_the_layer_count_is_one_line(moe):
    r = run_ctxq("run", str(moe), "-p", "hi", "--n-cpu-moe", "5")
    assert r.returncode == 1 and r.stdout == ""
    assert r.stderr == ("Error: --n-cpu-moe 5 is beyond this model's 4 layers; use --n-cpu-moe 4 or --cpu-moe "
                        "for all of them\n")


def test_expert_options_on_a_dense_model_are_one_line(smollm2, capsys):
    from ctxq.cli import main

    with pytest.raises(SystemExit) as e:
        main(["plan", str(smollm2), "-c", "1024", "--cpu-moe"])
    err = capsys.readouterr().err
    assert e.value.code == 1 and err.count("\n") == 1
    assert err.startswith("Error: --cpu-moe keeps the experts of a mixture-of-experts model in CPU memory, "
                          "but this model has no expert tensors")


def test_a_missing_expert_tensor_is_one_line_naming_it(tmp_path):
    broken = tiny_moe_gguf(tmp_path / "broken.gguf", missing="blk.2.ffn_up_exps.weight")
    r = run_ctxq("run", str(broken), "-c", "512", "-p", "hi", "-n", "2", "--cpu-moe")
    assert r.returncode == 1 and r.stderr.count("\n") == 1, r.stderr
    # the planner reads the header first and names the tensor before llama.cpp is asked (gguf.info)
    assert r.stderr.startswith("Error: ") and "blk.2.ffn_up_exps.weight is missing" in r.stderr


# --- the real llama.cpp: one device ------------------------------------------------------------

def test_the_override_buffer_type_is_ggml_cpu_buffer_type():
    """The device API's CPU buffer type is the pointer llama.cpp compares overrides with."""
    base = ctypes.CDLL(str(backend.lib_dir() / "libggml-base.so.0"))
    base.ggml_backend_cpu_buffer_type.restype = ctypes.c_void_p
    assert cpu_buffer_type() == base.ggml_backend_cpu_buffer_type() != 0


def test_experts_forced_to_the_cpu_give_the_same_tokens_on_one_device(moe):
    plain = runner.run(moe, PROMPT, n_ctx=512, n_predict=N_PREDICT, temp=0, n_threads=1)
    with backend.capture_log() as lines:
        forced = runner.run(moe, PROMPT, n_ctx=512, n_predict=N_PREDICT, temp=0, n_threads=1, cpu_moe=True)
    logged = {m.group(1): m.group(2) for line in lines if (m := _OVERRIDDEN.search(line))}
    assert logged == _experts(range(4))  # every expert tensor, no router, nothing else
    assert len(set(plain.tokens)) > N_PREDICT // 2  # varied text: the experts shape it
    assert forced.tokens == plain.tokens
    assert forced.plan.cpu_expert_layers == [0, 1, 2, 3]


def test_load_keeps_the_overrides_alive_with_the_model(moe):
    llm = ctxq.load(moe, n_ctx=512, n_cpu_moe=2)
    try:
        ov = llm.ctxq_overrides
        assert ov.patterns == llm.ctxq_plan.expert_overrides() == [expert_pattern(0), expert_pattern(1)]
        assert ov.overridden == _experts([0, 1])
        # the params struct llama.cpp read points at the array the model holds
        assert llm.model_params.tensor_buft_overrides == ctypes.addressof(ov.array)
        assert ov.array[2].pattern is None and ov.array[0].buft == cpu_buffer_type()  # NULL-terminated
    finally:
        llm.close()
    plain = ctxq.load(moe, n_ctx=512)
    try:
        assert plain.ctxq_overrides is None and not plain.model_params.tensor_buft_overrides
    finally:
        plain.close()


# --- the real llama.cpp: two RPC workers (--simulate 8,8) ----------------------------------------

@pytest.mark.slow
def test_experts_forced_to_the_cpu_over_simulate_8_8_give_the_same_tokens(moe):
    """`ctxq run --simulate 8,8 --cpu-moe`: the same greedy tokens as one device without overrides.
    About 5 s (two runs, two workers each)."""
    common = ["run", str(moe), "-c", "512", "-p", PROMPT, "-n", str(N_PREDICT), "--temp", "0", "-t", "1", "--json"]
    one = run_ctxq(*common)
    sim = run_ctxq(*common, "--simulate", "8,8", "--cpu-moe")
    assert one.returncode == 0 and sim.returncode == 0, one.stderr + sim.stderr
    one, sim = json.loads(one.stdout), json.loads(sim.stdout)
    assert sim["plan"]["tensor_split"] == [3, 2] and sim["plan"]["cpu_expert_layers"] == [0, 1, 2, 3]
    assert "--cpu-moe" in sim["plan"]["llama_flags"]
    assert sim["tokens"] == one["tokens"] and len(one["tokens"]) == N_PREDICT


@pytest.mark.slow
def test_overridden_expert_bytes_move_from_the_workers_to_the_host(moe):
    """Layers 1 and 3 keep their experts in host memory (one on each worker): each worker's model
    buffer shrinks by its layer's expert bytes, the host's mapped buffer reaches them, and the tokens
    stay. About 5 s."""
    tol = MiB // 100  # llama.cpp prints MiB with 2 decimals: 0.005 MiB per line, two lines compared
    with rpc.start_workers("8,8", threads=1) as w:
        p = ExpertPlacement([0, 1, 2, 3], [1, 3]).apply(plan(moe, 512, rpc=w.rpc_spec))
        assert p.tensor_split == [3, 2] and p.device_order is None
        kw = {**p.llama_kwargs(), "n_threads": 1}
        plain = rpc.run_supervised(generate_greedy, str(moe), PROMPT, N_PREDICT, rpc=w.endpoints, workers=w, **kw)
        forced = rpc.run_supervised(generate_greedy, str(moe), PROMPT, N_PREDICT, rpc=w.endpoints, workers=w,
                                    cpu_patterns=tuple(p.expert_overrides()), **kw)
    assert forced.tokens == plain.tokens and forced.devices == ["RPC0", "RPC1"]
    a, b = plain.allocations, forced.allocations
    assert a.layers == b.layers == {0: "RPC0", 1: "RPC0", 2: "RPC0", 3: "RPC1", 4: "RPC1"}
    for endpoint, layer in zip(w.endpoints, (1, 3)):  # RPC0 holds layer 1, RPC1 layer 3
        name = next(n for n in a.model if n.endswith(f"[{endpoint}]"))  # "RPC0[host:port]" on either worker
        moved = a.model[name] - b.model[name]
        assert abs(moved - expert_bytes(moe, [layer])) <= tol, (name, moved)

    assert expert_bytes(moe, [1, 3]) == 2 * 3 * 8 * 128 * 128 * 2  # 2 layers x 3 tensors x 8 experts, F16
    # The host maps its weights from the file (mmap): one CPU_Mapped buffer spanning the file from its
    # first host tensor to its last (llama_model_loader::get_mapping_range), so it now reaches the end
    # of layer 3's experts; without overrides it held token_embd alone.
    assert set(a.model) - {n for n in a.model if n.startswith("RPC")} == {"CPU_Mapped"} == \
        set(b.model) - {n for n in b.model if n.startswith("RPC")}
    assert abs(a.model["CPU_Mapped"] - _mapped_span(moe, ["token_embd.weight"])) <= tol
    host = ["token_embd.weight", *(f"blk.{il}.{t}.weight" for il in (1, 3) for t in EXPERT_TENSORS)]
    assert abs(b.model["CPU_Mapped"] - _mapped_span(moe, host)) <= tol


@pytest.mark.slow
def test_memory_table_says_the_host_figure_is_a_mapped_range(moe):
    """Experts in host memory, layers on two workers: llama.cpp's CPU_Mapped is the file range from the
    first host tensor to the last (device layers' tensors between them), the plan counts the host's own
    tensors; the table marks the host row and says which is which (issue 39). About 8 s (three runs)."""
    common = ["run", str(moe), "-c", "512", "-p", PROMPT, "-n", "2", "--temp", "0", "-t", "1", "--simulate", "8,8"]
    text = run_ctxq(*common, "--cpu-moe")
    assert text.returncode == 0, text.stderr
    host = re.search(r"^CPU \*\s+(\S+ MiB)\s+(\S+ MiB)", text.stderr, re.M)
    assert host, text.stderr
    assert "* CPU compares two things: planned, the host's resident tensors (" in text.stderr
    assert "llama.cpp, its mapped range\n  (CPU_Mapped, " in text.stderr
    assert "the file from the first host tensor to the last, device layers' tensors between them included" in text.stderr

    d = json.loads(run_ctxq(*common, "--cpu-moe", "--json").stdout)
    cpu = d["memory"][-1]
    spanned = ["token_embd.weight", *(f"blk.{il}.{t}.weight" for il in range(4) for t in EXPERT_TENSORS)]
    assert abs(cpu["mapped"] - _mapped_span(moe, spanned)) <= MiB // 100  # llama.cpp prints 2 decimals of MiB
    assert cpu["tensors"] == d["plan"]["host"]["weights"] < cpu["mapped"] <= cpu["reported"]

    plain = run_ctxq(*common)  # every tensor where its layer is: the host maps token_embd alone, no note
    assert plain.returncode == 0 and "compares two things" not in plain.stderr and "CPU *" not in plain.stderr


def _mapped_span(path, names) -> int:
    """Bytes of the file from the first of these tensors to the end of the last."""
    from ctxq.gguf.reader import read_gguf

    ts = [t for t in read_gguf(path, skip_arrays=True).tensors if t.name in names]
    assert len(ts) == len(names)
    return max(t.offset + t.nbytes for t in ts) - min(t.offset for t in ts)

"""Option plumbing of `ctxq plan`, `run` and `serve`, in process with click's CliRunner: the library call
is patched to record what reaches it (the real calls are exercised end to end in test_plan/test_run)."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from ctxq.cli import cli, main
from ctxq.errors import InvalidOption
from ctxq.conversion import hfplan
from ctxq.planning import planner
from ctxq.planning.devices import Device
from ctxq.planning.options import PlanOptions
from ctxq.planning.plan import DevicePlan, Plan
from ctxq.runtime import runner

GiB = 1024**3


class Reached(Exception):
    """Raised by a patched library call once it has recorded its arguments."""


@pytest.fixture
def record(monkeypatch):
    """record(module, name) patches module.name to store its arguments and stop the command."""
    calls = []

    def patch(module, name):
        def fake(*args, **kwargs):
            calls.append((args, kwargs))
            raise Reached
        monkeypatch.setattr(module, name, fake)
        return calls

    return patch


def _invoke(*args):
    return CliRunner().invoke(cli, list(args))


def test_run_flags_reach_the_library_as_plan_options(record):
    calls = record(runner, "prepare")
    r = _invoke("run", "m.gguf", "-c", "8192", "-ctk", "q8_0", "-fa", "off", "-ts", "1,1", "--gpus", "8,8",
                "-p", "hi", "-n", "9", "--chat")
    assert isinstance(r.exception, Reached), r.output
    (args, kwargs), = calls
    assert args == ("m.gguf", "hi") and kwargs["n_predict"] == 9 and kwargs["chat"] is True
    assert kwargs["options"] == PlanOptions(n_ctx=8192, type_k="q8_0", flash_attn=False, split="1,1", gpus="8,8")


def test_run_without_flags_leaves_every_option_unset(record):
    calls = record(runner, "prepare")
    r = _invoke("run", "-p", "hi")
    assert isinstance(r.exception, Reached), r.output
    assert calls[0][1]["options"] == PlanOptions()  # "not given": the library's defaults apply
    assert PlanOptions().resolved() == PlanOptions(n_ctx=4096, n_batch=2048, n_ubatch=512, kv="auto",
                                                   prefer="quality", flash_attn=True, reorder=True, split_mode="layer",
                                                   offload="auto")


def test_serve_flags_reach_the_plan(record):
    calls = record(runner, "make_plan")
    r = _invoke("serve", "m.gguf", "--kv", "q4_0", "-b", "1024", "-ub", "256", "--prefer", "speed", "-fa", "on",
                "--profile", "3x16-2x8")
    assert isinstance(r.exception, Reached), r.output
    assert calls[0][1]["options"] == PlanOptions(kv="q4_0", n_batch=1024, n_ubatch=256, prefer="speed",
                                                 flash_attn=True, profile="3x16-2x8")


def test_plan_flags_reach_the_planner(record):
    calls = record(planner, "plan")
    r = _invoke("plan", "m.gguf", "-c", "65536", "--simulate", "16,8", "-ctv", "q4_0", "--cpu-memory", "32",
                "-fa", "auto")
    assert isinstance(r.exception, Reached), r.output
    assert calls[0][1]["options"] == PlanOptions(n_ctx=65536, simulate="16,8", type_v="q4_0", cpu_memory=32 * GiB)


def test_plan_of_a_hf_model_passes_plan_options_to_each_candidate(record, tmp_path):
    calls = record(hfplan, "plan_hf")
    r = _invoke("plan", str(tmp_path), "-c", "32768", "--kv", "q8_0", "-fa", "on", "-b", "512", "--simulate", "8")
    assert isinstance(r.exception, Reached), r.output
    assert calls[0][1]["options"] == PlanOptions(n_ctx=32768, kv="q8_0", flash_attn=True, n_batch=512, simulate="8")


@pytest.mark.parametrize("args, options", [
    (["run", "m.gguf", "-p", "hi", "--cpu-moe"], PlanOptions(cpu_moe=True)),
    (["run", "m.gguf", "-p", "hi", "-cmoe", "-ncmoe", "3"], PlanOptions(cpu_moe=True, n_cpu_moe=3)),
    (["run", "m.gguf", "-p", "hi", "--n-cpu-moe", "0"], PlanOptions(n_cpu_moe=0)),
])
def test_expert_flags_are_spelled_as_llama_cpp_spells_them(record, args, options):
    calls = record(runner, "prepare")
    r = _invoke(*args)
    assert isinstance(r.exception, Reached), r.output
    assert calls[0][1]["options"] == options


def test_expert_flags_reach_plan_and_serve(record):
    calls = record(planner, "plan")
    r = _invoke("plan", "m.gguf", "-c", "4096", "-ncmoe", "12")
    assert isinstance(r.exception, Reached), r.output
    assert calls[-1][1]["options"] == PlanOptions(n_ctx=4096, n_cpu_moe=12)
    calls = record(runner, "make_plan")
    r = _invoke("serve", "m.gguf", "--cpu-moe")
    assert isinstance(r.exception, Reached), r.output
    assert calls[-1][1]["options"] == PlanOptions(cpu_moe=True)


@pytest.mark.parametrize("args, words", [
    (["--svg", "x.svg"], "Error: --svg draws one plan"),
    (["-ts", "1,1", "--gpus", "8,8"], "Error: a -ts is evaluated for one GGUF file"),
])
def test_plan_of_a_hf_model_refuses_what_makes_no_sense_there(tmp_path, capsys, args, words):
    with pytest.raises(SystemExit) as e:
        main(["plan", str(tmp_path), "-c", "4096", *args])
    err = capsys.readouterr().err
    assert e.value.code == 1 and err.startswith(words) and err.count("\n") == 1, err
    assert not (tmp_path / "x.svg").exists()


def _plan() -> Plan:
    gpu = [Device(f"GPU{i}", "gpu", 16 * GiB, 16 * GiB, 288e9) for i in range(2)]
    host = DevicePlan(Device("CPU", "cpu", 64 * GiB, 60 * GiB, 30e9), [], weights=GiB, compute=GiB // 4, margin=GiB)
    gpus = [DevicePlan(gpu[0], list(range(0, 16)), weights=6 * GiB, kv=2 * GiB, compute=GiB // 2, margin=GiB // 2,
                       cuda_copies=GiB // 4, cuda_pool=GiB // 4),
            DevicePlan(gpu[1], list(range(16, 33)), weights=7 * GiB, kv=2 * GiB, compute=GiB, margin=GiB // 2)]
    return Plan(model="/models/m.gguf", n_ctx=65536, n_batch=2048, n_ubatch=512, type_k="q8_0", type_v="q8_0",
                flash_attn=True, n_gpu_layers=33, tensor_split=[16, 17], gpus=gpus, host=host, n_layer=32,
                reason="all layers on the GPUs", est_decode_tps=12.5)


def test_plan_renders_the_table(monkeypatch):
    monkeypatch.setattr(planner, "plan", lambda model, options: _plan())
    r = _invoke("plan", "m.gguf", "-c", "65536")
    assert r.exit_code == 0, r.output
    lines = r.output.splitlines()
    assert lines[0] == "model m.gguf: 32 layers, context 65,536 tokens, KV q8_0/q8_0, flash attention on"
    assert lines[1].split() == ["device", "layers", "weights", "KV", "compute", "CUDA", "reserve", "total", "capacity",
                                "free", "use"]
    assert lines[3].split() == ["GPU0", "16", "(0-15)", "6.00", "2.00", "0.50", "0.50", "0.50", "9.50", "16.00", "6.50",
                                "59%"]
    assert lines[4].split()[:3] == ["GPU1", "16", "(16-31+out)"] and lines[5].split()[:2] == ["CPU", "0"]
    assert "llama.cpp flags: -c 65536 -b 2048 -ub 512 -ngl 33 -sm layer -ts 16,17 -ctk q8_0 -ctv q8_0 -fa on" in r.output
    assert "why: all layers on the GPUs" in r.output and "~12.5 tokens/s" in r.output


def test_library_errors_show_flag_spelling(monkeypatch, capsys):
    def refuse(model, options):
        raise InvalidOption("use n_ctx=70000 or more; type_v=q8_0 needs flash attention; drop flash_attn=False",
                            option="n_ctx")
    monkeypatch.setattr(planner, "plan", refuse)
    with pytest.raises(SystemExit) as e:
        main(["plan", "m.gguf", "-c", "4096"])
    assert e.value.code == 1
    assert capsys.readouterr().err == ("Error: use --ctx 70000 or more; -ctv q8_0 needs flash attention; "
                                       "drop -fa off\n")


@pytest.mark.parametrize("args, line", [
    (["plan", "-c", "0"], "Error: --ctx must be positive, got 0\n"),
    (["run", "-p", "hi", "--simulate", "8", "--rpc", "127.0.0.1:1"], "Error: give --simulate or --rpc, not both\n"),
    (["run", "-p", "hi", "-b", "-1"], "Error: -b must be positive, got -1\n"),
    (["run", "-p", "hi", "--n-cpu-moe", "-1"], "Error: --n-cpu-moe must be 0 or more layers, got -1\n"),
])
def test_bad_options_are_refused_by_the_library_in_flag_terms(capsys, args, line):
    """Unpatched: the options are checked before any model or worker is touched."""
    with pytest.raises(SystemExit) as e:
        main(args)
    assert e.value.code == 1 and capsys.readouterr().err == line

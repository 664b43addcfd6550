"""The command line spells the library's keyword terms as its own flags (ctxq.cli.errors)."""

from __future__ import annotations

import pytest

from ctxq.cli.errors import FLAGS, cli_message
from ctxq.errors import ContextTooLong, CtxqError, InvalidOption


@pytest.mark.parametrize("library, cli", [
    ("use n_ctx=70000 or more", "use --ctx 70000 or more"),
    ("type_v=q8_0 needs flash attention; drop flash_attn=False or use type_v=f16",
     "-ctv q8_0 needs flash attention; drop -fa off or use -ctv f16"),
    ("m.gguf exists; pass force=True to replace it or another `output` path",
     "m.gguf exists; pass --force to replace it or another -o path"),
    ("`split` has 3 values for 5 devices", "-ts has 3 values for 5 devices"),
    ("`gpus` '16,x': 'x' is not a size in GiB", "--gpus '16,x': 'x' is not a size in GiB"),
    ("use a smaller quantization, a smaller n_ctx, or more GPU memory",
     "use a smaller quantization, a smaller --ctx, or more GPU memory"),
    ("pass allow_remote=True to expose it", "pass --allow-remote to expose it"),
    ("`check`, `pure`: only for quantized types", "--no-check, --pure: only for quantized types"),
    ("skip the gate with check=False", "skip the gate with --no-check"),
    # ordinary words that are also keywords stay words unless quoted or assigned
    ("the split you gave does not fit on these gpus", "the split you gave does not fit on these gpus"),
    ("ctxq.rpc.run_supervised and n_ctx_train stay as they are", "ctxq.rpc.run_supervised and n_ctx_train stay as they are"),
])
def test_keyword_terms_become_flags(library, cli):
    assert cli_message(CtxqError(library)) == cli


def test_context_too_long_carries_its_numbers_and_reads_as_flags():
    e = ContextTooLong(n_prompt=70_000, n_predict=256, n_ctx=65_536)
    assert (e.option, e.value, e.limit) == ("n_ctx", 65_536, 70_256)
    assert "n_ctx=70256" in str(e) and "--ctx 70256" in cli_message(e) and "n_ctx" not in cli_message(e)


def test_fields_survive_pickling():  # errors cross process boundaries (run_supervised, the quantizer)
    import pickle

    e = pickle.loads(pickle.dumps(InvalidOption("`kv` must be auto", option="kv", value="q2")))
    assert type(e) is InvalidOption and (e.option, e.value, str(e)) == ("kv", "q2", "`kv` must be auto")


def test_every_flag_is_a_real_option_of_some_command():
    from click.testing import CliRunner

    from ctxq.cli import cli

    helps = "".join(CliRunner().invoke(cli, [name, "--help"]).output for name in cli.commands)
    missing = {k: f for k, f in FLAGS.items() if f" {f}" not in helps and f"{f}," not in helps}
    assert not missing, f"flags in the table that no command has: {missing}"

"""How the command line shows a library error: the same message in its own flag spelling.

Library messages name settings by keyword (`n_ctx=70000`, `type_k=q8_0`, `force=True`); a person at
the command line reads `--ctx 70000`, `-ctk q8_0`, `--force`. One table, applied to every message.
"""

from __future__ import annotations

import re

# keyword -> flag, for every keyword a library message may name
FLAGS = {
    "n_ctx": "--ctx", "n_batch": "-b", "n_ubatch": "-ub", "type_k": "-ctk", "type_v": "-ctv",
    "flash_attn": "-fa", "split": "-ts", "tensor_split": "-ts", "split_mode": "-sm", "gpus": "--gpus", "profile": "--profile",
    "rpc": "--rpc", "simulate": "--simulate", "reserve": "--reserve", "kv": "--kv", "prefer": "--prefer",
    "cpu_memory": "--cpu-memory", "n_predict": "-n", "n_threads": "-t", "force": "--force", "output": "-o",
    "imatrix": "--imatrix", "pre": "--pre", "host": "--host", "port": "--port", "device": "--device",
    "prompt": "-p", "file": "-f", "chat": "--chat", "allow_remote": "--allow-remote",
    "output_tensor_type": "--output-tensor-type", "token_embedding_type": "--token-embedding-type",
    "leave_output_tensor": "--leave-output-tensor", "pure": "--pure", "revision": "--revision",
    "check": "--no-check", "hf_file": "--hf-file", "max_body": "--max-body", "max_queue": "--max-queue",
    "timeout": "--timeout", "shutdown_timeout": "--shutdown-timeout", "session": "--session",
    "cpu_moe": "--cpu-moe", "n_cpu_moe": "--n-cpu-moe", "max_kl": "--max-kl", "against": "--against",
    "n_prompt": "-p", "n_gen": "-n", "depth": "-d", "reps": "-r", "offload": "--offload",
    "prompt_tokens": "--prompt-tokens", "gen_tokens": "--gen-tokens", "no_mmap": "--no-mmap",
    "override_tensor": "-ot",
}
# flags without a value: force=True is just --force; check=False is --no-check (an inverted switch)
_SWITCHES = {"force", "chat", "allow_remote", "leave_output_tensor", "pure", "cpu_moe", "no_mmap"}
_INVERTED = {"check"}
_ON_OFF = {"flash_attn"}  # booleans that the command line spells on/off

_ASSIGN = re.compile(r"\b(%s)=('?)([^\s,;:')]+)\2" % "|".join(map(re.escape, FLAGS)))
# a bare keyword is spelled as a flag where it is quoted (`gpus`) or cannot be an ordinary word (n_ctx)
_QUOTED = re.compile(r"`(%s)`" % "|".join(map(re.escape, FLAGS)))
_BARE = re.compile(r"(?<![\w.`-])(%s)\b(?![=`])" % "|".join(re.escape(k) for k in FLAGS if "_" in k))


def _assign(m: re.Match) -> str:
    key, value = m.group(1), m.group(3)
    if key in _SWITCHES:
        return FLAGS[key] if value == "True" else f"no {FLAGS[key]}"
    if key in _INVERTED:
        return FLAGS[key] if value == "False" else f"no {FLAGS[key]}"
    if key in _ON_OFF and value in ("True", "False"):
        value = "on" if value == "True" else "off"
    return f"{FLAGS[key]} {value}"


def cli_message(e: Exception) -> str:
    """`e`'s message as the command line says it."""
    text = _ASSIGN.sub(_assign, str(e))
    text = _QUOTED.sub(lambda m: FLAGS[m.group(1)], text)
    return _BARE.sub(lambda m: FLAGS[m.group(1)], text)

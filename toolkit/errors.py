"""Every error ctxq raises for a person to read. One family, fields for programs, one line each.

Messages speak the library's keywords (`n_ctx=70000`, `type_k=q8_0`, `force=True`), the words a
`ctxq.load()` or `ctxq.plan()` caller types; the command line shows the same message with its own
flag spelling (`--ctx 70000`, `-ctk q8_0`, `--force`) through the table in `ctxq.cli.errors`.
"""

from __future__ import annotations


class CtxqError(Exception):
    """An error meant for the user: the CLI prints its message as one line and exits 1.

    `option` names the setting at fault (a keyword such as "n_ctx"), `value` what was given and
    `limit` what would have been accepted, where the error is about one setting.
    """

    def __init__(self, message: str, *, option: str | None = None, value=None, limit=None):
        super().__init__(message)
        self.option, self.value, self.limit = option, value, limit

    def __reduce__(self):  # errors cross process boundaries (run_supervised, the quantizer's worker)
        return _rebuild, (type(self), self.args, dict(self.__dict__))


def _rebuild(cls, args, state):
    e = Exception.__new__(cls)
    Exception.__init__(e, *args)
    e.__dict__.update(state)
    return e


class InvalidOption(CtxqError):
    """A setting has a value ctxq cannot use (`option`, `value`; `limit` says what is accepted)."""


class GGUFError(CtxqError):
    """A file is not a readable GGUF (wrong magic, truncated, corrupted)."""


class NoTokenizer(CtxqError):
    """A model has no tokenizer llama.cpp can run text through (`tokenizer.ggml.model = "none"`, no vocabulary, or
    one llama.cpp aborts on): refused before llama.cpp is asked to tokenize. `path` is the model file."""

    def __init__(self, message: str, *, path: str = ""):
        super().__init__(message)
        self.path = path


class ModelNotFound(CtxqError):
    """A model path or name does not resolve to a file ctxq can use."""


class DoesNotFit(CtxqError):
    """No plan holds the required context on the given devices.

    `suggestion` names the smallest change that would make it fit.
    """

    def __init__(self, message: str, suggestion: str | None = None, **fields):
        super().__init__(message if not suggestion else f"{message}: {suggestion}", **fields)
        self.suggestion = suggestion


class ContextTooLong(CtxqError):
    """The input and the tokens to generate do not fit in the context."""

    def __init__(self, n_prompt: int, n_predict: int, n_ctx: int):
        need = n_prompt + n_predict
        super().__init__(f"the input is {n_prompt:,} tokens and {n_predict:,} more are to be generated "
                         f"({need:,} in all), but the context holds {n_ctx:,}: use n_ctx={need} or more, "
                         "or a shorter input", option="n_ctx", value=n_ctx, limit=need)
        self.n_prompt, self.n_predict, self.n_ctx = n_prompt, n_predict, n_ctx


class InputTooLong(ContextTooLong):
    """A text file longer than the context can hold, known from its bytes alone: it was read only as far as
    `n_bytes`, which is more than `n_ctx` tokens of this vocabulary (no token stands for more than `token_bytes`)."""

    def __init__(self, name: str, n_bytes: int, token_bytes: int, n_ctx: int):
        CtxqError.__init__(self, f"{name} is longer than {n_bytes:,} bytes, more than {n_ctx:,} tokens of this "
                           f"model's vocabulary (none stands for more than {token_bytes} bytes), but the context "
                           f"holds {n_ctx:,}: use a larger n_ctx or a shorter input", option="n_ctx", value=n_ctx)
        self.n_prompt, self.n_predict, self.n_ctx = None, None, n_ctx
        self.n_bytes, self.token_bytes = n_bytes, token_bytes


class NotText(CtxqError):
    """A file given as text is not (a GGUF, a PDF, an image...): refused from its first block. `looks_like` names
    what it seems to be, None when it is just not UTF-8."""

    def __init__(self, message: str, looks_like: str | None = None):
        super().__init__(message, option="file")
        self.looks_like = looks_like


class ReorderNeeded(CtxqError):
    """The plan orders the GPUs differently from llama.cpp, and this process can no longer apply that."""

    def __init__(self, value: str):
        super().__init__(f"the plan puts the GPUs in another order; set CUDA_VISIBLE_DEVICES={value} before "
                         "starting Python (ctxq run does this itself), or plan with reorder=False")
        self.value = value


class BuildError(CtxqError):
    """The installed llama-cpp-python lacks a feature (RPC, CUDA); the message says how to rebuild."""


class ConversionError(CtxqError):
    """A model could not be converted or quantized; nothing was written at the destination."""


class WorkerUnreachable(CtxqError):
    """An RPC worker did not answer (refused, timed out, busy, or not a ggml RPC server)."""

    def __init__(self, endpoint: str, why: str):
        super().__init__(f"RPC worker {endpoint} {why}")
        self.endpoint, self.why = endpoint, why


class WorkerLost(CtxqError):
    """An RPC worker went away while a model was using it."""

    def __init__(self, endpoint: str | None, message: str):
        super().__init__(message)
        self.endpoint = endpoint


class SessionMismatch(CtxqError):
    """A saved session (KV state) was not made from this model, these settings or this input: it is not
    used, and the input is processed from the start instead."""


class HubError(CtxqError):
    """A model on the Hugging Face Hub cannot be used: no such repo, file or tag; gated or private
    without a token; the Hub unreachable. The message says what to do (log in, HF_HUB_OFFLINE=1)."""


class LlamaAborted(CtxqError):
    """llama.cpp aborted (a failed GGML_ASSERT, an uncaught exception) while loading a model in one of ctxq's child
    processes: `reason` is its last message, `path` the file it was given."""

    def __init__(self, message: str, *, reason: str, path: str = ""):
        super().__init__(message)
        self.reason, self.path = reason, path

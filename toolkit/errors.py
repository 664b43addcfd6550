"""One error family. Each message is one line that says what to do next."""


class CtxqError(Exception):
    """An error meant for the user: the CLI prints its message as one line and exits 1."""


class GGUFError(CtxqError):
    """A file is not a readable GGUF (wrong magic, truncated, corrupted)."""


class ModelNotFound(CtxqError):
    """A model path or name does not resolve to a file ctxq can use."""


class DoesNotFit(CtxqError):
    """No plan holds the required context on the given devices.

    ``suggestion`` names the smallest change that would make it fit.
    """

    def __init__(self, message: str, suggestion: str | None = None):
        super().__init__(message if not suggestion else f"{message}: {suggestion}")
        self.suggestion = suggestion


class BuildError(CtxqError):
    """The installed llama-cpp-python lacks a feature (RPC, CUDA); the message says how to rebuild."""


class ConversionError(CtxqError):
    """A model could not be converted or quantized; nothing was written at the destination."""

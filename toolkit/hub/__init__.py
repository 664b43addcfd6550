"""Models straight from the Hugging Face Hub: references, headers read over HTTP, downloads.

`ref` parses `USER/REPO[:TAG][@REVISION]` and picks a GGUF file by its quantization tag; `headers`
reads GGUF and safetensors headers with range requests (the planner needs nothing else); `download`
fetches what `ctxq run` loads into the Hugging Face cache; `cache` keeps listings and header-only
copies under ctxq's home; `http` is the one place that talks to huggingface_hub.
"""

from .ref import HubRef, parse_ref, with_file

__all__ = ["HubRef", "parse_ref", "with_file"]

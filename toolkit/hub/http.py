"""Talking to the Hugging Face Hub through huggingface_hub: listings, ranged reads, one-line errors.

Every request goes through huggingface_hub (`HfApi`, `hf_hub_url`, its `get_session()` and
`build_hf_headers()`), so `HF_TOKEN` or a `hf auth login`, `HF_ENDPOINT`, proxies and
`HF_HUB_OFFLINE` behave as in every other Hugging Face tool.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass

from ..errors import HubError
from .local import cached_note

log = logging.getLogger(__name__)

LOGIN = "log in with `hf auth login` or set HF_TOKEN"


@dataclass(frozen=True)
class Listing:
    """A repo at one commit: its files and their sizes in bytes."""

    repo: str
    commit: str
    files: dict[str, int]


def offline() -> bool:
    from huggingface_hub import constants

    return constants.is_offline_mode()


def endpoint() -> str:
    from huggingface_hub import constants

    return constants.ENDPOINT


def list_repo(repo: str, revision: str | None) -> Listing:
    """The repo's files and sizes at `revision`, and the commit it resolves to (one request)."""
    from huggingface_hub import HfApi

    with hub_errors(repo, revision):
        info = HfApi().model_info(repo, revision=revision, files_metadata=True)
    return Listing(repo, info.sha, {s.rfilename: s.size or 0 for s in info.siblings or []})


@dataclass(frozen=True)
class Asked:
    """What the Hub says a revision names now: its commit, or None and why it could not say."""

    commit: str | None
    why_not: str = ""


def ask_commit(repo: str, revision: str | None) -> Asked:
    """The commit `revision` (None: the default branch) names on the Hub now, in one request. When the Hub does
    not say (HF_HUB_OFFLINE, no connection, any HTTP error: a rate limit, a server error, a refused token) the
    commit is None and the caller goes on with what is cached, as huggingface_hub's snapshot_download does; a
    revision the Hub says does not exist is `hub_errors`' one line, as there."""
    from huggingface_hub import HfApi, constants
    from huggingface_hub import errors as e
    import httpx2

    if offline():
        return Asked(None, "HF_HUB_OFFLINE is set")
    with hub_errors(repo, revision):
        try:  # the timeout huggingface_hub gives its own metadata requests (hf_hub_download's HEAD)
            return Asked(HfApi().model_info(repo, revision=revision, timeout=constants.HF_HUB_ETAG_TIMEOUT).sha)
        except e.RevisionNotFoundError:
            raise
        except (httpx2.TransportError, e.OfflineModeIsEnabled) as x:  # refused, dropped, timed out, a proxy's failure
            why = f"{type(x).__name__} from {endpoint()}"
        except e.HfHubHTTPError as x:
            why = _first_line(x)
    log.info("%s: the Hub did not say what %s names (%s)", repo, revision or "the default branch", why)
    return Asked(None, why)


class RangedFile:
    """A remote file read with HTTP range requests: the `seek`/`read` the GGUF reader needs.
    It keeps every byte it fetched (the reader reads from the start onwards), and counts them."""

    def __init__(self, repo: str, path: str, commit: str, size: int):
        from huggingface_hub import hf_hub_url

        self.repo, self.path, self.size = repo, path, size
        self.url = hf_hub_url(repo, path, revision=commit)
        self.data = bytearray()
        self.pos = 0
        self.requests = 0

    def seek(self, pos: int) -> None:
        self.pos = pos

    def read(self, n: int) -> bytes:
        end = min(self.pos + n, self.size)
        if end > len(self.data):
            self._fetch(len(self.data), end)
        out = bytes(self.data[self.pos:end])
        self.pos = end
        return out

    def _fetch(self, start: int, end: int) -> None:
        from huggingface_hub.utils import build_hf_headers, get_session, hf_raise_for_status

        headers = build_hf_headers() | {"Range": f"bytes={start}-{end - 1}", "Accept-Encoding": "identity"}
        body = bytearray()
        with hub_errors(self.repo), get_session().stream("GET", self.url, headers=headers,
                                                          follow_redirects=True) as r:
            hf_raise_for_status(r)
            # a server that ignores Range sends the whole file from byte 0: stop once `end` is in
            stop = end - start if r.status_code == 206 else end
            for chunk in r.iter_bytes():
                body += chunk
                if len(body) >= stop:
                    break
        self.requests += 1
        self.data += body[stop - (end - start):stop]
        log.debug("read bytes %d-%d of %s/%s", start, end - 1, self.repo, self.path)


@contextlib.contextmanager
def hub_errors(repo: str, revision: str | None = None):
    """huggingface_hub's and the network's exceptions as one-line `HubError`s that say what to do."""
    from huggingface_hub import errors as e
    import httpx2

    try:
        yield
    except e.GatedRepoError:
        raise HubError(f"{repo} is gated: accept its terms on huggingface.co, then {LOGIN}") from None
    except e.RepositoryNotFoundError:
        raise HubError(f"{repo}: no such model on the Hugging Face Hub, or it is private ({LOGIN})") from None
    except e.RevisionNotFoundError:
        raise HubError(f"{repo}: no revision {revision!r}; pass an existing branch, tag or commit") from None
    except e.RemoteEntryNotFoundError as x:
        raise HubError(f"{repo}: no such file ({_first_line(x)})") from None
    except (e.OfflineModeIsEnabled, e.LocalEntryNotFoundError):
        why = "HF_HUB_OFFLINE is set" if offline() else f"the Hub at {endpoint()} did not answer"
        raise HubError(f"{repo}{'@' + revision if revision else ''} is not cached and {why}; "
                       f"{cached_note(repo)}") from None
    except httpx2.TransportError as x:
        raise HubError(f"cannot reach the Hugging Face Hub at {endpoint()} ({type(x).__name__}); "
                       f"set HF_HUB_OFFLINE=1 to use what is cached: {cached_note(repo)}") from None
    except e.HfHubHTTPError as x:
        raise HubError(f"{repo}: the Hub answered {_first_line(x)}") from None


def _first_line(x: Exception) -> str:
    return (str(x).strip().splitlines() or [type(x).__name__])[0]

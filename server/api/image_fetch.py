"""Downloading ``http(s)://`` image URLs, only when the operator enables it.

Off by default: a server that fetches client-named URLs can be steered at internal services
(server-side request forgery). When enabled, a download is bounded in size and time, follows
at most a few redirects, and only to http(s) URLs. Uses the standard library so that the feature
adds no dependency; runs in a worker thread (blocking I/O).
"""

from __future__ import annotations

import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from email.message import Message
from typing import IO

MAX_REDIRECTS = 3
_READ_CHUNK = 64 * 1024
_SCHEMES = ("http", "https")


class ImageFetchError(Exception):
    """A download failed or broke a limit; the message is safe to show the client."""


@dataclass(frozen=True, slots=True)
class FetchLimits:
    """Bounds of one download.

    Attributes:
        max_bytes: most body bytes accepted.
        timeout_s: total time for connecting, redirects and reading. Each socket operation
            also times out after this long, so a server that trickles bytes is cut off within
            about twice this bound.
    """

    max_bytes: int
    timeout_s: float


class _HttpOnlyRedirects(urllib.request.HTTPRedirectHandler):
    max_redirections = MAX_REDIRECTS

    def redirect_request(self, req: urllib.request.Request, fp: IO[bytes], code: int, msg: str,
                         headers: Message, newurl: str) -> urllib.request.Request | None:
        scheme = urllib.parse.urlsplit(newurl).scheme.lower()
        if scheme not in _SCHEMES:
            raise ImageFetchError(f"image URL redirected to a non-http URL scheme {scheme!r}")
        return super().redirect_request(req, fp, code, msg, headers, newurl)


def _opener() -> urllib.request.OpenerDirector:
    # build_opener adds FileHandler, FTPHandler and DataHandler; only http(s) may be reachable.
    opener = urllib.request.OpenerDirector()
    for handler in (urllib.request.HTTPHandler(), urllib.request.HTTPSHandler(),
                    _HttpOnlyRedirects(), urllib.request.HTTPDefaultErrorHandler(),
                    urllib.request.HTTPErrorProcessor()):
        opener.add_handler(handler)
    return opener


def fetch_image_bytes(url: str, limits: FetchLimits) -> bytes:
    """Download an image body.

    Args:
        url: an ``http://`` or ``https://`` URL.
        limits: size and time bounds.

    Returns:
        The response body (at most ``limits.max_bytes`` bytes).

    Raises:
        ImageFetchError: wrong scheme, network error, non-2xx status, too large, too slow.
    """
    scheme = urllib.parse.urlsplit(url).scheme.lower()
    if scheme not in _SCHEMES:
        raise ImageFetchError(f"not an http(s) URL: scheme {scheme!r}")
    deadline = time.monotonic() + limits.timeout_s
    request = urllib.request.Request(url, headers={"User-Agent": "vlmcache", "Accept": "image/*"})
    try:
        with _opener().open(request, timeout=limits.timeout_s) as response:
            declared = response.headers.get("Content-Length")
            if declared is not None and declared.isdigit() and int(declared) > limits.max_bytes:
                raise ImageFetchError(
                    f"image at URL is {int(declared)} bytes; the limit is {limits.max_bytes}")
            chunks: list[bytes] = []
            total = 0
            while True:
                if time.monotonic() > deadline:
                    raise ImageFetchError(f"image download took longer than {limits.timeout_s} s")
                chunk = response.read(_READ_CHUNK)
                if not chunk:
                    break
                total += len(chunk)
                if total > limits.max_bytes:
                    raise ImageFetchError(f"image at URL is larger than {limits.max_bytes} bytes")
                chunks.append(chunk)
    except urllib.error.HTTPError as exc:
        raise ImageFetchError(f"image URL answered HTTP {exc.code}") from None
    except urllib.error.URLError as exc:
        raise ImageFetchError(f"cannot fetch image URL: {exc.reason}") from None
    except TimeoutError:
        raise ImageFetchError(f"image download took longer than {limits.timeout_s} s") from None
    except OSError as exc:
        raise ImageFetchError(f"cannot fetch image URL: {exc}") from None
    return b"".join(chunks)

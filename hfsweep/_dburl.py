"""A storage URL's secrets: its ``${NAME}`` references and its password.

A storage URL names a database server and often the password to it. The password must not end
up in a committed sweep file, a printed summary, ``sweep.json``, a log or an error message, so:

- :func:`expand` replaces ``${NAME}`` references with environment variables
  (``postgresql://me:${HFSWEEP_DB_PASSWORD}@db/optuna``, or a whole URL as ``${DATABASE_URL}``)
  where the storage is opened; the config keeps the URL as written.
- :func:`mask` hides a password written in a URL (``postgresql://me:***@db/optuna``); a
  password given as one ``${NAME}`` reference is no secret and stays readable. ``sweep.json``
  keeps the URL masked this way, so resuming expands the same references again.
- :func:`shown` is the URL for a message: expanded, then masked; :func:`scrub` removes the
  password from any other text shown (a server's or a driver's message).

Plain string functions (no SQLAlchemy), so that the config can mask what it prints.
"""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Mapping
from urllib.parse import unquote

__all__ = ["UnsetVariable", "expand", "mask", "scrub", "shown"]

#: a ``${NAME}`` reference to an environment variable
_REFERENCE = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}")


class UnsetVariable(KeyError):
    """A ``${NAME}`` reference in a storage URL names an environment variable that is not set."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.name = name

    def __str__(self) -> str:
        return (
            f"the URL names the environment variable {self.name} (${{{self.name}}}), which is "
            f"not set; set it (export {self.name}=...) or write the value in the URL"
        )


def expand(url: str, environ: Mapping[str, str] | None = None) -> str:
    """``url`` with every ``${NAME}`` replaced by that environment variable; raises
    :class:`UnsetVariable` for one that is not set."""
    env = os.environ if environ is None else environ

    def value(match: re.Match[str]) -> str:
        name = match.group(1)
        if name not in env:
            raise UnsetVariable(name)
        return env[name]

    return _REFERENCE.sub(value, url)


def _userinfo(url: str) -> tuple[int, int] | None:
    """Where the password of ``scheme://user:password@host/...`` lies in ``url`` (start, end),
    or None when it has none. The password runs to the last ``@`` before the query, so an
    unescaped ``/`` or ``@`` in it is hidden too."""
    scheme_end = url.find("://")
    if scheme_end < 0:
        return None
    rest = scheme_end + 3
    query = url.find("?", rest)
    at = url.rfind("@", rest, query if query >= 0 else len(url))
    colon = url.find(":", rest, at) if at >= 0 else -1
    if colon < 0:
        return None
    return colon + 1, at


def mask(url: str | None) -> str | None:
    """``url`` with a password written in it replaced by ``***``; one given as a single
    ``${NAME}`` reference is kept (it holds no secret, and resuming expands it again)."""
    if url is None:
        return None
    span = _userinfo(url)
    if span is None:
        return url
    start, end = span
    if _REFERENCE.fullmatch(url[start:end]):
        return url
    return f"{url[:start]}***{url[end:]}"


def shown(url: str) -> str:
    """The URL to show in a message: expanded where its variables are set (so it names the
    real server), its password masked."""
    with contextlib.suppress(UnsetVariable):
        url = expand(url)
    return str(mask(url))


def scrub(text: str, url: str) -> str:
    """``text`` (a server's or a driver's message) with the password of ``url`` (expanded, and
    as the driver sees it, percent-decoded) replaced by ``***``."""
    with contextlib.suppress(UnsetVariable):
        url = expand(url)
    span = _userinfo(url)
    if span is None:
        return text
    password = url[span[0] : span[1]]
    for secret in sorted({password, unquote(password)}, key=len, reverse=True):
        if secret and secret != "***":
            text = text.replace(secret, "***")
    return text

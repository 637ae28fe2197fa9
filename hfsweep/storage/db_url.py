"""A storage URL's secrets: its ``${NAME}`` references and its password.

A storage URL names a database server and often the password to it. The password must not end
up in a committed sweep file, a printed summary, ``sweep.json``, a log or an error message, so:

- :func:`expand` replaces ``${NAME}`` references with environment variables
  (``postgresql://me:${HFSWEEP_DB_PASSWORD}@db/optuna``, or a whole URL as ``${DATABASE_URL}``);
  the config keeps the URL as written. :func:`for_driver` is the URL handed to SQLAlchemy where
  the storage is opened: expanded, its user name and password percent-encoded, so that a
  password holding ``@ : / ? # %`` is read whole (SQLAlchemy ends it at its first ``@``, and a
  parse error then quotes the rest of it as a host or a port).
- :func:`mask` hides a password written in a URL (``postgresql://me:***@db/optuna``); a
  password given as one ``${NAME}`` reference is no secret and stays readable. ``sweep.json``
  keeps the URL masked this way, so resuming expands the same references again.
- :func:`shown` is the URL for a message: expanded, then masked; :func:`scrub` removes the
  password (as written, decoded and encoded, and any run of 6 of its characters) from any other
  text shown (a server's or a driver's message).

A URL's password runs from the ``:`` after the user name to the *last* ``@`` of the URL, so
an ``@`` in a query string must be written ``%40``. In a password written in the URL, ``%``
and two hex digits is a percent-escape (as SQLAlchemy reads it); a value put in by ``${NAME}``
is taken literally.

Plain string functions (no SQLAlchemy), so that the config can mask what it prints.
"""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Mapping
from urllib.parse import quote, unquote

__all__ = ["UnsetVariable", "expand", "for_driver", "mask", "password_forms", "scrub", "shown"]

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
    or None when it has none. The password runs from the first ``:`` after the user name to the
    last ``@`` of the URL, so an unescaped ``@ : / ? #`` in it is part of it (and hidden)."""
    scheme_end = url.find("://")
    if scheme_end < 0:
        return None
    rest = scheme_end + 3
    at = url.rfind("@", rest)
    colon = url.find(":", rest, at) if at >= 0 else -1
    if colon < 0 or any(c in url[rest:colon] for c in "/?#"):  # host:port/..., no user name
        return None
    return colon + 1, at


def _encoded(written: str) -> str:
    """A user name or password written in a URL, percent-encoded for SQLAlchemy: its valid
    percent-escapes kept as they are (SQLAlchemy decodes them), every other character that is
    not unreserved escaped (``@`` -> ``%40``, a lone ``%`` -> ``%25``)."""
    return quote(unquote(written), safe="")


def _encoded_part(written: str, env: Mapping[str, str]) -> str:
    """``written`` (a user name or password, ``${NAME}`` references in it) percent-encoded:
    the text written as :func:`_encoded`, each value put in for a reference literally."""
    out: list[str] = []
    pos = 0
    for match in _REFERENCE.finditer(written):
        name = match.group(1)
        if name not in env:
            raise UnsetVariable(name)
        out += [_encoded(written[pos : match.start()]), quote(env[name], safe="")]
        pos = match.end()
    out.append(_encoded(written[pos:]))
    return "".join(out)


def for_driver(url: str, environ: Mapping[str, str] | None = None) -> str:
    """``url`` as SQLAlchemy must get it: expanded (:func:`expand`), its user name and password
    percent-encoded, so that SQLAlchemy reads the whole password whatever it holds. Where the
    URL as written shows its user and password (``postgresql://me:${PW}@db/x``), a value put in
    by a reference is encoded whole, ``%`` included; a URL whose credentials come from a
    variable (``${DATABASE_URL}``) is expanded first, then read as written. Raises
    :class:`UnsetVariable` for a reference to an unset variable."""
    env = os.environ if environ is None else environ
    span = _userinfo(url)
    if span is None:
        url = expand(url, env)
        span = _userinfo(url)
        if span is None:
            return url
        env = {}  # expanded: nothing is left to put in
    start, end = span
    user_start = url.find("://") + 3
    return (
        expand(url[:user_start], env)
        + _encoded_part(url[user_start : start - 1], env)
        + ":"
        + _encoded_part(url[start:end], env)
        + expand(url[end:], env)
    )


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
        url = for_driver(url)
    return str(mask(url))


#: the shortest run of a password's characters that :func:`scrub` hides wherever it appears
_FRAGMENT = 6


def password_forms(url: str) -> set[str]:
    """The password of ``url`` in every form a message may show it: as written (expanded),
    percent-decoded (as the server gets it) and percent-encoded (as SQLAlchemy gets it)."""
    found: set[str] = set()
    forms = [url]
    with contextlib.suppress(UnsetVariable):
        forms += [expand(url), for_driver(url)]
    for form in forms:
        span = _userinfo(form)
        if span is None:
            continue
        password = form[span[0] : span[1]]
        if _REFERENCE.fullmatch(password) or password == "***":
            continue
        decoded = unquote(password)
        found |= {password, decoded, quote(decoded, safe="")}
    found.discard("")
    return found


def scrub(text: str, url: str) -> str:
    """``text`` (a server's or a driver's message) without the password of ``url``: each of
    its forms (:func:`password_forms`) replaced by ``***``, then any run of 6 or more of its
    characters that is left (a parser that quoted part of it)."""
    found = sorted(password_forms(url), key=len, reverse=True)
    for secret in found:
        text = text.replace(secret, "***")
    for secret in found:
        for size in range(len(secret) - 1, _FRAGMENT - 1, -1):
            for i in range(len(secret) - size + 1):
                if secret[i : i + size] in text:
                    text = text.replace(secret[i : i + size], "***")
    return text

"""Keeping credentials out of everything hybrid_ray prints: reprs, error messages, reports.

The rule, in one place:

* ``storage_options``: the value of every key whose name, case-insensitively, contains one of
  ``SECRET_KEY_WORDS`` (``key``, ``secret``, ``token``, ``password``, ...) is shown as
  ``***``, in nested mappings too (``client_kwargs``, ``config_kwargs``). So ``key``,
  ``secret``, ``token``, ``aws_secret_access_key``, ``session_token``, ``sas_token`` are
  hidden; ``endpoint_url``, ``region_name``, ``anon``, ``profile`` are shown. Any string
  value that is a URL is shown through ``redact_url``.
* URLs (``remote_path``, endpoints): everything between ``://`` and the first ``@`` (the
  ``user:password`` part, e.g. ``s3://AKIA...:secret@bucket``) and the whole query string
  (pre-signed or SAS signatures) are replaced by ``***``. This may hide a harmless part too
  (an Azure container name, an ``@`` in a key); hiding too much in a message is the safe side.
* Free text (a library's exception message, a path derived from a URL with credentials):
  ``Redactor.scrub`` replaces every secret string it knows from the URL and the options.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from typing import Any

MASK = "***"
SECRET_KEY_WORDS = ("key", "secret", "token", "pass", "pwd", "credential", "auth",
                    "signature", "session", "cookie", "private", "connection_string",
                    "conn_str", "dsn")
# A value holding one of these (case-insensitive) is a credential whatever its option's
# name: Azure connection strings and SAS tokens.
SECRET_VALUE_MARKS = ("accountkey=", "sharedaccesssignature=", "sig=")
# Secrets this short are masked where they are a value, but not scrubbed from free text:
# replacing every "a" in a message would destroy it, and real credentials are long.
MIN_SCRUB_CHARS = 4

_SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.\-]*://")


def split_userinfo(url: str) -> tuple[str, str, str] | None:
    """``(scheme://, user[:password], rest after its "@")`` of ``url``, or None if it
    has no user part. With a ":" before the first "/" the user part runs to the last "@"
    of the whole URL: a password may hold "@", "/" (AWS secrets) or "?" of its own, and
    hiding too much is the safe side. Without one only an "@" before the first "/" starts
    the host (``s3://bucket/pre@fix`` is a key). A URL with no authority
    (``file:///home/me@corp/x``) has none."""
    scheme = _SCHEME.match(url)
    if scheme is None or url[scheme.end():].startswith("/"):
        return None
    rest = url[scheme.end():]
    slash = rest.find("/") if "/" in rest else len(rest)
    colon = rest.find(":")
    if 0 <= colon < slash and "@" in rest[colon:]:
        at = rest.rfind("@")
    elif "@" in rest[:slash]:
        at = rest.rfind("@", 0, slash)
    else:
        return None
    return scheme.group(0), rest[:at], rest[at + 1:]


def _userinfo_parts(url: str) -> tuple[str, str, str] | None:
    """``split_userinfo``, failing safe for strings that are not well-formed URLs: fsspec
    chains (``simplecache::s3://user:pw@bucket``), a typo (``s3//user:pw@bucket``), a
    pasted leading space or a scheme with "_". Those were quoted whole in the very errors
    that refuse them. In such a string everything before its last "@" (after its last
    "://", if any) counts as the user part."""
    if _SCHEME.match(url):
        return split_userinfo(url)
    if "@" not in url or url.startswith("/"):  # an absolute local path holds no credential
        return None
    start = url.rfind("://") + 3 if "://" in url else 0
    at = url.rfind("@")
    if at < start:
        return None
    return url[:start], url[start:at], url[at + 1:]


def is_secret_key(name: Any) -> bool:
    """Whether a storage option named ``name`` holds a credential (see the module rule)."""
    lowered = str(name).lower()
    return any(word in lowered for word in SECRET_KEY_WORDS)


def redact_url(url: Any) -> Any:
    """``url`` with its ``user:password@`` part and query string replaced by ``***``
    (in a string that is not a well-formed URL, everything before its last "@": see
    ``_userinfo_parts``); bytes and paths are decoded first, anything else that is not a
    string is returned unchanged."""
    if isinstance(url, bytes):
        url = url.decode(errors="replace")
    elif isinstance(url, os.PathLike):
        url = os.fspath(url)
        url = url.decode(errors="replace") if isinstance(url, bytes) else url
    if not isinstance(url, str):
        return url
    out = url
    parts = _userinfo_parts(out)
    if parts is not None:
        out = parts[0] + MASK + "@" + parts[2]
    if "?" in out:
        out = out.split("?", 1)[0] + "?" + MASK
    return out


def redacted_options(options: Any) -> Any:
    """A copy of ``storage_options`` with every credential value masked (module rule)."""
    if isinstance(options, Mapping):
        return {k: (MASK if is_secret_key(k) else redacted_options(v))
                for k, v in options.items()}
    if isinstance(options, (list, tuple)):
        return type(options)(redacted_options(v) for v in options)
    if isinstance(options, str) and _looks_secret(options):
        return MASK
    if isinstance(options, str) and "://" in options:
        return redact_url(options)
    return options


def _looks_secret(value: str) -> bool:
    lowered = value.lower()
    return any(mark in lowered for mark in SECRET_VALUE_MARKS)


def _secret_strings(value: Any, under_secret_key: bool, out: set[str]) -> None:
    if isinstance(value, Mapping):
        for k, v in value.items():
            _secret_strings(v, under_secret_key or is_secret_key(k), out)
    elif isinstance(value, (list, tuple)):
        for v in value:
            _secret_strings(v, under_secret_key, out)
    elif isinstance(value, (str, bytes)):
        text = value.decode(errors="replace") if isinstance(value, bytes) else value
        if under_secret_key or _looks_secret(text):
            out.add(text)
            # A connection string or SAS token: its secret fields alone, as a library's
            # message may quote one without the rest.
            for part in re.split(r"[;&]", text):
                name, _, value = part.partition("=")
                if value and (is_secret_key(name) or name.strip().lower() == "sig"):
                    out.add(value)
        elif "://" in text:
            _url_secrets(text, out)


def _url_secrets(url: str, out: set[str]) -> None:
    parts = _userinfo_parts(url)
    # "file:///home/me@corp/x" has no authority: its "@" is in the path, not a credential
    # (scrubbing "/home/me" from every message would garble them).
    if parts is not None:
        userinfo = parts[1]
        out.add(userinfo)
        out.update(userinfo.split(":", 1))
    if "?" in url:
        query = url.split("?", 1)[1]
        out.add(query)
        out.update(part.split("=", 1)[-1] for part in query.split("&"))


class Redactor:
    """Scrubs the credentials of one ``remote_path`` and its ``storage_options`` from text."""

    def __init__(self, url: str | None = None, options: Mapping[str, Any] | None = None) -> None:
        secrets: set[str] = set()
        if url:
            _url_secrets(url, secrets)
        _secret_strings(options or {}, False, secrets)
        # Longest first, so a secret containing another is replaced whole.
        self._secrets = sorted((s for s in secrets if len(s) >= MIN_SCRUB_CHARS),
                               key=len, reverse=True)

    def scrub(self, text: Any) -> str:
        """``str(text)`` with every known secret replaced by ``***``."""
        out = str(text)
        for secret in self._secrets:
            if secret in out:
                out = out.replace(secret, MASK)
        return out

    def is_clean(self, text: Any) -> bool:
        """Whether ``str(text)`` contains none of the known secrets."""
        out = str(text)
        return not any(secret in out for secret in self._secrets)

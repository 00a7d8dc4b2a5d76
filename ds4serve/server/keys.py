"""API keys: several named keys, matched in constant time; the name (never the key) identifies a tenant.

A server has zero or more keys, each with a name. The name is what the rest of the server sees:
the access log line, the ``key_name`` label of the per-request Prometheus counters, and the prefix
cache's salt (``tenant_salt``), so one tenant never reuses another's cached prompt state. Names are
restricted to a safe alphabet because they go into log lines and label values as they are, and they
only ever come from this configuration, so the label's cardinality is the number of keys.

Where keys come from (the CLI):

* ``--api-key NAME=SECRET`` names the key; a bare ``--api-key SECRET`` is named ``key-1``, ``key-2``
  ... in order. The split is at the first ``=`` and only when what is left of it is a valid name, so
  a bare secret holding ``=`` (base64 padding) must be given a name.
* ``--api-key-file PATH``: one key per line as ``NAME KEY``; blank lines and lines starting with
  ``#`` are ignored. A malformed line is an error naming the file and the line number.
"""

from __future__ import annotations

import hmac
import re
from collections.abc import Iterable, Mapping
from pathlib import Path

NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
SALT_SEP = "\x00"
KEYS_FILE_FORMAT = "one key per line as 'NAME KEY'; blank lines and lines starting with '#' are ignored"


class KeyConfigError(ValueError):
    """A key configuration that cannot be used (bad name, duplicate, malformed file line)."""


class ApiKeys:
    """Named API keys. ``match`` compares the offered token with every key, always all of them, with
    ``hmac.compare_digest``, so the time taken says nothing about which key (or how much of one)
    matched."""

    def __init__(self, keys: Mapping[str, str] | None = None):
        self._keys: dict[str, bytes] = {}
        seen: dict[bytes, str] = {}
        for name, secret in (keys or {}).items():
            _check_name(name)
            if not isinstance(secret, str) or not secret:
                raise KeyConfigError(f"the API key named {name!r} is empty")
            raw = secret.encode("utf-8")
            if raw in seen:
                raise KeyConfigError(f"the API keys named {seen[raw]!r} and {name!r} are the same key")
            seen[raw] = name
            self._keys[name] = raw

    @classmethod
    def of(cls, api_key: str | None = None, api_keys: Mapping[str, str] | None = None) -> ApiKeys:
        """The keys of the Python API: the old single ``api_key`` (named ``key-1``) or named ``api_keys``."""
        if api_key and api_keys:
            raise KeyConfigError("pass either api_key (one key) or api_keys (named keys), not both")
        return cls({"key-1": api_key} if api_key else api_keys)

    def __bool__(self) -> bool:
        return bool(self._keys)

    def __len__(self) -> int:
        return len(self._keys)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self._keys)

    def match(self, token: str) -> str | None:
        """The name of the key equal to ``token``, or None. Every key is compared (no early exit)."""
        offered = token.encode("utf-8", "surrogateescape")
        found = None
        for name, raw in self._keys.items():
            if hmac.compare_digest(offered, raw):
                found = name
        return found

    def __repr__(self) -> str:  # never the secrets, even in a traceback or a debugger
        return f"ApiKeys(names={list(self._keys)})"


def tenant_salt(key_name: str, cache_salt: str | None) -> str:
    """The prefix-cache salt of a request: its key's name, a NUL, then the request's ``cache_salt``.
    The name part keeps tenants apart even when they send the same ``cache_salt``; the NUL (which
    no name holds) keeps ``("a", "b.c")`` and ``("a.b", "c")`` apart."""
    return f"{key_name}{SALT_SEP}{cache_salt or ''}"


def _check_name(name: str, where: str = "") -> None:
    if not isinstance(name, str) or not NAME_RE.fullmatch(name):
        raise KeyConfigError(f"{where}invalid API key name {name!r}: use 1-64 letters, digits, '_', '.' or '-', "
                        "starting with a letter or digit")


def _add(keys: dict[str, str], name: str, secret: str, where: str = "") -> None:
    _check_name(name, where)
    if name in keys:
        raise KeyConfigError(f"{where}the API key name {name!r} is used twice")
    if not secret:
        raise KeyConfigError(f"{where}the API key named {name!r} is empty")
    keys[name] = secret


def parse_key_args(values: Iterable[str]) -> dict[str, str]:
    """``--api-key`` values -> {name: secret} (see the module docstring for the naming rule)."""
    keys: dict[str, str] = {}
    bare = 0
    for value in values:
        name, sep, secret = value.partition("=")
        if sep and NAME_RE.fullmatch(name) and secret:
            _add(keys, name, secret, "--api-key: ")
        else:
            bare += 1
            _add(keys, f"key-{bare}", value, "--api-key: ")
    return keys


def parse_key_file(text: str, source: str = "the API key file") -> dict[str, str]:
    """The ``NAME KEY`` lines of a key file -> {name: secret}; errors say ``source:LINE``."""
    keys: dict[str, str] = {}
    for lineno, line in enumerate(text.splitlines(), start=1):
        stripped = line.strip()
        if not stripped or stripped.startswith("#"):
            continue
        fields = stripped.split()
        where = f"{source}:{lineno}: "
        if len(fields) != 2:
            raise KeyConfigError(f"{where}expected 'NAME KEY' (two fields separated by spaces), got {len(fields)} "
                            "field(s)")
        _add(keys, fields[0], fields[1], where)
    return keys


def load_keys(args: Iterable[str] = (), files: Iterable[str | Path] = ()) -> dict[str, str]:
    """Every key of the command line: the ``--api-key`` values, then each ``--api-key-file``."""
    keys = parse_key_args(args)
    for path in files:
        try:
            text = Path(path).read_text(encoding="utf-8")
        except OSError as exc:
            raise KeyConfigError(f"cannot read the API key file {path}: {exc.strerror or exc}") from exc
        for name, secret in parse_key_file(text, str(path)).items():
            _add(keys, name, secret, f"{path}: ")
    return keys

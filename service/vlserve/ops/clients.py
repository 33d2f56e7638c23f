"""The API's clients: a name and a key each, with optional limits, and what the fronts hold of them.

The operator keeps the keys (in the inventory, under Ansible Vault); hosts never do. A front holds
one line per client in a HAProxy map: the sha256 of the key, then the client's name and limits.
HAProxy hashes the presented key (`sha2(256)`) and looks it up there, so a key copied off a host
(or out of a backup) is not a key. Keys are long random strings: an unsalted digest is enough, as
for GitHub's and Stripe's tokens.

The name is what the front passes on (X-Vlserve-Client, set by the front itself) and what the
workers' usage metrics are labelled with: a short, bounded, non-secret word.

Standard library only: the controller's filters and `vlserve render-units` both call it.
"""

from __future__ import annotations

import hashlib
import re
import secrets
from dataclasses import dataclass
from typing import Any

from vlserve.sizing.contract import CLIENT_NAME

NAME = re.compile(CLIENT_NAME)
MODEL = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.:/-]{0,127}$")
# A key: printable ASCII, no spaces (it travels in `Authorization: Bearer <key>`), long enough that
# guessing is hopeless, short enough that the front refuses anything longer before hashing it.
KEY = re.compile(r"^[!-~]+$")
MIN_KEY_CHARS = 32
MAX_KEY_CHARS = 256
# The Authorization header the front hashes at most: "Bearer " and the longest key.
MAX_AUTHORIZATION_CHARS = len("Bearer ") + MAX_KEY_CHARS
LIMITS = {
    "concurrent": "requests in flight at once",
    "requests_per_minute": "requests per minute",
    "tokens_per_minute": "completion tokens per minute (each request reserves its max_tokens)",
}
FIELDS = ("name", "key", "limits")
ALL_MODELS = "*"
KEY_PREFIX = "vls-"


class ClientsError(ValueError):
    """A client list that is not one, in one line that never quotes a key."""


@dataclass(frozen=True)
class Client:
    """One client as a front holds it: no key, only its digest."""

    name: str
    digest: str
    concurrent: int = 0  # 0: no limit
    requests_per_minute: int = 0
    tokens_per_minute: int = 0
    models: tuple[str, ...] = (ALL_MODELS,)

    def as_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "digest": self.digest,
            "concurrent": self.concurrent,
            "requests_per_minute": self.requests_per_minute,
            "tokens_per_minute": self.tokens_per_minute,
            "models": list(self.models),
        }


def key_digest(key: str) -> str:
    """What a front stores of a key, and what HAProxy computes from the presented one."""
    return hashlib.sha256(key.encode("ascii")).hexdigest()


def new_key() -> str:
    """A fresh key: 256 random bits, URL-safe, with a prefix that says what it is (secret scanners see it)."""
    return KEY_PREFIX + secrets.token_urlsafe(32)


def parse_clients(entries: Any, source: str = "clients") -> list[Client]:
    """The client list as the inventory holds it -> one Client per entry, checked.

    Each entry: {name, key, limits: {concurrent, requests_per_minute, tokens_per_minute, models}}, every
    limit optional. A ClientsError names the entry and the fault, never the key.
    """
    if entries is None:
        return []
    if not isinstance(entries, list):
        raise ClientsError("%s: expected a list of clients, got %s" % (source, type(entries).__name__))
    clients: list[Client] = []
    names: set[str] = set()
    digests: set[str] = set()
    for number, entry in enumerate(entries, 1):
        where = "%s: client %d" % (source, number)
        if not isinstance(entry, dict):
            raise ClientsError("%s: expected a mapping with name and key" % where)
        unknown = sorted(set(entry) - set(FIELDS))
        if unknown:
            raise ClientsError("%s: unknown field %s (expected %s)" % (where, unknown[0], ", ".join(FIELDS)))
        name = entry.get("name")
        if not isinstance(name, str) or not NAME.match(name):
            raise ClientsError(
                "%s: name must be 1-48 characters of a-z, 0-9, '_', '.', '-', starting with a letter or digit" % where
            )
        where = "%s (%s)" % (where, name)
        if name in names:
            raise ClientsError("%s: a second client of that name" % where)
        key = entry.get("key")
        if not isinstance(key, str) or not KEY.match(key):
            raise ClientsError("%s: key must be a string of printable ASCII without spaces" % where)
        if not MIN_KEY_CHARS <= len(key) <= MAX_KEY_CHARS:
            raise ClientsError(
                "%s: key is %d characters; it must be %d-%d (make one with `vlserve keys new`)"
                % (where, len(key), MIN_KEY_CHARS, MAX_KEY_CHARS)
            )
        digest = key_digest(key)
        if digest in digests:
            raise ClientsError("%s: the same key as an earlier client" % where)
        limits = _limits(entry.get("limits") or {}, where)
        names.add(name)
        digests.add(digest)
        clients.append(Client(name=name, digest=digest, **limits))
    return clients


def _limits(limits: Any, where: str) -> dict[str, Any]:
    if not isinstance(limits, dict):
        raise ClientsError("%s: limits must be a mapping" % where)
    unknown = sorted(set(limits) - set(LIMITS) - {"models"})
    if unknown:
        raise ClientsError("%s: unknown limit %s (expected %s, models)" % (where, unknown[0], ", ".join(LIMITS)))
    checked: dict[str, Any] = {}
    for name in LIMITS:
        value = limits.get(name)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 10**9:
            raise ClientsError("%s: limits.%s must be a whole number from 1 (leave it out for none)" % (where, name))
        checked[name] = value
    models = limits.get("models")
    if models is not None:
        if not isinstance(models, list) or not models or not all(isinstance(m, str) for m in models):
            raise ClientsError("%s: limits.models must be a non-empty list of served model names" % where)
        bad = [m for m in models if m != ALL_MODELS and not MODEL.match(m)]
        if bad:
            raise ClientsError("%s: limits.models has %r, which is not a model name" % (where, bad[0]))
        checked["models"] = (ALL_MODELS,) if ALL_MODELS in models else tuple(sorted(set(models)))
    return checked


def front_clients(entries: Any, source: str = "clients") -> list[dict[str, Any]]:
    """The client list -> what a front's templates need (digests and limits, no keys)."""
    return [client.as_dict() for client in parse_clients(entries, source)]

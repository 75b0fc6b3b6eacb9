"""API keys and who may be urgent.

``--api-key KEY`` is the operator's key (tenant ``operator``, which a keys file may not
name): any priority, with either ``--priority-source``, and ``/v1/abort``. ``--api-keys FILE``
adds tenants' keys, as one key per line (``#`` comments), or JSON / TOML::

    [[keys]]                      # JSON: {"keys": [{...}, ...]} or a bare list
    key = "sk-team-a"
    tenant = "team-a"
    most_urgent_priority = 0      # the lowest priority value this key may ask for
                                  # (default: its default_priority: no more urgent)
    default_priority = 10         # used when the body sets none (default: 0, or
                                  # most_urgent_priority where that is above 0)
    admin = false                 # may call /v1/abort
    weight = 1.0                  # share under --tenant-fairness vtc (2.0: twice the service)

Priorities follow vLLM: lower is earlier. The server, not the client, decides who may be
urgent: a body asking for more urgency than its key allows gets 403, and with
``--priority-source key`` the body may not choose (a body that sends the key's own
priority is taken: it chooses nothing).
"""

from __future__ import annotations

import hashlib
import hmac
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvserve.core.checks import is_int, is_real
from kvserve.server.errors import APIError, bad_request


def is_valid_key(key: object) -> bool:
    """A key can travel in an Authorization header: a non-empty string of printable ASCII
    characters, no spaces (a header is read as Latin-1, so a key past ASCII never matched
    what a client sends as UTF-8, QA)."""
    return isinstance(key, str) and bool(key) and key.isascii() and key.isprintable() and \
        not any(c.isspace() for c in key)


KEY_RULE = "a non-empty string of printable ASCII without spaces (it travels in an HTTP header)"
# A key's priorities, as a body's (server/protocol.py): a keys file could make a tenant more
# urgent than any body may write (QA)
PRIORITY_RANGE = (-(1 << 31), 1 << 31)


@dataclass(frozen=True)
class ApiKey:
    key: str
    tenant: str
    # None: no limit (the operator's keys, and no keys at all); a keys file's key has one,
    # its default_priority where the file names none
    most_urgent_priority: int | None = None
    default_priority: int = 0
    admin: bool = False
    weight: float = 1.0
    operator: bool = False  # an --api-key key: any priority, whatever --priority-source says


# The tenant of the --api-key keys; a keys file may not name it (their caches, sessions and
# metrics series would merge with the operator's).
OPERATOR_TENANT = "operator"


def operator_key(key: str) -> ApiKey:
    return ApiKey(key, OPERATOR_TENANT, admin=True, operator=True)


OPEN_ACCESS = ApiKey("", "anonymous", admin=True)  # no keys configured: nothing is checked


class KeyFileError(ValueError):
    """A keys file that cannot be read as keys: one line names the problem."""


def load_keys(path: str | Path) -> list[ApiKey]:
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8-sig")  # a BOM some editors write: not a key
    except OSError as error:
        raise KeyFileError(f"cannot read API keys file {path}: {error.strerror}") from None
    except UnicodeDecodeError as error:
        raise KeyFileError(f"{path}: not UTF-8 text (byte {error.start}); a keys file is "
                           "lines of keys, JSON or TOML") from None
    stripped = text.lstrip()
    if path.suffix == ".toml":
        entries = _toml_entries(text, path)
    elif stripped.startswith(("{", "[")):
        try:
            data = json.loads(text)
        except json.JSONDecodeError as error:
            raise KeyFileError(f"{path}: not valid JSON: {error}") from None
        except RecursionError:  # QA: a traceback
            raise KeyFileError(f"{path}: JSON nested too deeply to be a keys file") from None
        entries = data.get("keys") if isinstance(data, dict) else data
    else:
        entries = [{"key": line.strip()} for line in text.splitlines()
                   if line.strip() and not line.strip().startswith("#")]
    if not isinstance(entries, list) or not entries:
        raise KeyFileError(f"{path}: no keys found (one key per line, or TOML/JSON with a "
                           "[[keys]] table per key: docs/tenants.md, 'The keys file')")
    keys = [_key_from_entry(entry, index, path) for index, entry in enumerate(entries)]
    named = {entry["tenant"] for entry in entries
             if isinstance(entry, dict) and isinstance(entry.get("tenant"), str)}
    for index, entry in enumerate(entries):
        if "tenant" not in entry and keys[index].tenant in named:  # silently one tenant
            raise KeyFileError(f"{path}: key #{index + 1} has no tenant, and its default name "
                               f"'{keys[index].tenant}' is another key's tenant; name its "
                               "tenant")
    seen: dict[str, int] = {}
    for index, key in enumerate(keys):
        if key.key in seen:  # whose tenant would it be?
            raise KeyFileError(f"{path}: key #{index + 1} is key #{seen[key.key] + 1} again; "
                               "each key may appear once")
        seen[key.key] = index
    return keys


def _toml_entries(text: str, path: Path) -> Any:
    try:
        import tomllib
    except ImportError:  # Python 3.10
        raise KeyFileError(f"{path}: TOML keys files need Python 3.11; use JSON") from None
    try:
        return tomllib.loads(text).get("keys")
    except tomllib.TOMLDecodeError as error:
        raise KeyFileError(f"{path}: not valid TOML: {error}") from None


def _key_from_entry(entry: Any, index: int, path: Path) -> ApiKey:
    where = f"{path}: key #{index + 1}"
    if not isinstance(entry, dict):
        raise KeyFileError(f"{where} must be a table/object with a 'key'")
    known = {"key", "tenant", "most_urgent_priority", "default_priority", "admin", "weight"}
    unknown = sorted(set(entry) - known)
    if unknown:
        raise KeyFileError(f"{where}: unknown field(s) {', '.join(unknown)}; known: "
                           f"{', '.join(sorted(known))}")
    key = entry.get("key")
    if not is_valid_key(key):
        raise KeyFileError(f"{where}: 'key' must be {KEY_RULE}")
    tenant = entry.get("tenant", f"key-{index + 1}")
    if not isinstance(tenant, str) or not tenant.strip() or not tenant.isprintable() \
            or tenant != tenant.strip():
        raise KeyFileError(f"{where}: 'tenant' must be a non-empty string of printable "
                           "characters, without spaces at either end (it names metrics "
                           "series and log lines)")
    if tenant == OPERATOR_TENANT:
        raise KeyFileError(f"{where}: tenant '{OPERATOR_TENANT}' is the --api-key keys' own "
                           "(a tenant sharing it would share their prefix cache, sessions and "
                           "metrics); name the tenant otherwise, or give the key with "
                           "--api-key")
    for name in ("most_urgent_priority", "default_priority"):
        value = entry.get(name)
        if value is not None and (not is_int(value)
                                  or not PRIORITY_RANGE[0] <= value < PRIORITY_RANGE[1]):
            raise KeyFileError(f"{where}: '{name}' must be an integer from -2**31 to "
                               "2**31 - 1, as a request's priority")
    urgent = entry.get("most_urgent_priority")
    default = entry.get("default_priority", 0 if urgent is None else max(0, urgent))
    if urgent is None:  # the server's call: no more urgent than its default unless granted
        urgent = default
    if default < urgent:
        raise KeyFileError(f"{where}: default_priority {default} is more urgent than "
                           f"most_urgent_priority {urgent}")
    admin = entry.get("admin", False)
    if not isinstance(admin, bool):
        raise KeyFileError(f"{where}: 'admin' must be true or false")
    weight = entry.get("weight", 1.0)
    if not is_real(weight) or not 0 < weight <= 1e6:
        raise KeyFileError(f"{where}: 'weight' must be a number in (0, 1e6]")
    return ApiKey(key, tenant, urgent, default, admin, float(weight))


class KeyRing:
    """Looks up the key of a request; with no keys at all, everything is open."""

    def __init__(self, keys: list[ApiKey]) -> None:
        self.keys = list(keys)

    @property
    def enabled(self) -> bool:
        return bool(self.keys)

    def authenticate(self, authorization: str | list[str] | None) -> ApiKey:
        """The key of a request's Authorization header (a list: every one the request sent,
        ``request.headers.getlist("authorization")``); 401 when it has none, a malformed or
        unknown one, or more than one (which of two a proxy or a client meant is a guess)."""
        if not self.keys:
            return OPEN_ACCESS
        if isinstance(authorization, list):
            if len(authorization) > 1:
                raise APIError(401, f"the request has {len(authorization)} Authorization "
                                    "headers: send one, 'Authorization: Bearer <key>'",
                               code="invalid_api_key")
            authorization = authorization[0] if authorization else None
        if not authorization:
            raise APIError(401, "missing API key: send the header 'Authorization: Bearer "
                                "<key>'", code="invalid_api_key")
        scheme, _, token = authorization.partition(" ")
        token = token.strip()
        if scheme.lower() != "bearer" or not token:
            raise APIError(401, "malformed Authorization header: expected 'Bearer <key>'",
                           code="invalid_api_key")
        for key in self.keys:
            if hmac.compare_digest(key.key.encode(), token.encode()):
                return key
        raise APIError(401, "invalid API key", code="invalid_api_key")


def resolve_priority(requested: int | None, key: ApiKey, *, source: str,
                     scheduling_policy: str) -> int:
    """The priority a request runs at, or the refusal (400 / 403) with its reason."""
    if requested is not None and source == "key" and not key.operator \
            and requested != key.default_priority:
        raise APIError(403, f"priority is set by your API key on this server "
                            f"({key.default_priority} for tenant '{key.tenant}'); remove "
                            "'priority' from the request", param="priority")
    priority = key.default_priority if requested is None else requested
    if priority != 0 and scheduling_policy != "priority":
        raise bad_request(f"priority {priority} was requested but priority scheduling is "
                          "not enabled on this server (it runs --scheduling-policy "
                          f"{scheduling_policy}); remove 'priority' or start the server with "
                          "--scheduling-policy priority", param="priority")
    if key.most_urgent_priority is not None and priority < key.most_urgent_priority:
        raise APIError(403, f"priority {priority} is more urgent than tenant '{key.tenant}' "
                            f"may ask for (lower is more urgent; the most urgent allowed is "
                            f"{key.most_urgent_priority})", param="priority")
    return priority


def tenant_weights(keys: list[ApiKey]) -> tuple[tuple[str, float], ...]:
    """(tenant, weight) for the scheduler's fair share; a tenant's keys must agree."""
    weights: dict[str, float] = {}
    for key in keys:
        if weights.setdefault(key.tenant, key.weight) != key.weight:
            raise KeyFileError(f"tenant '{key.tenant}' has keys with different weights "
                               f"({weights[key.tenant]} and {key.weight})")
    return tuple((tenant, weight) for tenant, weight in weights.items() if weight != 1.0)


MAX_USER_CHARS = 256  # a longer ``user`` names its tenant by its hash


def tenant_of(key: ApiKey, keys_enabled: bool, user: str | None,
              client_host: str | None) -> str:
    """Who a request is from: its API key's tenant; without keys, the body's ``user`` (one
    over 256 characters by its SHA-256: the name is kept wherever the request's tenant is,
    QA: 2 MB names), or else the client's address."""
    if keys_enabled:
        return key.tenant
    if user:
        if len(user) > MAX_USER_CHARS:
            # a namespace of its own: no short user names the same tenant
            return "user-sha256:" + hashlib.sha256(user.encode("utf-8", "surrogatepass")
                                                   ).hexdigest()
        return f"user:{user}"
    return f"addr:{client_host or 'unknown'}"

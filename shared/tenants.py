"""Tenants: whose a request is, and the terms its API key gives it; the keys file that names them.

A request carries its tenant's terms on the bus, so that the scheduler applies the limits, priority caps and
shares of the keys file as the gateway read it last (reloaded without a restart). The file is TOML:

    [tenants.interactive]
    keys = ["sk-...", "sk-..."]   # the API keys that are this tenant's
    weight = 4                    # its share of the capacity under the fair policy, against the others'
    max_priority = -10            # the most urgent `priority` its requests may ask for (lower runs first)

Every limit is 0 (none) unless given: max_waiting_requests, max_queued_tokens (prompt tokens waiting),
max_queue_time (seconds before a waiting request ends with 429), tokens_per_minute (prompt and generated
tokens computed), max_seqs (sequences running at once across the cluster). `shared_cache = true` lets the
tenant's prompts share prefix-cache blocks with every other tenant that opts in.
"""
from __future__ import annotations

import math
import tomllib
from dataclasses import dataclass, fields
from typing import Any

DEFAULT_TENANT = "default"
MAX_TENANTS = 256  # bounds the metrics' `tenant` label and the scheduler's ledger


class TenantError(ValueError):
    """A tenant's terms, or the keys file, that pagedserve cannot use; the message says which and why."""


@dataclass(frozen=True, slots=True)
class Tenant:
    """One tenant's name and terms, as a request carries them."""
    name: str = DEFAULT_TENANT
    weight: float = 1.0
    max_priority: int | None = None  # None: any priority (the one-tenant server, as vLLM)
    max_waiting_requests: int = 0
    max_queued_tokens: int = 0
    max_queue_time: float = 0.0
    tokens_per_minute: int = 0
    max_seqs: int = 0
    shared_cache: bool = False

    def validate(self) -> "Tenant":
        if not self.name or len(self.name) > 64 or not all(c.isalnum() or c in "-_." for c in self.name):
            raise TenantError(f"tenant name {self.name!r} must be 1-64 letters, digits, '-', '_' or '.'")
        if not (math.isfinite(self.weight) and self.weight > 0):
            raise TenantError(f"tenant {self.name}: weight must be a positive number; got {self.weight}")
        for name in ("max_waiting_requests", "max_queued_tokens", "max_queue_time", "tokens_per_minute", "max_seqs"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise TenantError(f"tenant {self.name}: {name} must be 0 (no limit) or more; got {value}")
        return self

    @property
    def cache_salt(self) -> str:
        """What keeps its prefix-cache blocks its own: its name, unless it shares the cache (or is the one tenant of a
        server without a keys file)."""
        return "" if self.shared_cache or self.name == DEFAULT_TENANT else self.name


def under_share(limit: float, total: float, held: float, adding: float, weight: float, weights_holding: float) -> bool:
    """Under the fair policy, whether a tenant holding `held` of a server-wide queue limit (requests or prompt
    tokens; `total` held in all) stays within its share when it adds `adding`: the limit split by the weights of
    the tenants holding some (`weights_holding`, its own included). Such a tenant still joins a full queue, up to
    twice the limit: a tenant sending ten times the others' load cannot fill the queue for them."""
    return total + adding <= 2 * limit and held + adding <= limit * weight / weights_holding


@dataclass(frozen=True, slots=True)
class Keys:
    """API key → tenant: the keys file's, or one tenant for `--api-key`'s keys (or for everyone, with none)."""
    tenants: dict[str, Tenant]

    @classmethod
    def single(cls, keys: list[str]) -> "Keys":
        return cls({key: Tenant() for key in keys})

    @property
    def required(self) -> bool:
        return bool(self.tenants)

    def tenant(self, key: str) -> Tenant:
        """The tenant of an authenticated key (everyone is the default tenant where no key is required)."""
        return self.tenants.get(key, Tenant())


TERMS = {f.name: f.type for f in fields(Tenant) if f.name != "name"}
_KINDS = {"float": (int, float), "int": (int,), "int | None": (int,), "bool": (bool,)}


def parse_keys(text: str, source: str = "the keys file") -> Keys:
    """The tenants of a keys file; TenantError naming what is wrong and where."""
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise TenantError(f"{source} is not valid TOML: {e}") from None
    unknown = set(doc) - {"tenants"}
    if unknown:
        raise TenantError(f"{source}: unknown table {sorted(unknown)[0]!r}; tenants go under [tenants.NAME]")
    tables = doc.get("tenants")
    if not isinstance(tables, dict) or not tables:
        raise TenantError(f"{source} names no tenant; add a [tenants.NAME] table with its `keys`")
    if len(tables) > MAX_TENANTS:
        raise TenantError(f"{source} names {len(tables)} tenants; at most {MAX_TENANTS}")
    by_key: dict[str, Tenant] = {}
    for name, table in tables.items():
        where = f"{source}: [tenants.{name}]"
        if name == DEFAULT_TENANT:
            raise TenantError(f"{where}: `{DEFAULT_TENANT}` is the tenant of a server without a keys file; "
                              "name yours otherwise")
        if not isinstance(table, dict):
            raise TenantError(f"{where} must be a table")
        keys = table.get("keys")
        if not isinstance(keys, list) or not keys or not all(isinstance(k, str) and k.strip() for k in keys):
            raise TenantError(f"{where} needs `keys`, a list of one or more non-empty strings")
        terms = _terms(where, {k: v for k, v in table.items() if k != "keys"})
        try:
            tenant = Tenant(name, **terms).validate()
        except TenantError as e:
            raise TenantError(f"{where}: {e}") from None
        for key in keys:
            if key in by_key:
                raise TenantError(f"{where}: a key is also tenant {by_key[key].name}'s; a key names one tenant")
            by_key[key] = tenant
    return Keys(by_key)


def _terms(where: str, table: dict[str, Any]) -> dict[str, Any]:
    terms = {}
    for name, value in table.items():
        if name not in TERMS:
            raise TenantError(f"{where}: unknown field {name!r}; the fields are keys, {', '.join(TERMS)}")
        kinds = _KINDS[TERMS[name]]
        if not isinstance(value, kinds) or (bool not in kinds and isinstance(value, bool)):
            raise TenantError(f"{where}: {name} must be {TERMS[name].replace('int | None', 'int')}; got {value!r}")
        terms[name] = float(value) if TERMS[name] == "float" else value
    if "max_priority" not in terms:
        terms["max_priority"] = 0  # a tenant of the file goes ahead of the default only where the file says so
    return terms

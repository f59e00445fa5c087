"""The API keys a gateway accepts and whose they are: `--api-key`'s (one tenant), or a keys file's tenants
(shared/tenants.py), read again on SIGHUP and when the file changes, without a restart. A file that does not
read or parse leaves the keys as they were, and the log says why."""
from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import os
import signal
from pathlib import Path

from shared.settings import Settings
from shared.tenants import Keys, Tenant, TenantError, parse_keys

log = logging.getLogger(__name__)
POLL_S = 0.5  # how often the file's change time is looked at: new keys hold within a second


class KeyRing:
    def __init__(self, settings: Settings) -> None:
        self.path = Path(settings.api_keys) if settings.api_keys else None
        self.stamp: tuple[int, int, int] | None = None
        if self.path is None:
            self.keys = Keys.single([k for k in (part.strip() for part in settings.api_key.split(",")) if k])
        else:
            self.keys = self._read()  # at start, a file that does not parse stops the gateway
            log.info("%s", self._summary("read"))

    def _summary(self, verb: str) -> str:
        tenants = {t.name for t in self.keys.tenants.values()}
        return f"{verb} {len(self.keys.tenants)} API keys of {len(tenants)} tenants from {self.path}"

    def _read(self) -> Keys:
        assert self.path is not None
        stamp = _stamp_of(self.path)
        try:
            text = self.path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise TenantError(f"cannot read the keys file {self.path}: {e}") from None
        keys = parse_keys(text, str(self.path))
        self.stamp = stamp
        return keys

    def reload(self, why: str) -> bool:
        """Read the file again; on any error keep the keys there are."""
        try:
            self.keys = self._read()
        except TenantError as e:
            self.stamp = _stamp_of(self.path)  # reported once, not at every look
            log.error("%s; keeping the %d keys read before (%s)", e, len(self.keys.tenants), why)
            return False
        log.info("%s (%s)", self._summary("reloaded"), why)
        return True

    def changed(self) -> bool:
        return _stamp_of(self.path) != self.stamp

    async def watch(self) -> None:
        """Reload on SIGHUP (where this loop can take signals) and when the file changes."""
        if self.path is None:
            return
        loop = asyncio.get_running_loop()
        with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):  # not the main thread, or no signals
            loop.add_signal_handler(signal.SIGHUP, self.reload, "SIGHUP")
        try:
            while True:
                await asyncio.sleep(POLL_S)
                if self.changed():
                    self.reload("the file changed")
        finally:
            with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
                loop.remove_signal_handler(signal.SIGHUP)

    def tenant(self, given: str) -> Tenant | None:
        """The tenant of a key, comparing every key so that the time taken says nothing about which came close;
        None for a key it does not know (where keys are required)."""
        if not self.keys.required:
            return Tenant()
        found = None
        for key, tenant in self.keys.tenants.items():
            if hmac.compare_digest(given.encode(), key.encode()):
                found = tenant
        return found


def _stamp_of(path: Path) -> tuple[int, int, int] | None:
    try:
        stat = os.stat(path)
    except OSError:
        return None
    return (stat.st_mtime_ns, stat.st_size, stat.st_ino)

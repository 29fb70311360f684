"""The admin API's credentials for this process: the --admin-credentials file, or the
one admin token as the built-in `admin` credential; reloaded on SIGHUP and when the
file changes (checked every reload_interval_seconds)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from sitsmesh import access, logs
from sitsmesh.app.background import Background
from sitsmesh.authz.model import APIKEY_KIND
from sitsmesh.config import Settings
from sitsmesh.errors import ConfigError
from sitsmesh.state import StateStore
from sitsmesh.transport.adminaccess import VIA_KEY_TENANT, AdminAccess

_log = logs.get("sitsmesh.admin.access")


def build(settings: Settings, store: StateStore, token: Callable[[], str],
          on_reject: Callable[[], None]) -> AdminAccess:
    """Raises ConfigError for a bad file: the process does not start with one."""
    if settings.admin_credentials is not None:
        credentials = access.load(settings.admin_credentials)
        _log.info("admin credentials loaded", source=credentials.source,
                  credentials=len(credentials.by_name))
    else:
        credentials = access.builtin(token())

    async def key_tenant(key_id: str) -> str:
        record = await store.get(APIKEY_KIND, key_id) if key_id else None
        tenant = record.body.get("tenant") if record is not None else None
        return tenant if isinstance(tenant, str) else ""

    return AdminAccess(credentials, {VIA_KEY_TENANT: key_tenant}, on_reject)


def reload(settings: Settings, admin: AdminAccess) -> None:
    """Re-read the file; a bad one is logged and the credentials in use stay."""
    if settings.admin_credentials is None:
        return
    try:
        credentials = access.load(settings.admin_credentials)
    except ConfigError as exc:
        _log.error("admin credentials not reloaded; keeping the previous ones",
                   error=exc.message)
        return
    admin.reload(credentials)
    _log.info("admin credentials reloaded", source=credentials.source,
              credentials=len(credentials.by_name))


class Watch:
    """Reloads the file when its identity (inode, size, mtime) changes: a Kubernetes
    Secret update swaps a symlink, an edit rewrites the file."""

    def __init__(self, settings: Settings, admin: AdminAccess) -> None:
        self._settings = settings
        self._admin = admin
        self._path = settings.admin_credentials
        self._seen = _signature(self._path)
        self._background = Background()

    def start(self) -> None:
        if self._path is not None:
            self._background.every(self._settings.reload_interval_seconds, self.poll)

    def poll(self) -> None:
        seen = _signature(self._path)
        if seen != self._seen:
            self._seen = seen
            reload(self._settings, self._admin)

    async def stop(self) -> None:
        await self._background.stop()


def _signature(path: Path | None) -> tuple[int, int, int] | None:
    try:
        stat = path.stat() if path is not None else None
    except OSError:
        return None
    return (stat.st_ino, stat.st_size, stat.st_mtime_ns) if stat is not None else None

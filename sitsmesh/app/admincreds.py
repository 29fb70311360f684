"""The admin API's credentials for this process: the --admin-credentials file, or the
one admin token as the built-in `admin` credential; reloaded on SIGHUP."""

from __future__ import annotations

from collections.abc import Callable

from sitsmesh import access, logs
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

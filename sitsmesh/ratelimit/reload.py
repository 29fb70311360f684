"""Rate-limit config reloads: from files, from the admin API, on SIGHUP.

A reload builds a whole new snapshot and validates it before the one
assignment that makes it live; a bad reload keeps the old snapshot, counts the
error and logs it. Configs applied through the admin API are persisted in the
state store, so every worker process (and a restart) sees them.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

from prometheus_client import CollectorRegistry, Counter

from sitsmesh import logs
from sitsmesh.errors import ConfigError
from sitsmesh.ratelimit import config as rlconfig
from sitsmesh.ratelimit.config import RateLimitConfig
from sitsmesh.ratelimit.limiter import ConfigHolder
from sitsmesh.state import StateStore

KIND = "ratelimit_config"
NOT_LOADED_VERSION = "not-loaded"
_log = logs.get("sitsmesh.ratelimit.reload")


def version_of(config: RateLimitConfig) -> str:
    digest = hashlib.sha256()
    for domain in sorted(config.texts):
        digest.update(f"{domain}\0{config.sources[domain]}\0{config.texts[domain]}\0".encode())
    return digest.hexdigest()[:12]


class ConfigManager:
    def __init__(self, paths: Sequence[Path], state: StateStore,
                 registry: CollectorRegistry | None, *, merge: bool = False) -> None:
        self._paths = list(paths)
        self._merge = merge
        self._state = state
        self.holder = ConfigHolder(rlconfig.NOT_LOADED)
        self.version = NOT_LOADED_VERSION
        self._errors = Counter("sitsmesh_ratelimit_config_load_errors_total",
                               "Rate-limit config reloads rejected; the old config stays live.",
                               registry=registry)
        self._loads = Counter("sitsmesh_ratelimit_config_loads_total",
                              "Rate-limit config snapshots made live.", registry=registry)
        self._signature: tuple[object, ...] = ()
        self._revision = -1  # the state revision in _signature
        # Told after every snapshot that goes live (config health follows it).
        self.on_live: Callable[[], None] = lambda: None
        self._lock = asyncio.Lock()

    async def _applied(self) -> list[tuple[str, str]]:
        return [(r.body["source"], r.body["yaml"]) for r in await self._state.list(KIND)]

    def _file_signature(self) -> tuple[object, ...]:
        sig: list[object] = []
        for path in rlconfig.expand(p for p in self._paths if p.exists()):
            try:
                st = path.stat()
            except OSError:
                continue
            sig.append((str(path), st.st_mtime_ns, st.st_size))
        return tuple(sig)

    async def build(self, extra: Iterable[tuple[str, str]] = (),
                    drop_domains: Iterable[str] = ()) -> RateLimitConfig:
        """Files + applied configs (+ `extra` replacing applied ones by domain), validated."""
        files = await asyncio.to_thread(rlconfig.read_files, self._paths)
        applied = await self._applied()
        # Parsing a large config takes seconds: in a thread, so the event loop keeps
        # answering Check and ShouldRateLimit meanwhile.
        return await asyncio.to_thread(self._assemble, files, applied, list(extra),
                                       set(drop_domains))

    def _assemble(self, files: list[tuple[str, str]], applied: list[tuple[str, str]],
                  extra: list[tuple[str, str]], dropped: set[str]) -> RateLimitConfig:
        extra_domains = {rlconfig.parse_domain(src, text)[0] for src, text in extra}
        kept = []
        for src, text in applied:
            domain = rlconfig.parse_domain(src, text)[0]
            if domain not in extra_domains and domain not in dropped:
                kept.append((src, text))
        return rlconfig.build([*files, *kept, *extra], merge=self._merge)

    async def reload(self, reason: str) -> bool:
        """Make a fresh snapshot live. False (old snapshot kept) when it is invalid."""
        async with self._lock:
            revision = await self._state.revision()
            signature = (self._file_signature(), revision)
            try:
                config = await self.build()
            except ConfigError as exc:
                self._errors.inc()
                self._signature, self._revision = signature, revision
                if self.holder.current is rlconfig.NOT_LOADED:
                    _log.error("rate-limit config rejected; none is live, so every "
                               "ShouldRateLimit fails with 'no rate limit configuration "
                               "loaded' until a reload succeeds", reason=reason,
                               error=exc.message)
                else:
                    _log.error("rate-limit config rejected; keeping the previous one",
                               reason=reason, error=exc.message, version=self.version)
                return False
            self._signature, self._revision = signature, revision
            version = version_of(config)
            if version != self.version or reason == "startup":
                self.holder.current = config
                self.version = version
                self._loads.inc()
                _log.info("rate-limit config live", reason=reason, version=version,
                          domains=sorted(config.domains))
                self.on_live()
            return True

    async def watch(self, interval_s: float) -> None:
        """Poll files every interval; reload when they or the state store changed (the
        store's change wakes the wait at once where the backend can tell)."""
        while True:
            try:
                revision = await self._state.wait_for_change(self._revision, interval_s)
                if (self._file_signature(), revision) != self._signature:
                    await self.reload("changed")
            except Exception as exc:  # a transient state-store error must not end the watch;
                # the live snapshot stays until a reload succeeds
                _log.warning("config watch failed", error=str(exc))
                await asyncio.sleep(interval_s)

    async def check(self, files: Sequence[tuple[str, str]], drop_domains: Iterable[str] = ()
                    ) -> tuple[RateLimitConfig, list[tuple[str, str, str]]]:
        """The config `files` (name, text) would make with everything else, and each one's
        (source, text, domain); ConfigError when a file already owns a domain or the whole
        does not validate. Writes nothing."""
        named = await asyncio.to_thread(self._named, files)
        return await self.build([(s, t) for s, t, _ in named], drop_domains), named

    def _named(self, files: Sequence[tuple[str, str]]) -> list[tuple[str, str, str]]:
        file_domains = {rlconfig.parse_domain(src, text)[0]: src
                        for src, text in rlconfig.read_files(self._paths)}
        named = []
        for name, text in files:
            source = f"api:{name}"
            domain = rlconfig.parse_domain(source, text)[0]
            if domain in file_domains:
                raise ConfigError(f"{source}: domain '{domain}' is defined in file "
                                  f"{file_domains[domain]}; change the file instead")
            named.append((source, text, domain))
        return named

    async def apply(self, files: Sequence[tuple[str, str]], *, dry_run: bool
                    ) -> tuple[RateLimitConfig, list[str]]:
        """Validate `files` with everything else; persist and go live unless dry_run."""
        config, named = await self.check(files)
        domains = sorted(d for _, _, d in named)
        if not dry_run:
            for source, text, domain in named:
                await self._state.put(KIND, domain, {"source": source, "yaml": text})
            await self.reload("admin api")
        return config, domains

    async def delete(self, domain: str) -> bool:
        if await self._state.get(KIND, domain) is None:
            return False
        await self.build(drop_domains=[domain])
        await self._state.delete(KIND, domain)
        await self.reload("admin api")
        return True

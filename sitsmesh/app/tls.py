"""Transport security of `serve`: TLS credentials that follow rotated files, the checks
run before any port opens, the refused-call counter, and secrets read from files."""

from __future__ import annotations

import ssl
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, cast
from urllib.parse import quote

import grpc

from sitsmesh import logs
from sitsmesh.config import Settings
from sitsmesh.errors import ConfigError, StartupError

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry, Counter

_log = logs.get("sitsmesh.tls")
# A rotated file is picked up by the first handshake at least this long after the last
# look: one stat per file per second at most, whatever the connection rate.
RECHECK_S = 1.0
MIN_TOKEN_BYTES = 32
Stamp = tuple[tuple[int, int, int], ...]
_KEYS = ("cert_file", "key_file", "client_ca_file")  # each setting is SIDE_tls_KEY


def refused_calls(registry: CollectorRegistry | None) -> Counter:
    # Imported here: `serve` runs this module's checks before PROMETHEUS_MULTIPROC_DIR is
    # set, and prometheus_client reads it once, at import.
    from prometheus_client import Counter

    return Counter("sitsmesh_data_calls_refused_total",
                   "Data-plane calls refused because the caller is not on the service's "
                   "allowlist (data_callers).", ["service"], registry=registry)


class CertFiles:
    """One server's certificate, key and (for mTLS) client CA, re-read when they change.

    cert-manager and Istio rotate these files in place (a mounted Secret swaps a
    symlink). grpc asks `fetch` for new material on each TLS handshake; a file caught
    half-written fails to load, is logged, and is tried again on a later handshake while
    the current material keeps serving.
    """

    def __init__(self, server: str, cert: Path, key: Path, client_ca: Path | None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.server = server
        self._paths: tuple[Path, ...] = (cert, key) + ((client_ca,) if client_ca else ())
        self.mutual = client_ca is not None
        self._clock = clock
        try:
            self._stamp, self._initial = self._load()
        except (OSError, ssl.SSLError, ValueError) as exc:
            raise StartupError(_reason(exc)) from None
        self._checked = clock()
        self.reloads = 0

    def _stat(self) -> Stamp:
        stamps = []
        for key, path in zip(_KEYS, self._paths, strict=False):
            try:
                st = path.stat()
            except OSError as exc:
                raise ValueError(f"{self.server}_tls_{key} {path}: cannot read: "
                                 f"{exc.strerror or exc}") from None
            stamps.append((st.st_mtime_ns, st.st_size, st.st_ino))
        return tuple(stamps)

    def _load(self) -> tuple[Stamp, grpc.ServerCertificateConfiguration]:
        before = self._stat()
        cert, key, *ca = (_read(f"{self.server}_tls_{k}", p)
                          for k, p in zip(_KEYS, self._paths, strict=False))
        # Checked here because grpc would accept them and only fail the handshakes later.
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        side = self.server
        try:
            context.load_cert_chain(self._paths[0], self._paths[1])
        except ssl.SSLError as exc:
            problem = ("the key does not match the certificate"
                       if "KEY_VALUES_MISMATCH" in str(exc) else
                       "not a PEM certificate chain and private key")
            raise ValueError(f"{side}_tls_cert_file {self._paths[0]} and {side}_tls_key_file "
                             f"{self._paths[1]}: {problem}") from None
        if ca:
            try:
                context.load_verify_locations(cadata=ca[0].decode("ascii", errors="replace"))
            except (ssl.SSLError, ValueError):
                raise ValueError(f"{side}_tls_client_ca_file {self._paths[2]}: not a PEM CA "
                                 "bundle") from None
        if self._stat() != before:
            raise ValueError("the files changed while being read")
        config = grpc.ssl_server_certificate_configuration(
            [(key, cert)], root_certificates=ca[0] if ca else None)
        return before, config

    def fetch(self) -> grpc.ServerCertificateConfiguration | None:
        """New material if the files changed since the last load; None keeps the current."""
        now = self._clock()
        if now - self._checked < RECHECK_S:
            return None
        self._checked = now
        try:
            if self._stat() == self._stamp:
                return None
            self._stamp, config = self._load()
        except (OSError, ssl.SSLError, ValueError) as exc:
            _log.warning("TLS files changed but do not load; serving the previous ones",
                         server=self.server, error=_reason(exc))
            return None
        self.reloads += 1
        _log.info("TLS certificate reloaded", server=self.server, files=[str(p) for p in
                                                                         self._paths])
        return config

    def credentials(self) -> grpc.ServerCredentials:
        # grpc documents None from the fetcher as "no change"; its stubs say otherwise.
        fetch = cast(Callable[[], grpc.ServerCertificateConfiguration], self.fetch)
        return grpc.dynamic_ssl_server_credentials(
            self._initial, fetch, require_client_authentication=self.mutual)


def cert_files(settings: Settings, server: str) -> CertFiles | None:
    """The TLS files of the `data` or `admin` server; None when it serves plaintext."""
    cert: Path | None = getattr(settings, f"{server}_tls_cert_file")
    key: Path | None = getattr(settings, f"{server}_tls_key_file")
    if cert is None or key is None:
        return None
    return CertFiles(server, cert, key, getattr(settings, f"{server}_tls_client_ca_file"))


def _read(key: str, path: Path) -> bytes:
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise ValueError(f"{key} {path}: cannot read: {exc.strerror or exc}") from None
    if not data.strip():
        raise ValueError(f"{key} {path}: file is empty")
    return data


def _reason(exc: BaseException) -> str:
    if isinstance(exc, OSError) and exc.filename:
        return f"{exc.filename}: cannot read: {exc.strerror or exc}"
    return str(exc)


def check_transport(settings: Settings) -> None:
    """Settings that contradict each other; raises ConfigError naming them."""
    for side in ("data", "admin"):
        cert = getattr(settings, f"{side}_tls_cert_file")
        key = getattr(settings, f"{side}_tls_key_file")
        ca = getattr(settings, f"{side}_tls_client_ca_file")
        if (cert is None) != (key is None):
            raise ConfigError(f"{side}_tls_cert_file and {side}_tls_key_file: set both "
                              "or neither")
        if ca is not None and cert is None:
            raise ConfigError(f"{side}_tls_client_ca_file: client certificates need TLS; "
                              f"set {side}_tls_cert_file and {side}_tls_key_file too")
    # Without mTLS a caller has no proven identity, so an allowlist would check nothing.
    if settings.data_callers and settings.data_tls_client_ca_file is None:
        raise ConfigError("data_callers: an allowlist needs mTLS on the data plane; set "
                          "data_tls_client_ca_file (with data_tls_cert_file and "
                          "data_tls_key_file)")
    if settings.admin_clients and settings.admin_tls_client_ca_file is None:
        raise ConfigError("admin_clients: an allowlist needs mTLS on the admin API; set "
                          "admin_tls_client_ca_file (with admin_tls_cert_file and "
                          "admin_tls_key_file)")
    if settings.data_addr.is_unix and settings.workers > 1:
        raise ConfigError(f"data_addr {settings.data_addr}: a Unix socket cannot be shared "
                          "by several workers; use HOST:PORT or --workers 1")
    # The admin token in clear over a network is what this refuses by default.
    if (settings.admin_tls_cert_file is None and not settings.admin_insecure
            and not settings.admin_addr.is_loopback):
        raise ConfigError(
            f"admin_addr {settings.admin_addr}: not a loopback address and the admin API "
            "has no TLS, so its bearer token would cross the network in clear; set "
            "--admin-tls-cert-file and --admin-tls-key-file, bind 127.0.0.1, or pass "
            "--admin-insecure true to accept that")


def warn_weak_secrets(settings: Settings, token: str) -> None:
    if len(token.encode()) < MIN_TOKEN_BYTES:
        _log.warning("admin token is short; use at least 32 random bytes",
                     length=len(token.encode()), minimum=MIN_TOKEN_BYTES)
    if url_has_password(settings.redis_url):
        _log.warning("redis_url carries a password, which shows in process listings and "
                     "config dumps; put it in --redis-password-file instead")


def url_has_password(url: str) -> bool:
    userinfo = url.partition("://")[2].split("/", 1)[0].rpartition("@")[0]
    return bool(userinfo)


def redis_url(settings: Settings) -> str:
    """The Redis URL with the password of redis_password_file (read at start)."""
    path = settings.redis_password_file
    if path is None:
        return settings.redis_url
    try:
        password = path.read_text(encoding="utf-8").strip()
    except OSError as exc:
        raise ConfigError(f"redis_password_file {path}: cannot read: "
                          f"{exc.strerror or exc}") from None
    if not password:
        raise ConfigError(f"redis_password_file {path}: file is empty")
    scheme, sep, rest = settings.redis_url.partition("://")
    if scheme == "unix" or url_has_password(settings.redis_url):
        raise ConfigError("redis_password_file: redis_url is a unix:// URL or already "
                          "carries credentials; give the password one way, in the file")
    return f"{scheme}{sep}:{quote(password, safe='')}@{rest}"

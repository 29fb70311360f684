"""Throwaway X.509 material for the TLS tests, made with the `openssl` command
(a system dependency of `make test`, see the Makefile's TEST_SYSDEPS)."""

from __future__ import annotations

import secrets
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

OPENSSL = shutil.which("openssl") or "openssl"
_KEY = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]


def _openssl(*args: str | Path) -> None:
    subprocess.run([OPENSSL, *map(str, args)], check=True, capture_output=True, timeout=30)


@dataclass(frozen=True)
class Pair:
    cert: Path
    key: Path


@dataclass(frozen=True)
class Ca:
    """A certificate authority in `directory`, able to issue server and client pairs."""

    directory: Path
    name: str

    @property
    def cert(self) -> Path:
        return self.directory / f"{self.name}.pem"

    @property
    def key(self) -> Path:
        return self.directory / f"{self.name}.key"

    def issue(self, name: str, *sans: str) -> Pair:
        """A leaf signed by this CA, CN `name`, with the given subjectAltNames (DNS:..,
        IP:.., URI:..; none at all when there are none)."""
        stem = self.directory / f"{self.name}-{name.replace('/', '_').replace(':', '_')}"
        csr = stem.with_suffix(".csr")
        ext = stem.with_suffix(".ext")
        alt = f"subjectAltName={','.join(sans)}\n" if sans else ""
        ext.write_text(f"{alt}basicConstraints=CA:FALSE\n"
                       "keyUsage=critical,digitalSignature,keyEncipherment\n"
                       "extendedKeyUsage=serverAuth,clientAuth\n")
        pair = Pair(stem.with_suffix(".pem"), stem.with_suffix(".key"))
        _openssl("req", *_KEY, "-keyout", pair.key, "-out", csr, "-subj",
                 "/CN=" + name.replace("/", "\\/"))
        _openssl("x509", "-req", "-in", csr, "-CA", self.cert, "-CAkey", self.key,
                 "-set_serial", str(secrets.randbits(63)), "-days", "2", "-out", pair.cert,
                 "-extfile", ext)
        return pair


def make_ca(directory: Path, name: str = "ca") -> Ca:
    directory.mkdir(parents=True, exist_ok=True)
    ca = Ca(directory, name)
    _openssl("req", "-x509", *_KEY, "-keyout", ca.key, "-out", ca.cert, "-days", "2",
             "-subj", f"/CN={name}", "-addext", "basicConstraints=critical,CA:TRUE",
             "-addext", "keyUsage=critical,keyCertSign,cRLSign")
    return ca


def install(pair: Pair, cert: Path, key: Path) -> None:
    """Put `pair` at cert/key the way a rotating Secret does: whole files, renamed in."""
    for source, target in ((pair.cert, cert), (pair.key, key)):
        tmp = target.with_name(f".{target.name}.new")
        shutil.copyfile(source, tmp)
        tmp.replace(target)


def subject(cert: Path) -> str:
    done = subprocess.run([OPENSSL, "x509", "-noout", "-subject", "-in", str(cert)],
                          check=True, capture_output=True, text=True, timeout=30)
    return done.stdout.strip()

"""One version everywhere it is written, and a LICENSE that is Apache-2.0 and ships in the wheel."""

from __future__ import annotations

import hashlib
import re
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path
from typing import Any

import yaml

import sitsmesh

ROOT = Path(__file__).resolve().parents[2]
# sha256 of https://www.apache.org/licenses/LICENSE-2.0.txt, appendix included.
APACHE_2_SHA256 = "cfc7749b96f63bd31c3c42b5c471bf756814053e847c10f3eb003417bc523d30"
RELEASE = re.compile(r"^## \[(?P<version>[^\]]+)\](?: - (?P<date>\d{4}-\d{2}-\d{2}))?$")
SECTIONS = {"Added", "Changed", "Deprecated", "Removed", "Fixed", "Security"}
# `sitsmesh:0.2.0` as an image reference in comments and docs (not host:port).
IMAGE_TAG = re.compile(r"(?<![\w.-])sitsmesh:(\d+\.\d+\.\d+\S*?)(?=[\s\"'`]|$)", re.MULTILINE)
BUILD_ARG = re.compile(r"--build-arg VERSION=([^\s\"'`]+)")
WHEEL = re.compile(r"\bsitsmesh-(\d+\.\d+\.\d+[^-\s]*)-py3-none-any\.whl")


def _pyproject_version(root: Path) -> str:
    with (root / "pyproject.toml").open("rb") as f:
        return str(tomllib.load(f)["project"]["version"])


def _dockerfile_default(root: Path) -> str:
    found = re.findall(r"^ARG VERSION=(\S+)$", (root / "Dockerfile").read_text(), re.MULTILINE)
    assert len(found) == 1, f"expected one 'ARG VERSION=default' in the Dockerfile, got {found}"
    return str(found[0]).strip("\"'")


def _images(node: Any) -> list[str]:
    """Image references: containers' `image:`, and kustomize's `images:` name + newTag."""
    if isinstance(node, dict):
        here = [v for k, v in node.items() if k == "image" and isinstance(v, str)]
        if isinstance(node.get("name"), str) and "newTag" in node:
            here.append(f"{node['name']}:{node['newTag']}")
        return here + [i for v in node.values() for i in _images(v)]
    if isinstance(node, list):
        return [i for v in node for i in _images(v)]
    return []


def _manifest_tags(root: Path) -> dict[str, list[str]]:
    """Tags of every sitsmesh image named in deploy/'s YAML, by file."""
    out: dict[str, list[str]] = {}
    for path in sorted((root / "deploy").rglob("*.y*ml")):
        for doc in yaml.safe_load_all(path.read_text()):
            for image in _images(doc):
                name, _, tag = image.partition("@")[0].rpartition(":")
                if name.rsplit("/", 1)[-1] == "sitsmesh":
                    out.setdefault(str(path.relative_to(root)), []).append(tag)
    return out


def _changelog_releases(root: Path) -> list[tuple[str, str | None]]:
    releases = []
    for line in (root / "CHANGELOG.md").read_text().splitlines():
        if m := RELEASE.match(line):
            releases.append((m["version"], m["date"]))
    return releases


def _disagreements(root: Path) -> list[str]:
    """Every place whose version is not pyproject's, as 'where: version'."""
    want = _pyproject_version(root)
    places: list[tuple[str, str]] = [("Dockerfile ARG VERSION", _dockerfile_default(root))]
    for where, tags in _manifest_tags(root).items():
        places += [(where, tag) for tag in tags]
    released = [v for v, _ in _changelog_releases(root) if v != "Unreleased"]
    places.append(("CHANGELOG.md latest release", released[0] if released else "none"))
    for name in ("Dockerfile", "README.md"):
        text = (root / name).read_text()
        found = IMAGE_TAG.findall(text) + BUILD_ARG.findall(text) + WHEEL.findall(text)
        places += [(name, tag) for tag in found]
    return [f"{where}: {got}" for where, got in places if got != want]


def test_every_written_version_is_pyprojects() -> None:
    assert _disagreements(ROOT) == [], f"pyproject says {_pyproject_version(ROOT)}"


def test_manifests_name_the_sitsmesh_image() -> None:
    # The agreement test above passes vacuously if the manifests stop naming the image.
    assert _manifest_tags(ROOT), "no 'image: sitsmesh:X' in deploy/"


def test_installed_version_is_pyprojects() -> None:
    # __version__ comes from the installed metadata: a stale install (pyproject bumped, the
    # package not reinstalled) or a source tree never installed shows here.
    assert sitsmesh.__version__ == _pyproject_version(ROOT), (
        "reinstall the package: its metadata is not this tree's pyproject")


def test_a_version_left_behind_is_named(tmp_path: Path) -> None:
    for name in ("pyproject.toml", "Dockerfile", "CHANGELOG.md", "README.md"):
        shutil.copy(ROOT / name, tmp_path / name)
    shutil.copytree(ROOT / "deploy", tmp_path / "deploy")
    old = _pyproject_version(ROOT)
    pyproject = tmp_path / "pyproject.toml"
    pyproject.write_text(pyproject.read_text().replace(
        f'version = "{old}"', 'version = "9.8.7"', 1))
    found = _disagreements(tmp_path)
    assert f"Dockerfile ARG VERSION: {old}" in found
    assert f"CHANGELOG.md latest release: {old}" in found
    assert f"deploy/kubernetes/deployment.yaml: {old}" in found
    assert f"deploy/kubernetes/kustomization.yaml: {old}" in found
    assert f"README.md: {old}" in found
    assert f"Dockerfile: {old}" in found


def test_changelog_keeps_a_changelog() -> None:
    releases = _changelog_releases(ROOT)
    assert releases[0] == ("Unreleased", None), releases
    dates: list[str] = []
    for version, date in releases[1:]:
        assert re.fullmatch(r"\d+\.\d+\.\d+", version), version
        assert date is not None, f"{version} has no date"
        dates.append(date)
    assert dates == sorted(dates, reverse=True), "releases go newest first"
    sections = re.findall(r"^### (.+)$", (ROOT / "CHANGELOG.md").read_text(), re.MULTILINE)
    assert set(sections) <= SECTIONS, set(sections) - SECTIONS


def test_license_is_the_apache_2_text() -> None:
    with (ROOT / "pyproject.toml").open("rb") as f:
        project = tomllib.load(f)["project"]
    assert project["license"] == "Apache-2.0"
    assert project["license-files"] == ["LICENSE"]
    digest = hashlib.sha256((ROOT / "LICENSE").read_bytes()).hexdigest()
    assert digest == APACHE_2_SHA256, "LICENSE is not the unmodified Apache License 2.0 text"


def test_wheel_ships_the_license(tmp_path: Path) -> None:
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(ROOT / name, tmp_path / name)
    shutil.copytree(ROOT / "sitsmesh", tmp_path / "sitsmesh",
                    ignore=shutil.ignore_patterns("__pycache__"))
    build = ("import sys; from setuptools import build_meta; "
             "print(build_meta.build_wheel(sys.argv[1]))")
    done = subprocess.run([sys.executable, "-c", build, str(tmp_path / "dist")],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    wheel = tmp_path / "dist" / done.stdout.strip().splitlines()[-1]
    version = _pyproject_version(ROOT)
    info = f"sitsmesh-{version}.dist-info"
    with zipfile.ZipFile(wheel) as z:
        assert z.read(f"{info}/licenses/LICENSE") == (ROOT / "LICENSE").read_bytes()
        # The admin API's contract, at its import path, for clients in other languages.
        for proto in sorted((ROOT / "protos").rglob("*.proto")):
            shipped = proto.relative_to(ROOT / "protos").as_posix()
            assert z.read(shipped) == proto.read_bytes(), shipped
        metadata = z.read(f"{info}/METADATA").decode().splitlines()
    assert f"Version: {version}" in metadata
    assert "License-Expression: Apache-2.0" in metadata
    assert "License-File: LICENSE" in metadata

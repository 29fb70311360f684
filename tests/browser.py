"""Headless Chromium for tests: a page's DOM after it ran, and a screenshot of it.

The DOM comes back as Chromium serialised it, so what a script changed (or an unescaped
string turned into markup) shows there; `Dom` reads it back into text by element.
"""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass, field
from html.parser import HTMLParser
from pathlib import Path

TIMEOUT_S = 30
# Elements without an end tag: they never hold text.
VOID = frozenset({"area", "base", "br", "col", "embed", "hr", "img", "input", "link", "meta",
                  "source", "track", "wbr"})


def chromium() -> str:
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    assert found, "headless Chromium is needed (Debian package chromium)"
    return found


def _run(tmp: Path, name: str, *args: str) -> subprocess.CompletedProcess[str]:
    # A profile per run: concurrent Chromiums must not share one.
    return subprocess.run(
        [chromium(), "--headless=new", "--no-sandbox", "--disable-gpu", "--no-first-run",
         "--disable-extensions", f"--user-data-dir={tmp / f'chromium-{name}'}",
         "--window-size=1200,1600", *args],
        capture_output=True, text=True, timeout=TIMEOUT_S, check=True)


def dump_dom(page: Path, tmp: Path) -> str:
    return _run(tmp, "dom", "--dump-dom", page.resolve().as_uri()).stdout


def screenshot(page: Path, tmp: Path) -> Path:
    png = tmp / f"{page.stem}.png"
    _run(tmp, "png", f"--screenshot={png}", page.resolve().as_uri())
    return png


@dataclass
class Dom(HTMLParser):
    """Text by id and by class, and every tag seen, from a serialised DOM."""

    tags: list[str] = field(default_factory=list)
    by_id: dict[str, str] = field(default_factory=dict)
    by_class: dict[str, list[str]] = field(default_factory=dict)
    title: str = ""
    _open: list[tuple[str, str, str]] = field(default_factory=list)

    def __post_init__(self) -> None:
        super().__init__(convert_charrefs=True)

    @classmethod
    def parse(cls, text: str) -> Dom:
        dom = cls()
        dom.feed(text)
        dom.close()
        return dom

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags.append(tag)
        values = dict(attrs)
        if tag not in VOID:
            self._open.append((tag, values.get("id") or "", values.get("class") or ""))
        for key, cls_attr in (("id", values.get("id")), ("class", values.get("class"))):
            if key == "id" and cls_attr:
                self.by_id.setdefault(cls_attr, "")
            elif key == "class" and cls_attr:
                for name in cls_attr.split():
                    self.by_class.setdefault(name, []).append("")

    def handle_endtag(self, tag: str) -> None:
        while self._open:
            if self._open.pop()[0] == tag:
                break

    def handle_data(self, data: str) -> None:
        if [tag for tag, _, _ in self._open[-2:]] == ["head", "title"]:
            self.title += data  # the document's; SVG elements have <title>s too
        for _tag, ident, _classes in self._open:
            if ident:
                self.by_id[ident] += data
        if self._open:
            _, _, classes = self._open[-1]
            for name in classes.split():
                self.by_class[name][-1] += data

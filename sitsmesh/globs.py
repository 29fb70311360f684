"""Model-name globs matched all at once, at a cost that does not grow with their number.

`fnmatch.fnmatchcase` over a list costs one regex per glob, and past the 32 768
patterns `fnmatch` keeps compiled, one compilation per glob per call: a pipeline
of 40 000 globs made every Check for an unseen model take 1.5 s. Here the globs
are sorted by shape once, when the pipelines or tenants change:

- no `*`, `?` or `[`: an exact name, one dict lookup;
- a literal followed by `*`s: a prefix, one dict lookup per distinct prefix length
  (at most one per character of the name, which is at most 256 long);
- `*`s followed by a literal: a suffix, likewise;
- anything else (`?`, `[...]`, a `*` between literals): general, at most
  MAX_GENERAL_GLOBS per list, all of them in one compiled regex.

The answer is exactly fnmatchcase's (the equivalence is tested against it), and
with numbered groups of globs, the first group holding a matching glob.
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Iterable, Sequence

MAX_GLOBS = 50_000          # per pipeline or tenant: room for generated lists of names
MAX_GENERAL_GLOBS = 256     # of those, globs with '?', '[...]' or a '*' between literals
MAX_GLOB_LENGTH = 1024      # model names are at most 256 characters (authz.extract)
NONE = -1
_SPECIAL = re.compile(r"[*?\[]")


class GlobError(ValueError):
    """A list of globs past a bound; the message says which and how to fix it."""


def shape(glob: str) -> str:
    """'exact', 'prefix', 'suffix' or 'general'."""
    if not _SPECIAL.search(glob):
        return "exact"
    head = glob.rstrip("*")
    if not _SPECIAL.search(head):
        return "prefix"
    tail = glob.lstrip("*")
    if not _SPECIAL.search(tail):
        return "suffix"
    return "general"


def check(globs: Sequence[str], what: str) -> None:
    """Raise GlobError when `globs` (one pipeline's or tenant's) pass a bound."""
    if len(globs) > MAX_GLOBS:
        raise GlobError(f"{what}: {len(globs)} model globs; at most {MAX_GLOBS}")
    general = 0
    for glob in globs:
        if len(glob) > MAX_GLOB_LENGTH:
            raise GlobError(f"{what}: model glob {glob[:40]!r}... is {len(glob)} characters "
                            f"long; at most {MAX_GLOB_LENGTH}")
        if shape(glob) == "general":
            general += 1
    if general > MAX_GENERAL_GLOBS:
        raise GlobError(
            f"{what}: {general} model globs use '?', '[...]' or a '*' between literals; at "
            f"most {MAX_GENERAL_GLOBS} (exact names, 'prefix*' and '*suffix' globs count "
            f"only toward the {MAX_GLOBS})")


class Globs:
    """Numbered groups of globs. `first(name)` is the lowest group index holding a glob
    that matches `name` as fnmatch.fnmatchcase does, or NONE."""

    __slots__ = ("_exact", "_general", "_general_groups", "_general_low", "_prefix_lengths",
                 "_prefixes", "_suffix_lengths", "_suffixes")

    def __init__(self, groups: Iterable[Iterable[str]]) -> None:
        exact: dict[str, int] = {}
        prefixes: dict[str, int] = {}
        suffixes: dict[str, int] = {}
        alternatives: list[str] = []
        general_groups: list[int] = []
        for index, globs in enumerate(groups):
            general: list[str] = []
            for glob in globs:
                kind = shape(glob)
                # setdefault: an earlier group keeps a glob two groups share.
                if kind == "exact":
                    exact.setdefault(glob, index)
                elif kind == "prefix":
                    prefixes.setdefault(glob.rstrip("*"), index)
                elif kind == "suffix":
                    suffixes.setdefault(glob.lstrip("*"), index)
                else:
                    general.append(fnmatch.translate(glob))
            if general:
                # One capturing group per group of globs, in order. Every alternative ends
                # in \Z, and the regex tries them left to right, so the capturing group it
                # matched in is the first group with a glob that matches the whole name.
                alternatives.append(f"({'|'.join(general)})")
                general_groups.append(index)
        self._exact = exact
        self._prefixes = prefixes
        self._suffixes = suffixes
        self._prefix_lengths = tuple(sorted({len(p) for p in prefixes}))
        self._suffix_lengths = tuple(sorted({len(s) for s in suffixes}))
        self._general = re.compile("|".join(alternatives)) if alternatives else None
        self._general_groups = tuple(general_groups)
        self._general_low = general_groups[0] if general_groups else NONE

    def __bool__(self) -> bool:
        return bool(self._exact or self._prefixes or self._suffixes or self._general_groups)

    def first(self, name: str) -> int:
        best = self._exact.get(name, NONE)
        if best == 0:
            return 0
        size = len(name)
        prefixes = self._prefixes
        if prefixes:
            for n in self._prefix_lengths:
                if n > size:
                    break
                found = prefixes.get(name[:n], NONE)
                if found != NONE and (best == NONE or found < best):
                    if found == 0:
                        return 0
                    best = found
        suffixes = self._suffixes
        if suffixes:
            for n in self._suffix_lengths:
                if n > size:
                    break
                found = suffixes.get(name[size - n:], NONE)
                if found != NONE and (best == NONE or found < best):
                    if found == 0:
                        return 0
                    best = found
        general = self._general
        if general is not None and (best == NONE or self._general_low < best):
            match = general.match(name)
            if match is not None and match.lastindex is not None:
                found = self._general_groups[match.lastindex - 1]
                if best == NONE or found < best:
                    best = found
        return best

    def matches(self, name: str) -> bool:
        """Whether any glob matches `name` (the group does not matter)."""
        return self.first(name) != NONE

"""Model-name globs matched all at once, at a cost that does not grow with their number.

`fnmatch.fnmatchcase` over a list costs one regex per glob, and past the 32 768
patterns `fnmatch` keeps compiled, one compilation per glob per call: a pipeline
of 40 000 globs made every Check for an unseen model take 1.5 s. Here the globs
are sorted by shape once, when the pipelines or tenants change:

- no `*`, `?` or `[`: an exact name, one dict lookup;
- a literal followed by `*`s: a prefix, one dict lookup per distinct prefix length
  (at most one per character of the name, which is at most 256 long);
- `*`s followed by a literal: a suffix, likewise;
- anything else (`?`, `[...]`, a `*` between literals): general, kept by its
  literal start (the text before its first wildcard), which is looked up like a
  prefix; only the globs under a start the name begins with are tried, at most
  MAX_GENERAL_GLOBS for any one name (`check` refuses more).

The answer is exactly fnmatchcase's (the equivalence is tested against it), and
with numbered groups of globs, the first group holding a matching glob.
"""

from __future__ import annotations

import fnmatch
import re
from collections import Counter
from collections.abc import Iterable, Sequence

MAX_GLOBS = 50_000          # per pipeline or tenant: room for generated lists of names
MAX_GENERAL_GLOBS = 64      # general globs that one model name may be tried against
MAX_GLOB_LENGTH = 1024      # model names are at most 256 characters (authz.extract)
NONE = -1
_SPECIAL = re.compile(r"[*?\[]")


class GlobError(ValueError):
    """A list of globs past a bound; the message says which and how to fix it."""


def shape(glob: str) -> str:
    """'exact', 'prefix', 'suffix' or 'general'."""
    if not _SPECIAL.search(glob):
        return "exact"
    if not _SPECIAL.search(glob.rstrip("*")):
        return "prefix"
    if not _SPECIAL.search(glob.lstrip("*")):
        return "suffix"
    return "general"


def literal_start(glob: str) -> str:
    """The text before the first wildcard: every name the glob matches begins with it."""
    found = _SPECIAL.search(glob)
    return glob[:found.start()] if found else glob


def _widest(starts: Iterable[str]) -> tuple[int, str]:
    """The most general globs one name can be tried against, and the start that gets
    there: a name is tried against every glob whose literal start it begins with, and
    those starts are each other's prefixes. In sorted order a start's own prefixes come
    before it, so a stack holds the chain of the current one."""
    counts = Counter(starts)
    chain: list[tuple[str, int]] = []
    widest, at = 0, ""
    for start in sorted(counts):
        while chain and not start.startswith(chain[-1][0]):
            chain.pop()
        total = (chain[-1][1] if chain else 0) + counts[start]
        chain.append((start, total))
        if total > widest:
            widest, at = total, start
    return widest, at


def check(globs: Sequence[str], what: str) -> None:
    """Raise GlobError when `globs` (one pipeline's or tenant's) pass a bound."""
    if len(globs) > MAX_GLOBS:
        raise GlobError(f"{what}: {len(globs)} model globs; at most {MAX_GLOBS}")
    for glob in globs:
        if len(glob) > MAX_GLOB_LENGTH:
            raise GlobError(f"{what}: model glob {glob[:40]!r}... is {len(glob)} characters "
                            f"long; at most {MAX_GLOB_LENGTH}")
    widest, at = _widest(literal_start(g) for g in globs if shape(g) == "general")
    if widest > MAX_GENERAL_GLOBS:
        raise GlobError(
            f"{what}: {widest} model globs with '?', '[...]' or a '*' between literals "
            f"would all be tried for a model named {at!r}...: their text before the first "
            f"wildcard is {at!r} or a start of it; at most {MAX_GENERAL_GLOBS} may share "
            f"one (exact names, 'prefix*' and '*suffix' are not counted)")


# A general glob under its literal start: (group, the literal a '*'-only rest ends with,
# or None, the rest for a regex).
_Entry = tuple[int, str | None, str]


class Globs:
    """Numbered groups of globs. `first(name)` is the lowest group index holding a glob
    that matches `name` as fnmatch.fnmatchcase does, or NONE."""

    __slots__ = ("_exact", "_general", "_general_lengths", "_prefix_lengths", "_prefixes",
                 "_regexes", "_suffix_lengths", "_suffixes")

    def __init__(self, groups: Iterable[Iterable[str]]) -> None:
        exact: dict[str, list[int]] = {}
        prefixes: dict[str, list[int]] = {}
        suffixes: dict[str, list[int]] = {}
        general: dict[str, list[_Entry]] = {}
        for index, globs in enumerate(groups):
            for glob in globs:
                kind = shape(glob)
                if kind == "general":
                    start = literal_start(glob)
                    rest = glob[len(start):]
                    tail = rest.lstrip("*")
                    ends = tail if not _SPECIAL.search(tail) else None
                    # Groups in order within a start: the first that matches is the lowest.
                    general.setdefault(start, []).append((index, ends, rest))
                    continue
                table, key = ((exact, glob) if kind == "exact" else
                              (prefixes, glob.rstrip("*")) if kind == "prefix" else
                              (suffixes, glob.lstrip("*")))
                # Each key's groups, lowest first (groups come in order).
                held = table.setdefault(key, [])
                if not held or held[-1] != index:
                    held.append(index)
        self._exact = {k: tuple(v) for k, v in exact.items()}
        self._prefixes = {k: tuple(v) for k, v in prefixes.items()}
        self._suffixes = {k: tuple(v) for k, v in suffixes.items()}
        self._general = {start: tuple(entries) for start, entries in general.items()}
        self._prefix_lengths = tuple(sorted({len(p) for p in prefixes}))
        self._suffix_lengths = tuple(sorted({len(s) for s in suffixes}))
        self._general_lengths = tuple(sorted({len(s) for s in general}))
        # The rest of a general glob, compiled the first time a name reaches it: compiling
        # them all up front would cost 90 us each when the globs change.
        self._regexes: dict[str, re.Pattern[str]] = {}

    def __bool__(self) -> bool:
        return bool(self._exact or self._prefixes or self._suffixes or self._general)

    def first(self, name: str) -> int:
        found = self._exact.get(name)
        best = found[0] if found is not None else NONE
        if best == 0:
            return 0
        size = len(name)
        prefixes = self._prefixes
        if prefixes:
            for n in self._prefix_lengths:
                if n > size:
                    break
                found = prefixes.get(name[:n])
                if found is not None and (best == NONE or found[0] < best):
                    best = found[0]
                    if best == 0:
                        return 0
        suffixes = self._suffixes
        if suffixes:
            for n in self._suffix_lengths:
                if n > size:
                    break
                found = suffixes.get(name[size - n:])
                if found is not None and (best == NONE or found[0] < best):
                    best = found[0]
                    if best == 0:
                        return 0
        general = self._general
        if general:
            for n in self._general_lengths:
                if n > size:
                    break
                entries = general.get(name[:n])
                if entries is None:
                    continue
                for group, ends, rest in entries:
                    if best != NONE and group >= best:
                        break
                    if self._rest_matches(ends, rest, name, n):
                        best = group
                        break
        return best

    def groups(self, name: str) -> list[int]:
        """Every group with a glob that matches `name`, lowest first: for a caller that
        skips some groups (the first pipeline that governs a tenant, say)."""
        size = len(name)
        found: set[int] = set(self._exact.get(name, ()))
        for table, lengths, suffix in ((self._prefixes, self._prefix_lengths, False),
                                       (self._suffixes, self._suffix_lengths, True)):
            for n in lengths:
                if n > size:
                    break
                found.update(table.get(name[size - n:] if suffix else name[:n], ()))
        for n in self._general_lengths:
            if n > size:
                break
            for group, ends, rest in self._general.get(name[:n], ()):
                if group not in found and self._rest_matches(ends, rest, name, n):
                    found.add(group)
        return sorted(found)

    def _rest_matches(self, ends: str | None, rest: str, name: str, at: int) -> bool:
        """Whether name[at:] matches a general glob's rest (what follows its start)."""
        if ends is not None:
            # '*' then a literal: what follows the start ends with it.
            return len(name) - at >= len(ends) and name.endswith(ends)
        regex = self._regexes.get(rest)
        if regex is None:
            regex = self._regexes[rest] = re.compile(fnmatch.translate(rest))
        return regex.match(name, at) is not None

    def matches(self, name: str) -> bool:
        """Whether any glob matches `name` (the group does not matter)."""
        return self.first(name) != NONE

"""Reading a rate-limit config's YAML, bounded: a few bytes must not cost seconds or
hundreds of MB (a "billion laughs" of aliases), nor overflow the composer's recursion.
Errors follow the reference's "error loading config file: " wording."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import yaml

from sitsmesh.errors import ConfigError

# Aliases may add this many YAML nodes in all; collections may nest this deep (a
# descriptor takes two levels, so 32 levels of descriptors).
MAX_ALIAS_NODES = 10_000
MAX_DEPTH = 64

# YAML as the reference's Go decoder reads it: a date-like scalar stays text (PyYAML would
# make it a date, which neither a descriptor nor dynamic metadata can hold). libyaml's
# parser where PyYAML has it: about ten times the pure-Python speed on a large config.
_YamlLoader: type[yaml.SafeLoader] = type(
    "_YamlLoader", (getattr(yaml, "CSafeLoader", yaml.SafeLoader),), {})
_YamlLoader.yaml_implicit_resolvers = {
    first: [(tag, regexp) for tag, regexp in resolvers if tag != "tag:yaml.org,2002:timestamp"]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()}


def _line(event: yaml.Event) -> int:
    return event.start_mark.line + 1 if event.start_mark else 0


def _bound(source: str, text: str) -> None:
    """Refuse, from the event stream and before any object is built, the YAML that makes a
    few bytes cost much: nesting past MAX_DEPTH (the composer recurses), an alias inside
    its own anchor (a cycle), and aliases that add more than MAX_ALIAS_NODES nodes. The
    reference's YAML decoder refuses "excessive aliasing" too; an anchor shared by a few
    rate_limit blocks stays well inside the bound."""
    sizes: dict[str, int] = {}           # anchor -> nodes it stands for, once closed
    opened: list[tuple[str | None, int]] = []  # (anchor, node count at its start)
    count = added = 0
    try:
        for event in yaml.parse(text, Loader=_YamlLoader):
            if isinstance(event, yaml.AliasEvent):
                anchor = event.anchor or ""
                if any(a == anchor for a, _ in opened) and anchor not in sizes:
                    raise _fail(source, f"error loading config file: yaml: alias "
                                        f"'*{anchor}' inside its own anchor "
                                        f"(line {_line(event)})")
                size = sizes.get(anchor, 0)  # undefined: the composer says so
                count += size
                added += size
                if added > MAX_ALIAS_NODES:
                    raise _fail(
                        source,
                        f"error loading config file: yaml: document contains excessive "
                        f"aliasing: aliases expand to more than {MAX_ALIAS_NODES} nodes "
                        f"(line {_line(event)})")
            elif isinstance(event, yaml.ScalarEvent):
                count += 1
                if event.anchor:
                    sizes[event.anchor] = 1
            elif isinstance(event, yaml.CollectionStartEvent):
                count += 1
                if event.anchor:
                    sizes.pop(event.anchor, None)  # an alias inside means this one, open
                opened.append((event.anchor, count))
                if len(opened) > MAX_DEPTH:
                    raise _fail(source, f"error loading config file: yaml: nested deeper "
                                        f"than {MAX_DEPTH} levels (line {_line(event)})")
            elif isinstance(event, yaml.CollectionEndEvent):
                closed, start = opened.pop()
                if closed:
                    sizes[closed] = count - start + 1
    except yaml.YAMLError:
        return  # the load that follows reports it, in the usual words


def _fail(source: str, message: str) -> ConfigError:
    return ConfigError(f"{source}: {message}")


@contextmanager
def _collector_paused() -> Iterator[None]:
    """The cyclic collector off while a config's objects are built: they are hundreds of
    thousands of young containers, and the collections they trigger made a 4.9 MB config
    (60 000 descriptors) load in 10.5 s instead of 2. Nothing built here is cyclic, and
    what is left over is collected when the collector runs again."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def load(source: str, text: str) -> Any:
    """The YAML document in `text`; ConfigError naming `source` when it is not one, or
    passes a bound."""
    _bound(source, text)
    try:
        with _collector_paused():
            return yaml.load(text, Loader=_YamlLoader)  # noqa: S506 - a SafeLoader
    except yaml.YAMLError as exc:
        detail = str(exc).replace("\n", " ")
        raise _fail(source, f"error loading config file: {detail}") from None

"""Reading declarative documents: bounded multi-document YAML (or JSON) in, validated
documents out, every error naming the document it is in."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import yaml
from pydantic import ValidationError

from sitsmesh.declarative.models import API_VERSION, KINDS, Document
from sitsmesh.errors import InvalidArgumentError

# An apply is reviewed by a person: a few hundred objects at most. The bounds keep one
# request from holding the admin server (and the state store's transaction) for long.
MAX_BYTES = 1 << 20
MAX_DOCUMENTS = 500
# libyaml's parser where PyYAML was built with it: about ten times the pure-Python speed.
_LOADER: type[yaml.SafeLoader] = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
MAX_DEPTH = 64  # a rate-limit config nests descriptors a few levels; YAML's composer recurses


def _line(event: yaml.Event) -> int:
    return event.start_mark.line + 1 if event.start_mark else 0


_MAP_TAG, _SEQ_TAG = "tag:yaml.org,2002:map", "tag:yaml.org,2002:seq"


def _documents(text: str, source: str) -> list[Any]:
    """Every document of `text`, built from the event stream in one pass: anchors,
    aliases and nesting past MAX_DEPTH refused as they come, scalars typed as a safe
    loader types them. Pure Python on libyaml's events, so a thread running it gives the
    GIL back every few milliseconds; libyaml's own composer would hold it for the whole
    document (160 ms for 1 MiB), stalling the event loop that serves Check."""
    resolver, constructor = yaml.resolver.Resolver(), yaml.constructor.SafeConstructor()
    docs: list[Any] = []
    # Open collections, innermost last: [the collection, the pending key of a mapping].
    stack: list[list[Any]] = []
    root: Any = None
    marker = object()

    def add(value: Any, event: yaml.Event) -> None:
        nonlocal root
        if not stack:
            root = value
            return
        top = stack[-1]
        if isinstance(top[0], list):
            top[0].append(value)
        elif top[1] is marker:
            try:
                hash(value)
            except TypeError:
                raise InvalidArgumentError(f"{source}: line {_line(event)}: a mapping key "
                                           "must be a scalar") from None
            top[1] = value
        else:
            top[0][top[1]] = value
            top[1] = marker

    try:
        for event in yaml.parse(text, Loader=_LOADER):
            if isinstance(event, yaml.AliasEvent) or getattr(event, "anchor", None):
                raise InvalidArgumentError(
                    f"{source}: line {_line(event)}: YAML anchors and aliases are not "
                    "accepted in sitsmesh config")
            if isinstance(event, yaml.ScalarEvent):
                tag = event.tag
                if tag is None or tag == "!":
                    tag = resolver.resolve(  # type: ignore[no-untyped-call]
                        yaml.ScalarNode, event.value, event.implicit)
                node = yaml.ScalarNode(tag, event.value, style=event.style)
                add(constructor.construct_object(node), event)
                constructor.constructed_objects.clear()
            elif isinstance(event, yaml.CollectionStartEvent):
                mapping = isinstance(event, yaml.MappingStartEvent)
                if event.tag not in (None, "!", _MAP_TAG if mapping else _SEQ_TAG):
                    raise InvalidArgumentError(f"{source}: line {_line(event)}: YAML tag "
                                               f"{event.tag!r} is not accepted here")
                if len(stack) >= MAX_DEPTH:
                    raise InvalidArgumentError(
                        f"{source}: line {_line(event)}: nested deeper than {MAX_DEPTH} "
                        "levels")
                collection: Any = {} if mapping else []
                add(collection, event)
                stack.append([collection, marker])
            elif isinstance(event, yaml.CollectionEndEvent):
                stack.pop()
            elif isinstance(event, yaml.DocumentStartEvent):
                root = None
            elif isinstance(event, yaml.DocumentEndEvent):
                docs.append(root)
    except yaml.YAMLError as exc:
        raise InvalidArgumentError(
            f"{source}: invalid YAML: {str(exc).splitlines()[0]}") from None
    return docs


# An error lists at most this many documents, each line cut to MAX_LINE characters: the
# message travels in gRPC's status trailer, and past 16 KiB the client sees
# RESOURCE_EXHAUSTED instead of INVALID_ARGUMENT.
MAX_LISTED = 20
MAX_LINE = 500


def _listed(errors: Sequence[str]) -> str:
    lines = [e if len(e) <= MAX_LINE else f"{e[:MAX_LINE]}... ({len(e)} characters)"
             for e in errors[:MAX_LISTED]]
    if len(errors) > MAX_LISTED:
        lines.append(f"and {len(errors) - MAX_LISTED} more documents with errors")
    return "\n".join(lines)


def _too_big(size: int, source: str) -> None:
    if size > MAX_BYTES:
        raise InvalidArgumentError(f"{source}: {size} bytes is more than the {MAX_BYTES} an "
                                   "apply accepts; split it into several applies")


def load(text: str, source: str = "request", room: int = MAX_DOCUMENTS) -> list[Any]:
    """The non-empty documents of `text`; InvalidArgumentError past the bounds (`room`:
    how many documents the apply may still take)."""
    _too_big(len(text.encode("utf-8")), source)
    docs: list[Any] = []
    for doc in _documents(text, source):
        # A JSON array of documents (what `get -o json` prints for several) is read as
        # its items.
        docs.extend(d for d in (doc if isinstance(doc, list) else [doc]) if d is not None)
        if len(docs) > room:
            raise InvalidArgumentError(
                f"{source}: more than {MAX_DOCUMENTS} documents in one apply; split it")
    return docs


def load_one(text: str, source: str, max_bytes: int = MAX_BYTES) -> Any:
    """The one document of an admin request's YAML field (None when empty), with the
    bounds of an apply: size first, then anchors, aliases and nesting, as it is built.
    InvalidArgumentError names `source`."""
    size = len(text.encode("utf-8"))
    if size > max_bytes:
        raise InvalidArgumentError(f"{source}: {size} bytes is more than the {max_bytes} "
                                   "one document may have")
    docs = _documents(text, source)
    if len(docs) > 1:
        raise InvalidArgumentError(f"{source}: one YAML document expected, got {len(docs)}")
    return docs[0] if docs else None


def load_files(files: Sequence[tuple[str, str]], objects: Sequence[Any] = ()
               ) -> tuple[list[Any], list[str]]:
    """The documents of every (name, text) file and the structured `objects`, with where
    each came from ("tenants.yaml: document 2"); the bounds hold for them all together."""
    _too_big(sum(len(text.encode("utf-8")) for _, text in files), "the files together")
    raws: list[Any] = []
    where: list[str] = []
    for name, text in files:
        found = load(text, name, MAX_DOCUMENTS - len(raws) - len(objects))
        raws += found
        where += [f"{name}: document {i}" for i in range(len(found))]
    if len(raws) + len(objects) > MAX_DOCUMENTS:
        raise InvalidArgumentError(f"more than {MAX_DOCUMENTS} documents in one apply; "
                                   "split it")
    raws += [integral(o) for o in objects]
    where += [f"objects[{i}]" for i in range(len(objects))]
    return raws, where


def integral(value: Any) -> Any:
    """A google.protobuf.Struct's numbers are all doubles: whole ones back to ints, as the
    same document read from YAML holds them (the domain validators want integers)."""
    if isinstance(value, dict):
        return {k: integral(v) for k, v in value.items()}
    if isinstance(value, list):
        return [integral(v) for v in value]
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


def _label(where: str, raw: Any) -> str:
    kind = raw.get("kind") if isinstance(raw, dict) else None
    meta = raw.get("metadata") if isinstance(raw, dict) else None
    name = meta.get("name") if isinstance(meta, dict) else None
    return f"{where} ({kind or '?'}/{name or '?'})"


def _one(raw: Any) -> Document:
    if not isinstance(raw, dict):
        raise ValueError("a document must be a mapping with apiVersion, kind, metadata, spec")
    if raw.get("apiVersion") != API_VERSION:
        raise ValueError(f"apiVersion must be {API_VERSION}, got {raw.get('apiVersion')!r}")
    model = KINDS.get(raw.get("kind"))  # type: ignore[arg-type]
    if model is None:
        raise ValueError(f"kind must be one of {', '.join(KINDS)}, got {raw.get('kind')!r}")
    return model.model_validate(raw)


def explain(exc: ValidationError) -> str:
    """pydantic's errors as one line each: the domain's own message as it is, the model's
    with the path to the field."""
    lines = []
    for error in exc.errors():
        where = ".".join(str(part) for part in error["loc"])
        lines.append(f"{where}: {error['msg']}" if where else error["msg"])
    return "; ".join(lines)


def validate(raws: Sequence[Any], where: Sequence[str] = ()) -> list[Document]:
    """Every document validated; all errors reported at once, each naming its document
    (`where[i]`, else "document i")."""
    docs: list[Document] = []
    errors: list[str] = []
    seen: dict[tuple[str, str], str] = {}
    for index, raw in enumerate(raws):
        label = _label(where[index] if where else f"document {index}", raw)
        try:
            doc = _one(raw)
        except ValidationError as exc:
            errors.append(f"{label}: {explain(exc)}")
            continue
        except ValueError as exc:
            errors.append(f"{label}: {exc}")
            continue
        key = (doc.KIND, doc.metadata.name)
        if key in seen:
            errors.append(f"{label}: also defined by {seen[key]}")
        seen.setdefault(key, label.rsplit(" (", 1)[0])
        docs.append(doc)
    if errors:
        raise InvalidArgumentError(_listed(errors))
    return docs

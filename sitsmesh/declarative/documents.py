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
MAX_DEPTH = 64  # a rate-limit config nests descriptors a few levels; YAML's composer recurses


def _line(event: yaml.Event) -> int:
    return event.start_mark.line + 1 if event.start_mark else 0


def _refuse_aliases(text: str, source: str) -> None:
    """Anchors and aliases let a few bytes expand into millions of nodes (a "billion
    laughs"), and deep nesting overflows the recursive composer; config files need
    neither, so both are refused from the event stream before any object is built."""
    depth = 0
    try:
        for event in yaml.parse(text, Loader=yaml.SafeLoader):
            if isinstance(event, yaml.AliasEvent) or getattr(event, "anchor", None):
                raise InvalidArgumentError(
                    f"{source}: line {_line(event)}: YAML anchors and aliases are not "
                    "accepted in declarative config")
            if isinstance(event, yaml.CollectionStartEvent):
                depth += 1
                if depth > MAX_DEPTH:
                    raise InvalidArgumentError(
                        f"{source}: line {_line(event)}: nested deeper than {MAX_DEPTH} "
                        "levels")
            elif isinstance(event, yaml.CollectionEndEvent):
                depth -= 1
    except yaml.YAMLError as exc:
        raise InvalidArgumentError(
            f"{source}: invalid YAML: {str(exc).splitlines()[0]}") from None


def load(text: str, source: str = "request") -> list[Any]:
    """The non-empty documents of `text`; InvalidArgumentError past the bounds."""
    size = len(text.encode("utf-8"))
    if size > MAX_BYTES:
        raise InvalidArgumentError(f"{source}: {size} bytes is more than the {MAX_BYTES} an "
                                   "apply accepts; split it into several applies")
    _refuse_aliases(text, source)
    docs: list[Any] = []
    try:
        for doc in yaml.safe_load_all(text):
            # A JSON array of documents (what `get -o json` prints for several) is read
            # as its items.
            docs.extend(d for d in (doc if isinstance(doc, list) else [doc]) if d is not None)
            if len(docs) > MAX_DOCUMENTS:
                raise InvalidArgumentError(
                    f"{source}: more than {MAX_DOCUMENTS} documents in one apply; split it")
    except yaml.YAMLError as exc:
        raise InvalidArgumentError(
            f"{source}: invalid YAML: {str(exc).splitlines()[0]}") from None
    return docs


def _label(index: int, raw: Any) -> str:
    kind = raw.get("kind") if isinstance(raw, dict) else None
    meta = raw.get("metadata") if isinstance(raw, dict) else None
    name = meta.get("name") if isinstance(meta, dict) else None
    return f"document {index} ({kind or '?'}/{name or '?'})"


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


def validate(raws: Sequence[Any]) -> list[Document]:
    """Every document validated; all errors reported at once, each naming its document."""
    docs: list[Document] = []
    errors: list[str] = []
    seen: dict[tuple[str, str], int] = {}
    for index, raw in enumerate(raws):
        try:
            doc = _one(raw)
        except ValidationError as exc:
            errors.append(f"{_label(index, raw)}: {explain(exc)}")
            continue
        except ValueError as exc:
            errors.append(f"{_label(index, raw)}: {exc}")
            continue
        key = (doc.KIND, doc.metadata.name)
        if key in seen:
            errors.append(f"{_label(index, raw)}: also defined by document {seen[key]}")
        seen.setdefault(key, index)
        docs.append(doc)
    if errors:
        raise InvalidArgumentError("\n".join(errors))
    return docs

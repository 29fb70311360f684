"""The admin API's enums as the lowercase words the rest of sitsmesh (and the CLI's output)
uses: PRESSURE_LEVEL_OVERLOADED <-> "overloaded", the unspecified zero <-> ""."""

from __future__ import annotations

import re
from typing import Any, Protocol

from google.protobuf.descriptor import EnumDescriptor, FieldDescriptor
from google.protobuf.message import Message


class EnumType(Protocol):
    """What protoc's generated enum wrappers offer (admin_pb2.PressureLevel and the like)."""

    DESCRIPTOR: EnumDescriptor

    def Name(self, number: int) -> str: ...


def _prefix(enum: EnumType) -> str:
    # buf's STANDARD rules prefix every value with the enum's name in UPPER_SNAKE_CASE.
    return re.sub(r"(?<!^)(?=[A-Z])", "_", enum.DESCRIPTOR.name).upper() + "_"


def word(enum: EnumType, number: int) -> str:
    """The value's word; "" for the unspecified zero. A number this build does not know
    (a newer server) reads as its number, so nothing is lost in output."""
    if number == 0:
        return ""
    try:
        return enum.Name(number).removeprefix(_prefix(enum)).lower()
    except ValueError:
        return str(number)


def label(enum: EnumType, text: str) -> str:
    """The full value name for `text` (as `word` spells it; "" is the unspecified zero),
    which message constructors take for an enum field. A word the enum does not have is a
    ValueError naming the ones it has."""
    name = _prefix(enum) + (text.upper() if text else "UNSPECIFIED")
    if name not in enum.DESCRIPTOR.values_by_name:
        raise ValueError(f"{text!r} is not one of {', '.join(words(enum))}")
    return name


def words(enum: EnumType) -> list[str]:
    """Every specified value's word, in declaration order."""
    prefix = _prefix(enum)
    return [v.name.removeprefix(prefix).lower() for v in enum.DESCRIPTOR.values
            if v.number != 0]


def words_in(message: Message, doc: dict[str, Any], *,
             upper: frozenset[str] = frozenset()) -> dict[str, Any]:
    """`doc` (MessageToDict of `message`) with every enum value, at any depth, as its word;
    enums whose full names are in `upper` as the word in capitals. Returns `doc`."""
    for field in message.DESCRIPTOR.fields:
        if field.name not in doc:
            continue
        value = getattr(message, field.name)
        repeated = field.label == FieldDescriptor.LABEL_REPEATED
        if field.enum_type is not None:
            wrapper = _Wrapper(field.enum_type)
            spell = str.upper if field.enum_type.full_name in upper else str
            doc[field.name] = ([spell(word(wrapper, v)) for v in value] if repeated
                               else spell(word(wrapper, value)))
        elif field.message_type is not None:
            if field.message_type.GetOptions().map_entry:
                if field.message_type.fields_by_name["value"].message_type is not None:
                    for key, item in value.items():
                        _nested(item, doc[field.name].get(str(key)), upper)
            elif repeated:
                for item, sub in zip(value, doc[field.name], strict=False):
                    _nested(item, sub, upper)
            else:
                _nested(value, doc[field.name], upper)
    return doc


def _nested(message: Message, doc: Any, upper: frozenset[str]) -> None:
    # Well-known types (Timestamp, FieldMask) render as strings: nothing inside to spell.
    if isinstance(doc, dict):
        words_in(message, doc, upper=upper)


class _Wrapper:
    """An EnumType from a bare descriptor (a field's enum_type)."""

    def __init__(self, descriptor: EnumDescriptor) -> None:
        self.DESCRIPTOR = descriptor

    def Name(self, number: int) -> str:
        value = self.DESCRIPTOR.values_by_number.get(number)
        if value is None:
            raise ValueError(number)
        return str(value.name)

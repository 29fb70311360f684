from google.protobuf import struct_pb2 as _struct_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ApplyAction(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    APPLY_ACTION_UNSPECIFIED: _ClassVar[ApplyAction]
    APPLY_ACTION_CREATED: _ClassVar[ApplyAction]
    APPLY_ACTION_CONFIGURED: _ClassVar[ApplyAction]
    APPLY_ACTION_UNCHANGED: _ClassVar[ApplyAction]
    APPLY_ACTION_PRUNED: _ClassVar[ApplyAction]
APPLY_ACTION_UNSPECIFIED: ApplyAction
APPLY_ACTION_CREATED: ApplyAction
APPLY_ACTION_CONFIGURED: ApplyAction
APPLY_ACTION_UNCHANGED: ApplyAction
APPLY_ACTION_PRUNED: ApplyAction

class ApplyFile(_message.Message):
    __slots__ = ("name", "documents")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DOCUMENTS_FIELD_NUMBER: _ClassVar[int]
    name: str
    documents: str
    def __init__(self, name: _Optional[str] = ..., documents: _Optional[str] = ...) -> None: ...

class ApplyRequest(_message.Message):
    __slots__ = ("files", "objects", "dry_run", "prune", "prune_selector")
    FILES_FIELD_NUMBER: _ClassVar[int]
    OBJECTS_FIELD_NUMBER: _ClassVar[int]
    DRY_RUN_FIELD_NUMBER: _ClassVar[int]
    PRUNE_FIELD_NUMBER: _ClassVar[int]
    PRUNE_SELECTOR_FIELD_NUMBER: _ClassVar[int]
    files: _containers.RepeatedCompositeFieldContainer[ApplyFile]
    objects: _containers.RepeatedCompositeFieldContainer[_struct_pb2.Struct]
    dry_run: bool
    prune: bool
    prune_selector: str
    def __init__(self, files: _Optional[_Iterable[_Union[ApplyFile, _Mapping]]] = ..., objects: _Optional[_Iterable[_Union[_struct_pb2.Struct, _Mapping]]] = ..., dry_run: _Optional[bool] = ..., prune: _Optional[bool] = ..., prune_selector: _Optional[str] = ...) -> None: ...

class DocumentResult(_message.Message):
    __slots__ = ("kind", "name", "action", "diff")
    KIND_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    ACTION_FIELD_NUMBER: _ClassVar[int]
    DIFF_FIELD_NUMBER: _ClassVar[int]
    kind: str
    name: str
    action: ApplyAction
    diff: str
    def __init__(self, kind: _Optional[str] = ..., name: _Optional[str] = ..., action: _Optional[_Union[ApplyAction, str]] = ..., diff: _Optional[str] = ...) -> None: ...

class ApplyResponse(_message.Message):
    __slots__ = ("results", "applied", "revision")
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    APPLIED_FIELD_NUMBER: _ClassVar[int]
    REVISION_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[DocumentResult]
    applied: bool
    revision: int
    def __init__(self, results: _Optional[_Iterable[_Union[DocumentResult, _Mapping]]] = ..., applied: _Optional[bool] = ..., revision: _Optional[int] = ...) -> None: ...

class GetRequest(_message.Message):
    __slots__ = ("kind", "name")
    KIND_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    kind: str
    name: str
    def __init__(self, kind: _Optional[str] = ..., name: _Optional[str] = ...) -> None: ...

class ConfigDocument(_message.Message):
    __slots__ = ("kind", "name", "json")
    KIND_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    JSON_FIELD_NUMBER: _ClassVar[int]
    kind: str
    name: str
    json: str
    def __init__(self, kind: _Optional[str] = ..., name: _Optional[str] = ..., json: _Optional[str] = ...) -> None: ...

class GetResponse(_message.Message):
    __slots__ = ("documents",)
    DOCUMENTS_FIELD_NUMBER: _ClassVar[int]
    documents: _containers.RepeatedCompositeFieldContainer[ConfigDocument]
    def __init__(self, documents: _Optional[_Iterable[_Union[ConfigDocument, _Mapping]]] = ...) -> None: ...

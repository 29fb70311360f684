"""The one exception hierarchy. Transports map these to wire errors at the edge."""

from __future__ import annotations

import enum


class Code(enum.Enum):
    """Stable error codes; each transport owns the mapping to its wire status."""

    INVALID_ARGUMENT = "invalid_argument"
    NOT_FOUND = "not_found"
    ALREADY_EXISTS = "already_exists"
    FAILED_PRECONDITION = "failed_precondition"
    UNAUTHENTICATED = "unauthenticated"
    PERMISSION_DENIED = "permission_denied"
    RESOURCE_EXHAUSTED = "resource_exhausted"
    UNAVAILABLE = "unavailable"
    INTERNAL = "internal"
    # For errors a compatible peer reports without a code (envoyproxy/ratelimit's plain errors).
    UNKNOWN = "unknown"


class SitsmeshError(Exception):
    code: Code = Code.INTERNAL

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class ConfigError(SitsmeshError):
    """A setting, file or flag is invalid. The message names the source and key."""

    code = Code.INVALID_ARGUMENT


class StartupError(SitsmeshError):
    """The process cannot start: an address is taken, a directory is not writable."""

    code = Code.FAILED_PRECONDITION


class InvalidArgumentError(SitsmeshError):
    """A request is malformed or names something it may not; nothing was changed."""

    code = Code.INVALID_ARGUMENT


class FailedPreconditionError(SitsmeshError):
    """The request is well formed, but this process cannot answer it as configured."""

    code = Code.FAILED_PRECONDITION


class UnauthenticatedError(SitsmeshError):
    """The caller did not prove who it is."""

    code = Code.UNAUTHENTICATED


class NotFoundError(SitsmeshError):
    code = Code.NOT_FOUND


class ConflictError(SitsmeshError):
    code = Code.ALREADY_EXISTS


class UnavailableError(SitsmeshError):
    """A backing service (the state database) cannot be reached; nothing was changed
    unless the message says the outcome is unknown. Retry later."""

    code = Code.UNAVAILABLE

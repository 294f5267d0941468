"""Domain errors, each bound to the gRPC status code the servicer answers with.

Library code raises these; the servicer maps them to `context.abort(code, message)` in one
place, so a rejected request always carries a precise status and a one-sentence reason.
"""

from __future__ import annotations

import grpc


class DilocoError(Exception):
    """Base class: a request the server refuses, with the status code to report."""

    code = grpc.StatusCode.INTERNAL


class InvalidArgument(DilocoError):
    """The request is malformed: bad field, bad length, bad checksum, bad value."""

    code = grpc.StatusCode.INVALID_ARGUMENT


class NotFound(DilocoError):
    """Unknown session or fragment (for example after the learner's lease expired)."""

    code = grpc.StatusCode.NOT_FOUND


class FailedPrecondition(DilocoError):
    """Valid request that does not fit the current state (stale base, wrong fingerprint)."""

    code = grpc.StatusCode.FAILED_PRECONDITION


class AlreadyExists(DilocoError):
    """The thing the request would create exists already (a second push for one round)."""

    code = grpc.StatusCode.ALREADY_EXISTS


class ResourceExhausted(DilocoError):
    """The request is larger than the server accepts."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class PermissionDenied(DilocoError):
    """An authenticated learner acts for another learner (its session or its id)."""

    code = grpc.StatusCode.PERMISSION_DENIED


class Unavailable(DilocoError):
    """The server cannot take the request now (its state dir cannot be written); a retry
    later, once it is back, may succeed."""

    code = grpc.StatusCode.UNAVAILABLE

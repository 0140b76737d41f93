"""Domain errors of the control plane; the API maps each kind to one HTTP status."""

from __future__ import annotations


class DomainError(Exception):
    """A request the daemon refuses; the message is for people and names the value."""

    kind = "refused"

    def __init__(self, message: str, field: str | None = None):
        super().__init__(message)
        self.field = field


class Invalid(DomainError):
    """The request is well-formed but its values cannot be used (HTTP 422)."""

    kind = "invalid"


class NotFound(DomainError):
    """The job, node or token named does not exist (HTTP 404)."""

    kind = "not_found"


class Forbidden(DomainError):
    """The caller's role or ownership does not allow this (HTTP 403)."""

    kind = "forbidden"


class Conflict(DomainError):
    """The target's current state does not allow this (HTTP 409)."""

    kind = "conflict"


class Unavailable(DomainError):
    """A node or a dependency cannot be reached right now; retrying may work (HTTP 503)."""

    kind = "unavailable"


class NotLeader(Unavailable):
    """This daemon stands by; the leader acts (HTTP 503 with the leader's address)."""

    kind = "not_leader"


class Throttled(DomainError):
    """The caller has used their share of the daemon's reads for now (HTTP 429, Retry-After)."""

    kind = "throttled"

    def __init__(self, message: str, retry_after_s: int):
        super().__init__(message)
        self.retry_after_s = retry_after_s

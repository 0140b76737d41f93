"""The control plane's daemon: a facade (core.py) over collaborators with one concern each."""

from .caller import Caller
from .clock import Clock, ManualClock
from .core import Daemon
from .errors import Conflict, DomainError, Forbidden, Invalid, NotFound, NotLeader, Unavailable
from .inventory import NodeRequest
from .jobs import JobFilter, JobRequest
from .lifecycle import job_key, parse_key
from .state import event_json

__all__ = ["Caller", "Clock", "Conflict", "Daemon", "DomainError", "Forbidden", "Invalid", "JobFilter",
           "JobRequest", "ManualClock", "NodeRequest", "NotFound", "NotLeader", "Unavailable", "event_json",
           "job_key", "parse_key"]

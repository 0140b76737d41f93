"""Running a verb on the daemon: one call per target, its refusals kept, and what to tell people."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from tui.actions import BY_ID
from tui.backend import Backend, BackendError, BackendUnreachable

# verb -> the backend call for one target (submit's target is the job spec)
CALLS: dict[str, Callable[..., Any]] = {
    "submit": lambda b, spec: b.submit(spec).get("id"),
    "cancel": lambda b, job: b.cancel(job),
    "requeue": lambda b, job: b.requeue(job),
    "hold": lambda b, job: b.hold(job),
    "release": lambda b, job: b.release(job),
    "priority": lambda b, job, priority: b.set_priority(job, priority),
    "drain": lambda b, node, reason: b.drain_node(node, reason),
    "resume": lambda b, node: b.resume_node(node),
}
LISTED = 10  # targets named in the notification; the rest are counted


def run(backend: Backend, verb: str, targets: list, **kwargs: Any) -> tuple[list, dict[Any, str]]:
    """Call the daemon for each target (blocking: the app runs this on a worker thread).
    Returns what was done (submit: the new job ids) and, per refused target, the daemon's word."""
    call = CALLS[verb]
    done: list = []
    failures: dict[Any, str] = {}
    for target in targets:
        key = "submit" if verb == "submit" else target
        try:
            result = call(backend, target, **kwargs)
        except (BackendError, BackendUnreachable) as exc:
            failures[key] = getattr(exc, "detail", None) or str(exc)
        except Exception as exc:  # a broken answer: say it, keep the app alive
            failures[key] = f"{type(exc).__name__}: {exc}"
        else:
            done.append(result if verb == "submit" else target)
    return done, failures


def refusal(verb: str, failures: dict[Any, str]) -> str:
    """`drain gpu-02 refused: role 'user' may not drain nodes (and 1 more refused)`."""
    first_target, first = next(iter(failures.items()))
    more = f" (and {len(failures) - 1} more refused)" if len(failures) > 1 else ""
    where = "" if verb == "submit" else f" {first_target}"
    return f"{verb}{where} refused: {first}{more}"


def success(verb: str, done: list) -> str:
    """`drained gpu-02, gpu-03`; `submitted job 25`."""
    if verb == "submit":
        return f"submitted job {', '.join(map(str, done))}"
    listed = ", ".join(map(str, done[:LISTED]))
    more = f" and {len(done) - LISTED} more" if len(done) > LISTED else ""
    return f"{BY_ID[verb].done} {listed}{more}"

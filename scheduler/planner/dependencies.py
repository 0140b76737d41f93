"""Job dependencies in Slurm's forms: after, afterok, afterany, afternotok (by job id) and singleton."""

from __future__ import annotations

from collections.abc import Collection, Mapping

from .types import JobView

KINDS = ("after", "afterany", "afterok", "afternotok")
OK_STATES = frozenset({"COMPLETED"})
TERMINAL_STATES = frozenset({"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL"})

SATISFIED, WAITING, NEVER = "ok", "wait", "never"


def parse_dependency(text: str) -> str:
    """Normalise a dependency list: 'afterok:12:13,singleton'. A bare id '12' means afterany:12.

    Clauses are separated by commas and must all hold (Slurm's ','; '?' for "any" is not
    supported). Raises ValueError naming the part that cannot be read.
    """
    if not isinstance(text, str):
        raise ValueError(f"dependency: expected text such as afterok:12, got {text!r}")
    if "?" in text:
        raise ValueError(
            f"dependency {text!r}: '?' (any of) is not supported; use ',' (all of)"
        )
    clauses: list[str] = []
    for raw in text.replace(" ", "").split(","):
        if not raw:
            raise ValueError(f"dependency {text!r}: empty clause; write e.g. afterok:12,singleton")
        kind, sep, rest = raw.partition(":")
        kind = kind.lower()
        if kind.isdigit():  # '12' or '12:13'
            kind, rest, sep = "afterany", raw, ":"
        if kind == "singleton":
            if sep:
                raise ValueError(f"dependency {text!r}: singleton takes no job ids, got {raw!r}")
            if "singleton" not in clauses:
                clauses.append("singleton")
            continue
        if kind not in KINDS:
            raise ValueError(
                f"dependency {text!r}: unknown type {kind!r}; use "
                f"{', '.join(KINDS)}, singleton, or a job id"
            )
        ids: list[int] = []
        for part in rest.split(":") if sep else ():
            # Slurm allows afterok:12+30 (minutes of delay); that is not supported here
            if not part.isdigit() or int(part) < 1:
                raise ValueError(f"dependency {text!r}: {part!r} in {raw!r} is not a job id")
            if int(part) not in ids:
                ids.append(int(part))
        if not ids:
            raise ValueError(f"dependency {text!r}: {kind} needs at least one job id, e.g. {kind}:12")
        clauses.append(kind + "".join(f":{i}" for i in ids))
    return ",".join(clauses)


def depends_on(dependency: str) -> tuple[int, ...]:
    """The job ids a normalised dependency names (what the daemon must put in Snapshot.finished)."""
    out: list[int] = []
    for clause in dependency.split(",") if dependency else ():
        _, _, ids = clause.partition(":")
        out.extend(int(i) for i in ids.split(":") if i)
    return tuple(out)


def is_singleton(job: JobView) -> bool:
    return "singleton" in job.dependency.split(",") if job.dependency else False


def dependency_status(
    job: JobView, finished: Mapping[int, str], started: Collection[int] = ()
) -> tuple[str, str]:
    """(ok | wait | never, detail). `started`: ids of jobs running now (for `after`)."""
    if not job.dependency:
        return SATISFIED, ""
    for clause in job.dependency.split(","):
        kind, _, ids = clause.partition(":")
        if kind == "singleton" or not ids:
            continue
        for raw in ids.split(":"):
            dep = int(raw)
            state = finished.get(dep)
            if kind == "after":
                if state is None and dep not in started:
                    return WAITING, f"waiting for job {dep} to start"
                continue
            if state is None or state not in TERMINAL_STATES:
                return WAITING, f"waiting for job {dep} to end ({kind})"
            if kind == "afterok" and state not in OK_STATES:
                return NEVER, f"job {dep} ended {state}, so afterok:{dep} can never be satisfied"
            if kind == "afternotok" and state in OK_STATES:
                return NEVER, f"job {dep} COMPLETED, so afternotok:{dep} can never be satisfied"
    return SATISFIED, ""

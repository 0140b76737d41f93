"""Pure formatting for the TUI: states to colours, bars, sparklines, durations, row cells."""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any

from rich.text import Text

from scheduler.containers import runtime_word

# Colours by state, in the k9s spirit: green is fine, yellow needs a look, red is trouble.
# Both trainyard's first words and Slurm's: HELD is Slurm's PENDING with reason JobHeldUser or
# JobHeldAdmin, STARTING is CONFIGURING; a daemon of either kind is shown the same way.
JOB_STATE_STYLE = {
    "PENDING": "yellow",
    "HELD": "magenta",
    "STARTING": "cyan",
    "CONFIGURING": "cyan",
    "RUNNING": "green",
    "COMPLETED": "dim",
    "FAILED": "bold red",
    "OUT_OF_MEMORY": "bold red",
    "CANCELLED": "dim yellow",
    "TIMEOUT": "red",
    "PREEMPTED": "yellow",
    "NODE_FAIL": "bold red",
}
NODE_STATE_STYLE = {
    "UP": "green",
    "DRAINING": "yellow",
    "DRAINED": "magenta",
    "DOWN": "bold red",
    "PROVISIONING": "cyan",
    "BOOTSTRAPPING": "cyan",
}
ACTIVE_JOB_STATES = ("PENDING", "HELD", "STARTING", "CONFIGURING", "RUNNING")
WAITING_JOB_STATES = ("PENDING", "HELD")
LAUNCHED_JOB_STATES = ("STARTING", "CONFIGURING", "RUNNING")
HELD_REASON = "JobHeld"  # Slurm: JobHeldUser, JobHeldAdmin

SPARK = "▁▂▃▄▅▆▇█"


def state_text(state: str | None, styles: dict[str, str]) -> Text:
    state = state or "?"
    return Text(state, style=styles.get(state, ""))


def is_held(job: dict) -> bool:
    """Held, in either vocabulary: HELD, or PENDING with reason JobHeldUser/JobHeldAdmin."""
    state = job.get("state")
    return state == "HELD" or (state == "PENDING"
                               and str(job.get("reason") or "").startswith(HELD_REASON))


def job_state_text(job: dict) -> Text:
    """A job's state as the daemon words it, coloured as held when it is held."""
    if is_held(job):
        return Text(job.get("state") or "?", style=JOB_STATE_STYLE["HELD"])
    return state_text(job.get("state"), JOB_STATE_STYLE)


# `state:WORD` filters whose meaning differs between the two vocabularies: applied to the jobs
# fetched rather than sent to a daemon that may not know the word.
STATE_FILTERS = {
    "held": is_held,
    "starting": lambda job: job.get("state") in ("STARTING", "CONFIGURING"),
    "configuring": lambda job: job.get("state") in ("STARTING", "CONFIGURING"),
}


def load_style(percent: float | None, low: float = 10, high: float = 75) -> str:
    """nvitop's thresholds: below `low` is idle, above `high` is hot."""
    if percent is None:
        return "dim"
    if percent >= high:
        return "red"
    if percent >= low:
        return "yellow"
    return "green"


def bar(used: int | None, total: int | None, width: int = 8) -> Text:
    """A used/total bar such as `█████░░░ 5/8`."""
    used = used or 0
    total = total or 0
    filled = round(width * used / total) if total else 0
    filled = max(0, min(width, filled))
    pct = 100 * used / total if total else 0
    text = Text("█" * filled, style=load_style(pct, 50, 90))
    text.append("░" * (width - filled), style="dim")
    text.append(f" {used}/{total}")
    return text


def sparkline(values: Iterable[float | None], width: int = 20, top: float = 100.0) -> Text:
    """The last `width` samples of a 0..top series as block characters; gaps as spaces."""
    samples = list(values)[-width:]
    out = Text(" " * (width - len(samples)))
    for value in samples:
        if value is None:
            out.append(" ")
            continue
        level = max(0, min(len(SPARK) - 1, int(value / top * (len(SPARK) - 1) + 0.5)))
        out.append(SPARK[level], style=load_style(value / top * 100))
    return out


def duration(seconds: float | None) -> str:
    """Compact durations in the way squeue prints them: 45s, 12m03s, 3h04m, 2d05h."""
    if seconds is None:
        return "-"
    s = max(0, int(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 86400}d{s % 86400 // 3600:02d}h"


def ago(then: float | None, now: float) -> str:
    return "-" if not then else duration(now - then) + " ago"


def clock(ts: float | None) -> str:
    return "-" if not ts else time.strftime("%H:%M:%S", time.localtime(ts))


def num(value: Any, fmt: str = "{:.0f}", missing: str = "-") -> str:
    if value is None:
        return missing
    try:
        return fmt.format(value)
    except (TypeError, ValueError):
        return missing


def gib(mb: float | None) -> str:
    return "-" if mb is None else f"{mb / 1024:.1f}"


def labels_text(labels: dict | None) -> str:
    return ",".join(f"{k}={v}" for k, v in sorted((labels or {}).items()))


def _gpus(node: dict) -> list[dict]:
    return list(((node.get("telemetry") or {}).get("gpus")) or [])


def node_summary(node: dict) -> dict[str, float | None]:
    """Mean utilisation, GPU memory used/total, hottest GPU and total power from telemetry."""
    util_sum = util_n = 0
    mem_used = mem_total = power = None
    temp = None
    for g in _gpus(node):
        u = g.get("util_gpu")
        if u is not None:
            util_sum += u
            util_n += 1
        t = g.get("temp_c")
        if t is not None and (temp is None or t > temp):
            temp = t
        p = g.get("power_w")
        if p is not None:
            power = (power or 0) + p
        mu, mt = g.get("mem_used_mb"), g.get("mem_total_mb")
        if mu is not None:
            mem_used = (mem_used or 0) + mu
        if mt is not None:
            mem_total = (mem_total or 0) + mt
    return {
        "util": util_sum / util_n if util_n else None,
        "mem_used": mem_used,
        "mem_total": mem_total,
        "temp": temp,
        "power": power,
    }


def node_cells(node: dict) -> tuple:
    s = node_summary(node)
    util = s["util"]
    mem = (
        f"{gib(s['mem_used'])}/{gib(s['mem_total'])}G" if s["mem_total"] is not None else "-"
    )
    temp = s["temp"]
    return (
        node.get("name", "?"),
        node.get("pool") or "-",
        state_text(node.get("state"), NODE_STATE_STYLE),
        bar(node.get("gpus_used"), node.get("gpus_total")),
        Text(num(util, "{:.0f}%"), style=load_style(util)),
        mem,
        Text(num(temp, "{:.0f}°C"), style=load_style(temp, 60, 83) if temp is not None else "dim"),
        num(s["power"], "{:.0f}W"),
        runtime_word(node.get("agent")),
        Text(node.get("reason") or "", style="yellow"),
        labels_text(node.get("labels")),
    )


def gpu_cells(gpu: dict, util_hist: Iterable, mem_hist: Iterable, spark_width: int = 20) -> tuple:
    util = gpu.get("util_gpu")
    mem_total = gpu.get("mem_total_mb")
    mem_used = gpu.get("mem_used_mb")
    mem_pct = 100 * mem_used / mem_total if mem_total and mem_used is not None else None
    temp = gpu.get("temp_c")
    errors = []
    if gpu.get("ecc_dbe"):
        errors.append(f"ECC {gpu['ecc_dbe']}")
    if gpu.get("xid"):
        errors.append(f"XID {gpu['xid']}")
    power = gpu.get("power_w")
    limit = gpu.get("power_limit_w")
    return (
        str(gpu.get("index", "?")),
        Text(num(util, "{:>3.0f}%"), style=load_style(util)),
        sparkline(util_hist, spark_width),
        Text(f"{gib(mem_used)}/{gib(mem_total)}G", style=load_style(mem_pct, 10, 80)),
        sparkline(mem_hist, spark_width),
        Text(num(temp, "{:.0f}°C"), style=load_style(temp, 60, 83) if temp is not None else "dim"),
        f"{num(power, '{:.0f}')}/{num(limit, '{:.0f}')}W",
        Text(" ".join(errors) or "-", style="bold red" if errors else "dim"),
        str(gpu.get("job_id")) if gpu.get("job_id") is not None else "-",
    )


def job_cells(job: dict, now: float) -> tuple:
    submit = job.get("submit_time")
    start = job.get("start_time")
    end = job.get("end_time")
    waited = ((start or now) - submit) if submit else None
    runtime = ((end or now) - start) if start else None
    reason = job.get("reason") or ""
    if job.get("state") == "PENDING" and job.get("estimated_start") and not is_held(job):
        reason = f"{reason} ≈{time.strftime('%H:%M', time.localtime(job['estimated_start']))}".strip()
    return (
        job.get("id"),
        job.get("name") or "",
        job.get("user") or "",
        job.get("queue") or "",
        job_state_text(job),
        reason,
        f"{job.get('gpus') or 0}×{job.get('nodes') or 1}",
        ago(submit, now),
        duration(waited),
        duration(runtime),
    )


def queue_cells(queue: dict) -> tuple:
    used = queue.get("gpus_used")
    quota = queue.get("gpu_quota", queue.get("quota"))
    share = queue.get("fair_share", queue.get("usage"))
    return (
        queue.get("name", "?"),
        Text(queue.get("state") or "-",
             style="green" if str(queue.get("state")).lower() in ("open", "up", "active") else "yellow"),
        num(queue.get("priority")),
        num(queue.get("pending"), "{}"),
        num(queue.get("running"), "{}"),
        bar(used, quota) if quota else Text(f"{num(used, '{}')}/∞"),
        num(share, "{:.2f}"),
        Text(queue.get("pending_reasons") or "-", style="yellow"),
    )


def pending_reasons(jobs: list[dict], top: int = 3) -> dict[str, str]:
    """Per queue, its pending jobs' most frequent reasons (of the jobs shown), e.g.
    `Resources 12, AssocGrpGRES 3`: why a queue waits, at a glance."""
    counts: dict[str, dict[str, int]] = {}
    for j in jobs:
        if j.get("state") == "PENDING":
            by = counts.setdefault(j.get("queue") or "?", {})
            reason = j.get("reason") or "None"
            by[reason] = by.get(reason, 0) + 1
    return {q: ", ".join(f"{r} {n}" for r, n in sorted(by.items(), key=lambda kv: (-kv[1], kv[0]))[:top])
            for q, by in counts.items()}


def quota_bar(used: int | None, nominal: int | None, width: int = 8) -> Text:
    """GPUs in use against a nominal quota: `████░░░░ 4/8`; beyond it the borrowed GPUs show as
    `████████ 12/8 +4` (borrowed from the cohort); no quota is `4/∞`."""
    used = used or 0
    if nominal is None:
        return Text(f"{used}/∞")
    inside = min(used, nominal)
    filled = max(0, min(width, round(width * inside / nominal))) if nominal else 0
    pct = 100 * used / nominal if nominal else (100 if used else 0)
    text = Text("█" * filled, style=load_style(pct, 50, 90))
    text.append("░" * (width - filled), style="dim")
    text.append(f" {used}/{nominal}")
    if used > nominal:
        text.append(f" +{used - nominal}", style="bold magenta")
    return text


def _limit(value: int | None, quota: bool) -> str:
    """A borrowing or lending limit: none set is unlimited (∞); a team without a quota, or
    outside a cohort (nothing to borrow from or lend to), has none (-)."""
    if not quota:
        return "-"
    return "∞" if value is None else str(value)


def team_cells(team: dict) -> tuple:
    quota = team.get("nominal_gpus") is not None and bool(team.get("cohort"))
    pending = team.get("pending")
    return (
        team.get("name", "?"),
        team.get("cohort") or "-",
        quota_bar(team.get("gpus_used"), team.get("nominal_gpus")),
        _limit(team.get("borrowing_limit_gpus"), quota),
        _limit(team.get("lending_limit_gpus"), quota),
        num(team.get("fairshare_shares"), "{:g}"),
        num(team.get("usage_gpu_hours"), "{:.2f}"),
        Text(num(team.get("running"), "{}"), style="green" if team.get("running") else ""),
        Text(num(pending, "{}"), style="yellow" if pending else ""),
    )


def team_of(job: dict, user_teams: dict[str, str]) -> str:
    """The team a job is charged to, as the daemon maps it: its account, else its user's team,
    else "default"."""
    return job.get("account") or user_teams.get(job.get("user") or "", "default")


def team_usage(jobs: Iterable[dict], key: str = "user") -> dict[str, dict[str, int]]:
    """Pending, running and GPUs in use per team (by default per user) from the job list."""
    out: dict[str, dict[str, int]] = {}
    for job in jobs:
        team = job.get(key) or "-"
        row = out.setdefault(team, {"pending": 0, "running": 0, "gpus": 0})
        state = job.get("state")
        if state in WAITING_JOB_STATES:
            row["pending"] += 1
        elif state in LAUNCHED_JOB_STATES:
            row["running"] += 1
            row["gpus"] += (job.get("gpus") or 0) * (job.get("nodes") or 1)
    return out


def event_cells(event: dict) -> tuple:
    detail = event.get("detail") or {}
    if isinstance(detail, dict):
        detail_text = " ".join(f"{k}={v}" for k, v in detail.items())
    else:
        detail_text = str(detail)
    action = event.get("action") or ""
    style = "red" if any(w in action for w in ("fail", "drain", "cancel", "down")) else ""
    return (
        event.get("id"),
        clock(event.get("time")),
        event.get("actor") or "-",
        Text(action, style=style),
        str(event.get("target") or ""),
        detail_text,
    )


def match_filter(text: str, terms: list[str]) -> bool:
    """Every term must appear in the row's text (case-insensitive); a `!term` must not."""
    for term in terms:
        if term.startswith("!") and len(term) > 1:
            if term[1:] in text:
                return False
        elif term not in text:
            return False
    return True


def parse_filter(query: str, server_keys: Iterable[str] = ()) -> tuple[dict[str, str], list[str]]:
    """Split `state:running user:ana llama` into daemon-side filters and client-side terms."""
    keys = set(server_keys)
    server: dict[str, str] = {}
    terms: list[str] = []
    for word in query.lower().split():
        key, sep, value = word.partition(":")
        if sep and key in keys and value:
            server[key] = value
        else:
            terms.append(word)
    return server, terms


def row_text(cells: Iterable[Any]) -> str:
    return " ".join(c.plain if isinstance(c, Text) else str(c) for c in cells).lower()

"""sacct's fields as Slurm names, matches and prints them: its table of names and widths, a name
given as any prefix of one (case-insensitive, the first in the table's order: `jobn` is JobName),
ALL, `NAME%WIDTH`, and `Invalid field requested` for a name that is none of them. A header says
the field's own name, whatever was typed.

The values are those of a job's allocation line, which is all trainyard records (it has no job
steps): what Slurm fills only on step lines (MaxRSS, AveCPU, TotalCPU, NTasks, ...) is empty
there too; a field of Slurm's that trainyard does not keep (Priority, QOS, WCKey, ...) is empty.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

from .api import iso, nodelist, reason, sacct_time, slurm_state

# Slurm's sacct field table (src/sacct/sacct.c), in its order: the order decides which field a
# prefix names. A negative width is printed left-justified, as Slurm does (the job ids).
_TABLE = """Account 10|AdminComment 15|AllocCPUS 10|AllocNodes 10|AllocTRES 10|AssocID 7|AveCPU 10|
AveCPUFreq 10|AveDiskRead 14|AveDiskWrite 14|AvePages 10|AveRSS 10|AveVMSize 10|BlockID 16|Cluster 10|
Comment 14|Constraints 19|ConsumedEnergy 14|ConsumedEnergyRaw 17|Container 19|CPUTime 10|CPUTimeRAW 10|
DBIndex -21|DerivedExitCode 15|Elapsed 10|ElapsedRaw 10|Eligible 19|End 19|ExitCode 8|Extra 14|
FailedNode 8|Flags 19|GID 6|Group 9|JobID -12|JobIDRaw -12|JobName 10|Layout 9|Licenses 10|
MaxDiskRead 12|MaxDiskReadNode 15|MaxDiskReadTask 15|MaxDiskWrite 12|MaxDiskWriteNode 16|
MaxDiskWriteTask 16|MaxPages 8|MaxPagesNode 12|MaxPagesTask 14|MaxRSS 10|MaxRSSNode 10|MaxRSSTask 10|
MaxVMSize 10|MaxVMSizeNode 14|MaxVMSizeTask 14|McsLabel 12|MinCPU 10|MinCPUNode 10|MinCPUTask 10|
NCPUS 10|NNodes 8|NodeList 15|NTasks 8|Partition 10|Planned 10|PlannedCPU 10|PlannedCPURAW 13|
Priority 10|QOS 10|QOSRAW 6|QOSREQ 10|Reason 22|ReqCPUFreq 10|ReqCPUFreqGov 13|ReqCPUFreqMax 13|
ReqCPUFreqMin 13|ReqCPUS 8|ReqMem 10|ReqNodes 8|ReqTRES 10|Reservation 20|ReservationId 8|
Restarts 8|SegmentSize 11|SLUID 14|Start 19|State 10|StdErr 20|StdIn 20|StdOut 20|Submit 19|
SubmitLine 20|Suspended 10|SystemComment 15|SystemCPU 10|Timelimit 10|TimelimitRaw 10|TotalCPU 10|
TRESUsageInAve 14|TRESUsageInMax 14|TRESUsageInMaxNode 18|TRESUsageInMaxTask 18|TRESUsageInMin 14|
TRESUsageInMinNode 18|TRESUsageInMinTask 18|TRESUsageInTot 14|TRESUsageOutAve 15|TRESUsageOutMax 15|
TRESUsageOutMaxNode 19|TRESUsageOutMaxTask 19|TRESUsageOutMin 15|TRESUsageOutMinNode 19|
TRESUsageOutMinTask 19|TRESUsageOutTot 15|UID 6|User 9|UserCPU 10|WCKey 10|WCKeyID 10|WorkDir 20|
AllocGRES 12|ReqGRES 12"""
# (AllocGRES and ReqGRES: the GRES fields of Slurm before 20.11, still in older scripts; last,
# so that no prefix of a current field names them)
FIELDS: list[tuple[str, int]] = [(n, int(w)) for n, w in
                                 (item.split() for item in _TABLE.replace("\n", "").split("|"))]
DEFAULT = "JobID,JobName,Partition,Account,AllocCPUS,State,ExitCode"
BRIEF = "JobID,State,ExitCode"
LONG = ("JobID,JobIDRaw,JobName,Partition,Account,User,AllocCPUS,ReqMem,AllocTRES,NNodes,NodeList,State,"
        "ExitCode,Submit,Start,End,Elapsed,Timelimit,Reason")


def resolve(spec: str) -> list[tuple[str, int]]:
    """`JobID,jobn,State%20` -> [(field, width)]: each item the first field it is a prefix of,
    ALL every field; ValueError with Slurm's words for one that names no field."""
    out: list[tuple[str, int]] = []
    for item in (s.strip() for s in spec.split(",")):
        if not item:
            continue
        text, _, width = item.partition("%")
        if width and not width.lstrip("-").isdigit():
            raise ValueError(f'Invalid field width requested: "{item}"')
        wanted = text.strip().lower()
        if wanted and "all".startswith(wanted):
            out += [(n, int(width) if width else w) for n, w in FIELDS]
            continue
        found = next(((n, w) for n, w in FIELDS if wanted and n.lower().startswith(wanted)), None)
        if found is None:
            raise ValueError(f'Invalid field requested: "{text}"')
        out.append((found[0], int(width) if width else found[1]))
    return out


def help_text() -> str:
    """sacct -e: the field names, four to a line."""
    names = [n for n, _ in FIELDS]
    return "\n".join(" ".join(f"{n:<19}" for n in names[i:i + 4]).rstrip() for i in range(0, len(names), 4))


def _mem(mb) -> str:
    mb = int(mb or 0)
    return f"{mb // 1024}G" if mb and mb % 1024 == 0 else f"{mb}M"


def _tres(job: dict, cpus: int, nodes: int) -> str:
    """Slurm's TRES string: billing=8,cpu=8,gres/gpu=2,mem=32G,node=1."""
    parts = [f"billing={cpus}", f"cpu={cpus}"]
    gpus = int(job.get("gpus") or 0) * nodes
    if gpus:
        parts.append(f"gres/gpu={gpus}")
    if job.get("mem"):
        parts.append(f"mem={_mem(int(job['mem']) * nodes)}")
    parts.append(f"node={nodes}")
    return ",".join(parts)


def _run_s(job: dict, now: float) -> float:
    start = job.get("start_time")
    return max(0.0, (job.get("end_time") or now) - start) if start else 0.0


def _values(job: dict, now: float) -> dict[str, Callable[[], object]]:
    started = bool(job.get("start_time"))
    nodes = int(job.get("nodes") or 1)
    cpus = int(job.get("cpus") or 1) * nodes
    alloc_cpus = cpus if started else 0
    exit_code = job.get("exit_code")
    array, task = job.get("array_job_id"), job.get("array_task_id")
    limit = job.get("time_limit")
    return {
        "Account": lambda: job.get("account") or "",
        "AllocCPUS": lambda: alloc_cpus, "NCPUS": lambda: alloc_cpus,
        "AllocNodes": lambda: nodes if started else 0,
        "AllocTRES": lambda: _tres(job, cpus, nodes) if started else "",
        "ReqTRES": lambda: _tres(job, cpus, nodes),
        "AllocGRES": lambda: f"gpu:{job.get('gpus') or 0}" if started else "",
        "ReqGRES": lambda: f"gpu:{job.get('gpus') or 0}",
        "CPUTime": lambda: sacct_time(_run_s(job, now) * alloc_cpus),
        "CPUTimeRAW": lambda: int(_run_s(job, now) * alloc_cpus),
        "DerivedExitCode": lambda: "0:0",
        "Elapsed": lambda: sacct_time(_run_s(job, now)),
        "ElapsedRaw": lambda: int(_run_s(job, now)),
        "Submit": lambda: iso(job.get("submit_time")),
        "Start": lambda: iso(job.get("start_time")) if started else "Unknown",
        "End": lambda: iso(job.get("end_time")) if job.get("end_time") else "Unknown",
        "ExitCode": lambda: f"{exit_code if exit_code is not None else 0}:0",
        "JobID": lambda: f"{array}_{task}" if array is not None else job["id"],
        "JobIDRaw": lambda: job["id"],
        "JobName": lambda: job.get("name", ""),
        "NNodes": lambda: nodes,
        "NodeList": lambda: nodelist(job) or "None assigned",
        "Partition": lambda: job.get("queue", ""),
        "Reason": lambda: reason(job),
        "ReqCPUS": lambda: cpus,
        "ReqMem": lambda: _mem(job.get("mem")),
        "ReqNodes": lambda: nodes,
        "State": lambda: slurm_state(job),
        "Timelimit": lambda: sacct_time(limit or None),
        "TimelimitRaw": lambda: int(limit // 60) if limit else "UNLIMITED",
        "User": lambda: job.get("user", ""),
    }


def rows(jobs: Iterable[dict], fields: list[tuple[str, int]], now: float | None = None) -> list[list[str]]:
    now = time.time() if now is None else now
    out = []
    for job in jobs:
        values = _values(job, now)
        out.append([str(values[n]()) if n in values else "" for n, _ in fields])
    return out


def render(jobs: Iterable[dict], fields: list[tuple[str, int]], header: bool = True,
           delimiter: str | None = None, ending: bool = False, now: float | None = None) -> list[str]:
    """sacct's lines: with `delimiter` (-p/-P) the values between it (and after the last with
    `ending`, as -p); else each padded to its width, right-justified (left for a negative
    width), a value too long cut to the width with '+' last, as Slurm prints them."""
    body = rows(jobs, fields, now)
    names = [n for n, _ in fields]
    if delimiter is not None:
        end = delimiter if ending else ""
        return [delimiter.join(r) + end for r in ([names] if header else []) + body]

    def cell(v: str, w: int) -> str:
        width = abs(w) or 10
        if len(v) > width:
            v = v[:width - 1] + "+"
        return v.ljust(width) if w < 0 else v.rjust(width)

    lines = []
    if header:
        lines += [" ".join(cell(n, w) for n, w in fields),
                  " ".join("-" * (abs(w) or 10) for _, w in fields)]
    return lines + [" ".join(cell(v, w) for v, (_, w) in zip(r, fields, strict=True)) for r in body]

"""sinfo: trainyard's queues as Slurm partitions and its nodes in Slurm's node states."""

from __future__ import annotations

import click

from .api import call, client, fail, format_lines, time_limit
from .hostlist import compress

SINFO_DEFAULT = "%#P %.5a %.10l %.6D %.6t %N"
SINFO_NODES = "%#N %.6D %#P %.6t"
HEADERS = {"P": "PARTITION", "R": "PARTITION", "a": "AVAIL", "l": "TIMELIMIT", "D": "NODES",
           "t": "STATE", "T": "STATE", "N": "NODELIST", "n": "HOSTNAMES", "c": "CPUS",
           "m": "MEMORY", "G": "GRES", "f": "AVAIL_FEATURES", "E": "REASON", "o": "NODE_ADDR"}
# Slurm's long state names of the compact ones sinfo prints by default
LONG = {"idle": "idle", "mix": "mixed", "alloc": "allocated", "drng": "draining", "drain": "drained",
        "down": "down", "boot": "powering_up", "unk": "unknown"}


def node_state(node: dict, busy: set[str]) -> str:
    """The compact sinfo state of a trainyard node: what it is doing and whether it takes work."""
    state = node["state"]
    if state == "DOWN" or (state == "UP" and not node.get("connected", True)):
        return "down"
    if state == "DRAINED" or (state == "DRAINING" and node["name"] not in busy):
        return "drain"
    if state == "DRAINING":
        return "drng"
    if state in ("PROVISIONING", "BOOTSTRAPPING"):
        return "boot"
    if state != "UP":
        return "unk"
    total, used = node.get("gpus_total") or 0, node.get("gpus_used") or 0
    if node["name"] not in busy and not used:
        return "idle"
    return "alloc" if total and used >= total else "mix"


def serves(queue: dict, node: dict) -> bool:
    """Whether a node serves a queue: it carries the labels the queue asks for ([queues.X] nodes)."""
    labels = node.get("labels") or {}
    return all(labels.get(k) == v for k, v in (queue.get("nodes") or {}).items())


def _resolve(names: str, queues: list[dict]) -> list[dict]:
    by_name = {q["name"]: q for q in queues}
    by_name.update({a: q for q in queues for a in q.get("aliases") or ()})
    out = []
    for name in names.split(","):
        if name not in by_name:
            known = ", ".join(sorted(by_name))
            fail(f"invalid partition name {name!r}; partitions (queues and aliases): {known}", prog="sinfo")
        out.append(by_name[name])
    return out


def _features(node: dict) -> str:
    labels = node.get("labels") or {}
    return ",".join(k if not v else f"{k}={v}" for k, v in sorted(labels.items())) or "(null)"


def rows(queues: list[dict], nodes: list[dict], busy: set[str], per_node: bool,
         long_states: bool) -> list[dict[str, str]]:
    """One row per partition and state (per node with -N), in queue order, nodes by name."""
    out = []
    for q in queues:
        groups: dict[str, list[dict]] = {}
        for n in sorted((n for n in nodes if serves(q, n)), key=lambda n: n["name"]):
            groups.setdefault(node_state(n, busy), []).append(n)
        for state, members in groups.items():
            for group in ([[n] for n in members] if per_node else [members]):
                names = [n["name"] for n in group]
                word = LONG.get(state, state) if long_states else state
                name = q["name"] + ("*" if q["name"] == "default" else "")
                out.append({
                    "P": name, "R": q["name"], "a": "up" if q.get("state") == "open" else "inact",
                    "l": time_limit(q.get("max_time_limit")).lower() if q.get("max_time_limit")
                    else "infinite", "D": str(len(group)), "t": word, "T": LONG.get(state, state),
                    "N": compress(names), "n": compress(names), "c": str(group[0].get("cpus", 0)),
                    "m": str(group[0].get("mem_mb", 0)), "o": group[0].get("address", ""),
                    "G": f"gpu:{group[0].get('gpus_total', 0)}" if group[0].get("gpus_total") else "(null)",
                    "f": _features(group[0]), "E": group[0].get("reason") or "none",
                })
    return out


@click.command("sinfo", context_settings={"help_option_names": ["--help"]})
@click.option("-o", "--format", "fmt", help="Output format (Slurm's %-fields).")
@click.option("-N", "--Node", "per_node", is_flag=True, help="One line per node.")
@click.option("-p", "--partition", help="Only these partitions (comma list; aliases work).")
@click.option("-h", "--noheader", is_flag=True, help="No header line.")
@click.option("-l", "--long", "long_states", is_flag=True, help="Long state names.")
@click.option("-t", "--states", help="Only nodes in these states (idle,mix,alloc,drain,down,...).")
@click.option("-R", "--list-reasons", is_flag=True, help="Why nodes are down or drained.")
def sinfo(fmt, per_node, partition, noheader, long_states, states, list_reasons):
    """Partitions (trainyard's queues) and the state of their nodes."""
    c = client()
    queues = call(c.queues, prog="sinfo")
    if partition:
        queues = _resolve(partition, queues)
    nodes = call(c.nodes, prog="sinfo")
    busy = {a["node"] for j in call(c.jobs, prog="sinfo") if j["state"] == "RUNNING"
            for a in j.get("allocation") or ()}
    table = rows(queues, nodes, busy, per_node, long_states)
    if states:
        wanted = {s.strip().lower() for s in states.split(",")}
        table = [r for r in table if r["t"] in wanted or r["T"] in wanted]
    if list_reasons:
        table = [r for r in table if r["T"] in ("down", "drained", "draining")]
        fmt = fmt or "%20E %9u %19H %N"
    fmt = fmt or (SINFO_NODES if per_node else SINFO_DEFAULT)
    headers = {**HEADERS, "t": "STATE"}
    for line in format_lines(fmt, [lambda x, r=r: r.get(x, "") for r in table], headers, not noheader):
        click.echo(line)

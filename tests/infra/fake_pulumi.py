"""A stand-in for the `pulumi` CLI: records its arguments and answers like the CLI, for the Automation API.

It keeps stacks, their config and their deployed resources in a JSON state file
($FAKE_PULUMI_STATE), appends every invocation to $FAKE_PULUMI_LOG (JSON lines), and for
`preview` and `up` "runs" the program by deriving resources from the trainyard config: it
streams engine events to --event-log (gRPC like CLI 3.206+, or a file like older ones),
prints the text the CLI prints, and exports `inventory` built by infra.inventory.

Knobs: FAKE_PULUMI_VERSION (default 3.272.0), FAKE_PULUMI_FAIL=up|preview (the operation
fails on the first instance it creates, as EC2 does when it has no capacity).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

STATE = Path(os.environ["FAKE_PULUMI_STATE"])
LOG = os.environ.get("FAKE_PULUMI_LOG")
VERSION = os.environ.get("FAKE_PULUMI_VERSION", "3.272.0")
NS = "trainyard:"


def load() -> dict:
    return json.loads(STATE.read_text()) if STATE.exists() else {"current": None, "stacks": {}}


def save(state: dict) -> None:
    STATE.write_text(json.dumps(state, indent=2))


def fail(message: str, code: int = 255) -> None:
    print(f"error: {message}", file=sys.stderr)
    sys.exit(code)


def take(args: list[str], flag: str) -> str | None:
    if flag in args:
        i = args.index(flag)
        value = args[i + 1]
        del args[i : i + 2]
        return value
    return None


def stack_of(state: dict, args: list[str]) -> tuple[str, dict]:
    name = take(args, "--stack") or state["current"]
    if name is None:
        fail("no stack selected; please use `pulumi stack select`")
    if name not in state["stacks"]:
        fail(f"no stack named '{name}' found")
    return name, state["stacks"][name]


# -- config --------------------------------------------------------------------------------------


def config_json(stack: dict) -> dict:
    out = {}
    for key, value in stack["config"].items():
        entry = {"value": value if isinstance(value, str) else json.dumps(value), "secret": False}
        if not isinstance(value, str):
            entry["objectValue"] = value
        out[key] = entry
    return out


def set_path(config: dict, path: str, text: str) -> None:
    """`config set --path 'trainyard:pools[1].count' 4`: integers and booleans are typed, like the CLI."""
    import re

    head, rest = re.match(r"^([^\[.]+:[^\[.]+)(.*)$", path).groups()
    value: object = text
    if re.fullmatch(r"-?\d+", text):
        value = int(text)
    elif text in ("true", "false"):
        value = text == "true"
    steps = re.findall(r"\[(\d+)\]|\.([A-Za-z0-9_]+)", rest)
    if not steps:
        config[head] = text
        return
    node = config[head]
    for index, key in steps[:-1]:
        node = node[int(index)] if index else node[key]
    index, key = steps[-1]
    if index:
        node[int(index)] = value
    else:
        node[key] = value


# -- the "program" ---------------------------------------------------------------------------------


def desired(stack_name: str, config: dict) -> tuple[list[tuple[str, str]], list[dict]]:
    """The resources and the inventory the real program would produce for this config."""
    from infra import inventory
    from infra.config import ConfigError, parse_config, raw_from_strings

    strings = {k[len(NS) :]: (v if isinstance(v, str) else json.dumps(v)) for k, v in config.items() if k.startswith(NS)}
    try:
        cfg = parse_config(raw_from_strings(strings), default_name=stack_name)
    except ConfigError as exc:
        print(f"error: {exc}")
        sys.exit(255)
    c = cfg.name
    resources = [("pulumi:pulumi:Stack", f"trainyard-{stack_name}"), ("trainyard:infra:GpuCluster", c)]
    nodes: list[dict] = []
    if cfg.aws_pools:
        resources += [
            ("aws:ec2/vpc:Vpc", f"{c}-vpc"),
            ("aws:ec2/securityGroup:SecurityGroup", f"{c}-nodes"),
            ("aws:ec2/keyPair:KeyPair", f"{c}-key"),
            ("aws:iam/role:Role", f"{c}-node"),
        ]
    n = 0
    for pool in cfg.pools:
        if pool.kind == "onprem":
            nodes += inventory.onprem_nodes(pool)
            continue
        resources.append(("aws:ec2/launchTemplate:LaunchTemplate", f"{c}-{pool.name}-lt"))
        for i in range(pool.count):
            n += 1
            resources.append(("aws:ec2/instance:Instance", f"{c}-{pool.node_name(i)}"))
            nodes.append(inventory.aws_node(pool, i, f"198.51.100.{n}"))
    return resources, nodes


def urn(stack: str, typ: str, name: str) -> str:
    return f"urn:pulumi:{stack}::trainyard::{typ}::{name}"


class Events:
    def __init__(self, target: str | None):
        self.target = target
        self.items: list[dict] = []

    def add(self, **event) -> None:
        self.items.append({"sequence": len(self.items) + 1, "timestamp": int(time.time()), **event})

    def flush(self) -> None:
        if not self.target:
            return
        lines = [json.dumps(e) for e in self.items] + [json.dumps({"sequence": 0, "timestamp": 0, "cancelEvent": {}})]
        if self.target.startswith("tcp://"):
            import grpc
            from pulumi.runtime.proto import events_pb2, events_pb2_grpc

            with grpc.insecure_channel(self.target[len("tcp://") :]) as channel:
                stub = events_pb2_grpc.EventsStub(channel)
                stub.StreamEvents(iter([events_pb2.EventRequest(event=line) for line in lines]))
        else:
            with open(self.target, "a") as f:
                f.writelines(line + "\n" for line in lines)


def operate(kind: str, args: list[str]) -> None:
    state = load()
    name, stack = stack_of(state, args)
    events = Events(take(args, "--event-log"))
    resources, nodes = desired(name, stack["config"])
    wanted = {urn(name, t, n): t for t, n in resources}
    deployed = dict(stack.get("deployed", {}))
    steps = [(u, t, "same" if u in deployed else "create") for u, t in wanted.items()]
    steps += [(u, t, "delete") for u, t in deployed.items() if u not in wanted]
    preview = kind == "preview"
    verb = "Previewing update" if preview else "Updating"
    print(f"{verb} ({name})")
    events.add(preludeEvent={"config": {}})
    failing = os.environ.get("FAKE_PULUMI_FAIL") == kind
    changes: dict[str, int] = {}
    for u, t, op in steps:
        meta = {"op": op, "urn": u, "type": t, "provider": ""}
        events.add(resourcePreEvent={"metadata": meta, "planning": preview})
        if failing and op == "create" and t == "aws:ec2/instance:Instance":
            events.add(diagnosticEvent={"urn": u, "message": "InsufficientInstanceCapacity: no capacity in us-east-1a\n",
                                        "color": "never", "severity": "error"})
            events.add(resOpFailedEvent={"metadata": meta, "status": 1, "steps": 1})
            events.flush()
            print(f"    {t} {u.rsplit('::', 1)[-1]} **{op}ing failed** error: InsufficientInstanceCapacity")
            print("error: update failed")
            sys.exit(255)
        if not preview:
            events.add(resOutputsEvent={"metadata": meta, "planning": False})
        if op != "same":
            print(f"    {'+' if op == 'create' else '-'} {t} {u.rsplit('::', 1)[-1]} {op}")
        changes[op] = changes.get(op, 0) + 1
    events.add(summaryEvent={"maybeCorrupt": False, "durationSeconds": 1, "resourceChanges": changes, "PolicyPacks": {}})
    print("Resources:\n" + "\n".join(f"    {n} {op}" for op, n in changes.items()))
    if not preview:
        stack["deployed"] = wanted
        stack["outputs"] = {"cluster": resources[1][1], "inventory": nodes}
        stack.setdefault("history", []).insert(0, {
            "kind": "update", "startTime": "2025-01-01T00:00:00.000Z", "endTime": "2025-01-01T00:00:01.000Z",
            "message": "", "environment": {}, "config": {}, "result": "succeeded",
            "version": len(stack.get("history", [])) + 1, "resourceChanges": changes,
        })
        save(state)
    events.flush()


# -- dispatch --------------------------------------------------------------------------------------


def main(argv: list[str]) -> None:
    if LOG:
        with open(LOG, "a") as f:
            f.write(json.dumps({"argv": argv}) + "\n")
    args = [a for a in argv if a != "--non-interactive"]
    if args == ["version"]:
        print(f"v{VERSION}")
        return
    state = load()
    if args[:2] == ["stack", "select"]:
        name = take(args, "--stack") or args[2]
        if name not in state["stacks"]:
            fail(f"no stack named '{name}' found")
        state["current"] = name
        save(state)
    elif args[:2] == ["stack", "init"]:
        name = args[2]
        if name in state["stacks"]:
            fail(f"stack '{name}' already exists")
        state["stacks"][name] = {"config": {}, "deployed": {}}
        state["current"] = name
        save(state)
    elif args[:3] == ["stack", "ls", "--json"]:
        print(json.dumps([
            {"name": n, "current": n == state["current"], "updateInProgress": False, "resourceCount": len(s.get("deployed", {}))}
            for n, s in state["stacks"].items()
        ]))
    elif args[:2] == ["stack", "output"]:
        rest = args[2:]
        _, stack = stack_of(state, rest)
        print(json.dumps(stack.get("outputs", {})))
    elif args[:2] == ["stack", "history"]:
        rest = args[2:]
        _, stack = stack_of(state, rest)
        print(json.dumps(stack.get("history", [])[:1]))
    elif args[:1] == ["config"] and (len(args) == 1 or args[1].startswith("--")):
        _, stack = stack_of(state, args[1:])
        print(json.dumps(config_json(stack)))
    elif args[:2] == ["config", "get"]:
        rest = args[2:]
        _, stack = stack_of(state, rest)
        key = [a for a in rest if not a.startswith("--")][0]
        if key not in stack["config"]:
            fail(f"configuration key '{key}' not found for stack")
        print(json.dumps(config_json(stack)[key]))
    elif args[:2] == ["config", "set"]:
        rest = args[2:]
        value = rest[rest.index("--") + 1]
        rest = rest[: rest.index("--")]
        path = "--path" in rest
        _, stack = stack_of(state, rest)
        key = [a for a in rest if not a.startswith("--")][0]
        if path:
            set_path(stack["config"], key, value)
        else:
            stack["config"][key] = value
        save(state)
    elif args[:1] == ["preview"]:
        operate("preview", args[1:])
    elif args[:1] == ["up"]:
        operate("up", args[1:])
    else:
        fail(f"fake pulumi does not know `{' '.join(args)}`")


if __name__ == "__main__":
    main(sys.argv[1:])

"""The stand-in `pulumi`, with instances that answer on loopback: the inventory names their ports.

$FAKE_PULUMI_ADDRESSES is a JSON file {node name: port}; a node listed there is exported at
127.0.0.1:PORT (a simulated node the test started), the others as fake_pulumi.py exports them.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import fake_pulumi  # noqa: E402

from infra import inventory  # noqa: E402

_aws_node = inventory.aws_node


def aws_node(pool, index, address):
    node = _aws_node(pool, index, address)
    ports = json.loads(Path(os.environ["FAKE_PULUMI_ADDRESSES"]).read_text())
    if node["name"] in ports:
        node.update(address="127.0.0.1", ssh_port=ports[node["name"]])
    return node


inventory.aws_node = aws_node

if __name__ == "__main__":
    fake_pulumi.main(sys.argv[1:])

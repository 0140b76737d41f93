import time
from tests.nodes.test_containers import lab, container_node, bundle_with_containers  # noqa

def test_debug(container_node, users, lab):
    node, link, _ = container_node()
    link.send(op="launch", key="1.0", job_id=1, user="alice", gpus=[1, 3], image=lab["image"],
              argv=["sh", "-c", "id -u; ls /dev"])
    time.sleep(5)
    r = node.run("cd /var/lib/trainyard/jobs && cp -a 1.0 x && rm -f x/log x/rc x/wpid && python3 /var/lib/trainyard/agent-*.pyz wrap /var/lib/trainyard/jobs/x; ls x; cat x/log")
    print(r.stdout, r.stderr)
    assert 0

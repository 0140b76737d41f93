"""Each job in its own cgroup: only its GPUs, its memory, and nothing left behind when it ends."""

from tests.conftest import wait_for
from tests.nodes.conftest import job_pids

OPEN_GPUS = """
import errno, os
for i in range(4):
    try:
        os.close(os.open(f"/dev/nvidia{i}", os.O_RDWR))
        print(i, "opened")
    except OSError as e:
        print(i, errno.errorcode[e.errno])
"""


def test_a_job_opens_only_its_own_gpu(node_factory, link_factory):
    node = node_factory(gpus=4)
    link = link_factory(node)
    link.wait_up()
    link.send(op="launch", key="1.0", job_id=1, user="alice", gpus=[1],
              argv=["python3", "-c", OPEN_GPUS])
    assert link.wait_for("exited", "1.0")["rc"] == 0
    # ENXIO: allowed, but no driver behind the fake device; EPERM: the devices cgroup said no
    assert link.request(op="log", key="1.0")["data"].split("\n")[:4] == [
        "0 EPERM", "1 ENXIO", "2 EPERM", "3 EPERM"]


def test_a_job_over_its_memory_ends_out_of_memory(node_factory, link_factory):
    node = node_factory()
    link = link_factory(node)
    link.wait_up()
    link.send(op="launch", key="2.0", job_id=2, user="bob", mem_mb=64,
              argv=["python3", "-c", "x = bytearray(512 * 2**20); print('survived')"])
    end = link.wait_for("exited", "2.0")
    assert end["oom"] is True and end["rc"] == 137
    assert "survived" not in link.request(op="log", key="2.0")["data"]
    link.send(op="launch", key="3.0", job_id=3, user="bob", mem_mb=256,
              argv=["python3", "-c", "x = bytearray(32 * 2**20); print('fits')"])
    end = link.wait_for("exited", "3.0")
    assert end["oom"] is False and end["rc"] == 0


def test_cancel_ends_every_process_even_a_double_forked_one(node_factory, link_factory):
    node = node_factory()
    link = link_factory(node)
    link.wait_up()
    # the child leaves the job's session and is orphaned: only its cgroup still knows it
    link.send(op="launch", key="4.0", job_id=4, user="alice",
              argv=["sh", "-c", "(setsid sh -c 'sleep 401.5 &' &); exec sleep 402.5"])
    link.wait_for("started", "4.0")
    wait_for(lambda: job_pids(node, "401.5") and job_pids(node, "402.5"), 10, what="both sleeps")
    link.send(op="signal", key="4.0", sig="TERM")
    assert link.wait_for("exited", "4.0")["rc"] == 143
    wait_for(lambda: not job_pids(node, "401.5"), 5, what="the double-forked sleep to end")
    assert not job_pids(node, "402.5")


def test_a_job_that_ends_takes_what_it_left_running_with_it(node_factory, link_factory):
    node = node_factory()
    link = link_factory(node)
    link.wait_up()
    link.send(op="launch", key="5.0", job_id=5, user="bob",
              argv=["sh", "-c", "setsid sleep 403.5 > /dev/null 2>&1 & exit 3"])
    assert link.wait_for("exited", "5.0")["rc"] == 3
    assert not job_pids(node, "403.5")

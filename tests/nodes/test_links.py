"""Getting the agent onto a node: node-local state, no SFTP, and a reason for every failure."""

import asyncio
import json
import os
import stat
import subprocess
import sys
import time

import asyncssh

from scheduler import models as m
from scheduler.daemon.clock import ManualClock
from scheduler.daemon.links import NodeLinks
from scheduler.nodes import NodeError, SshSettings, SshTarget, agent_bundle, connect
from scheduler.protocol import PROTOCOL_VERSION
from tests.conftest import free_port


def test_two_nodes_sharing_a_home_keep_separate_state(node_factory, link_factory, shared_home):
    n1, n2 = node_factory("n1"), node_factory("n2")
    l1, l2 = link_factory(n1), link_factory(n2)
    assert l1.wait_up()["root"] == l2.wait_up()["root"] == "/var/lib/trainyard"  # node-local
    for link in (l1, l2):
        link.send(op="launch", key="1.0", job_id=1, user="alice", argv=["sh", "-c", "exit 0"])
    l1.send(op="launch", key="2.0", job_id=2, user="alice", argv=["sh", "-c", "exit 5"])
    assert l1.wait_for("exited", "2.0")["rc"] == 5
    l2.send(op="sync", id=1)
    assert [j["key"] for j in l2.wait_for("jobs")["jobs"]] == ["1.0"]  # n1's 2.0 is not here
    assert not any(shared_home.iterdir()), "nothing of the agents' state belongs in the home"
    ident = json.loads(n2.run("cat /var/lib/trainyard/node-identity").stdout)
    assert ident["node"] == n2.name


def test_an_agent_dir_shared_with_another_node_is_refused_with_the_reason(node_factory, link_factory):
    n1, n2 = node_factory("n1"), node_factory("n2")
    link_factory(n1, agent_dir="/root/trainyard-state").wait_up()
    reason = link_factory(n2, agent_dir="/root/trainyard-state").wait_down_reason()
    assert f"holds the state of node '{n1.name}'" in reason and "shared with another node" in reason


def test_a_node_without_sftp_gets_the_agent_over_an_exec_channel(node_factory, link_factory):
    node = node_factory(sftp=False)
    hello = link_factory(node).wait_up()
    assert hello["protocol"] == PROTOCOL_VERSION
    _, digest = agent_bundle()
    mode = node.run(f"stat -c %a /var/lib/trainyard/agent-{digest}.pyz").stdout.strip()
    assert mode == "600"


def test_a_node_without_python3_says_so(node_factory, link_factory, base):
    empty = base / "empty-bin"
    empty.mkdir()
    for tool in ("sh", "cat", "mv"):
        os.symlink(f"/bin/{tool}", empty / tool)
    node = node_factory(path=str(empty))
    assert "python3 is not installed on the node" in link_factory(node).wait_down_reason()


def _fake_python(base, name: str, body: str) -> str:
    d = base / name
    d.mkdir()
    py = d / "python3"
    py.write_text("#!/bin/sh\n" + body)
    py.chmod(py.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return f"{d}:/usr/bin:/bin"


def test_a_node_with_an_old_python3_says_so(node_factory, link_factory, base):
    path = _fake_python(base, "old", 'case "$1" in -V) echo "Python 3.6.9";; *) exit 1;; esac\n')
    reason = link_factory(node_factory(path=path)).wait_down_reason()
    assert "python3 on the node is Python 3.6.9; the agent needs Python 3.8 or newer" in reason


def test_an_agent_that_crashes_shows_the_tail_of_its_stderr(node_factory, link_factory, base):
    path = _fake_python(base, "crashy", textwrap_crash())
    reason = link_factory(node_factory(path=path)).wait_down_reason()
    assert reason.startswith("the agent exited with status 1 before it said hello: ")
    assert "ImportError: libcuda went away" in reason and "\n" not in reason


def textwrap_crash() -> str:
    return ('case "$1" in *.pyz) echo "Traceback (most recent call last):" >&2; '
            'echo "ImportError: libcuda went away" >&2; exit 1;; esac\nexec /usr/bin/python3 "$@"\n')


def test_an_agent_of_another_protocol_version_is_replaced(node_factory, link_factory):
    node = node_factory()
    _, digest = agent_bundle()
    old = '#!/usr/bin/env python3\nprint(\'{"ev": "hello", "protocol": 1}\', flush=True)\n'
    node.run(f"mkdir -p /var/lib/trainyard && cat > /var/lib/trainyard/agent-{digest}.pyz <<'EOF'\n{old}EOF")
    link = link_factory(node)
    assert link.wait_up()["protocol"] == PROTOCOL_VERSION


def test_an_agent_dir_that_is_not_writable_is_refused_with_the_reason(node_factory, link_factory, base):
    ro = base / "read-only"
    ro.mkdir()
    node = node_factory(setup=f"mount -t tmpfs -o ro tmpfs {ro}")
    reason = link_factory(node, agent_dir=f"{ro}/state").wait_down_reason()
    assert reason == f"cannot create the agent directory {ro}/state: Read-only file system"


def test_a_node_without_cgroups_says_it_cannot_fence(node_factory, link_factory):
    node = node_factory(setup="umount -R -l /sys/fs/cgroup")
    hello = link_factory(node).wait_up()
    assert hello["fencing"] == {"cgroup": "none", "devices": False, "memory": False, "cpu": False,
                                "pids": False,
                                "reason": "no cgroup file system is mounted: jobs cannot be fenced"}


def test_a_users_map_naming_root_is_refused_when_the_daemon_starts(base):
    config = base / "trainyard.toml"
    config.write_text('[users]\nalice = "root"\n')
    r = subprocess.run([sys.executable, "-m", "scheduler.cli", "daemon", "--config", str(config),
                        "--listen", "127.0.0.1:1"], capture_output=True, text=True, timeout=60,
                       env={**os.environ, "HOME": str(base), "TRAINYARD_HOME": str(base / "state")})
    assert r.returncode == 2
    assert "users.alice" in r.stderr
    assert "jobs never run as 'root'; map the user to their own Unix account" in r.stderr


def _ciphers(node, key, base) -> tuple[str, str]:
    """The ciphers a link to `node` runs with, each way, as the daemon connects."""
    known = base / f"known_hosts-cipher-{node.name}"
    pub = (node.host_key.parent / (node.host_key.name + ".pub")).read_text().split()
    known.write_text(f"[127.0.0.1]:{node.port} {pub[0]} {pub[1]}\n")

    async def ask():
        conn = await connect(SshTarget(node.name, "127.0.0.1", node.port, "root", str(key)),
                             SshSettings(str(known), connect_timeout_s=5))
        try:
            return conn.get_extra_info("send_cipher"), conn.get_extra_info("recv_cipher")
        finally:
            conn.close()
            await conn.wait_closed()

    return asyncio.run(ask())


def test_links_run_aes_gcm_where_sshd_offers_it_and_what_a_stricter_sshd_allows(node_factory, client_key, base):
    # OpenSSH's own first choice is chacha20-poly1305, which costs the daemon several times
    # more per packet; the daemon asks for AES-GCM first
    assert _ciphers(node_factory("default-ciphers"), client_key, base) == (
        "aes128-gcm@openssh.com", "aes128-gcm@openssh.com")
    only = node_factory("chacha-only", ciphers="chacha20-poly1305@openssh.com")
    assert _ciphers(only, client_key, base) == (
        "chacha20-poly1305@openssh.com", "chacha20-poly1305@openssh.com")
    ctr = node_factory("ctr-only", ciphers="aes256-ctr")
    assert _ciphers(ctr, client_key, base) == ("aes256-ctr", "aes256-ctr")


async def handshake(node, key, known) -> str:
    """One connection to `node` as root with the private key file `key`, checking host keys
    against `known`: "connected", or why not."""
    try:
        conn = await connect(SshTarget(node.name, "127.0.0.1", node.port, "root", str(key)),
                             SshSettings(str(known), connect_timeout_s=5))
    except NodeError as e:
        return str(e)
    conn.close()
    await conn.wait_closed()
    return "connected"


def test_an_edit_of_the_pinned_host_keys_counts_at_the_next_handshake(node_factory, client_key, base):
    # the daemon parses its known_hosts once per change, not once per connection: a key
    # replaced by hand must still be the one checked next, even within the same instant
    node = node_factory("repinned")
    known = base / "known_hosts-repinned"
    pub = (node.host_key.parent / (node.host_key.name + ".pub")).read_text().split()
    other = asyncssh.generate_private_key("ssh-ed25519").export_public_key().decode().split()
    others = "".join(f"[10.0.{i // 250}.{i % 250}]:22 {other[0]} {other[1]}\n" for i in range(300))

    def pin(key) -> None:
        known.write_text(others + f"[127.0.0.1]:{node.port} {key[0]} {key[1]}\n")

    async def sequence() -> list[str]:
        seen = []
        for key in (other, pub, other, pub):
            pin(key)  # same length each time: only the bytes differ
            seen.append(await handshake(node, client_key, known))
        known.write_bytes(b"\xff\xfe not text\n")
        seen.append(await handshake(node, client_key, known))
        return seen

    refused, connected, refused_again, connected_again, unreadable = asyncio.run(sequence())
    assert refused.startswith("host key verification failed") and refused_again == refused
    assert connected == connected_again == "connected"
    assert unreadable.startswith(f"cannot read the pinned host keys in {known}")


def test_a_replaced_client_key_is_the_one_the_next_handshake_uses(node_factory, client_key, base):
    # the daemon loads its key once per change of the file, not once per connection
    node = node_factory("rekeyed")
    known = base / "known_hosts-rekeyed"
    pub = (node.host_key.parent / (node.host_key.name + ".pub")).read_text().split()
    known.write_text(f"[127.0.0.1]:{node.port} {pub[0]} {pub[1]}\n")
    key = base / "daemon-key-rekeyed"
    authorized = client_key.read_bytes()
    stranger = asyncssh.generate_private_key("ssh-ed25519").export_private_key()

    async def sequence() -> list[str]:
        seen = []
        for data in (authorized, stranger, authorized):
            key.write_bytes(data)  # in place: the same file (the two keys' files need not be one size)
            key.chmod(0o600)
            seen.append(await handshake(node, key, known))
        return seen

    first, refused, again = asyncio.run(sequence())
    assert first == again == "connected"
    assert refused != "connected" and "denied" in refused.lower(), refused


def test_an_agent_that_never_says_hello_fails_the_attempt_and_frees_its_turn(node_factory, link_factory, base):
    # a python that starts and then hangs (as on a hung NFS mount) must not hold one of the
    # daemon's `connect_concurrency` handshake turns for good: the attempt fails, with why
    path = _fake_python(base, "hung", 'case "$1" in *.pyz) exec sleep 600;; esac\nexec /usr/bin/python3 "$@"\n')
    link = link_factory(node_factory(path=path), hello_timeout_s=1.5)
    t0 = time.monotonic()
    reason = link.wait_down_reason(timeout=30)
    assert reason == ("the agent started but did not say hello within 1.5 s (hello_timeout_s): "
                      "is a file system on the node hung?")
    assert time.monotonic() - t0 >= 1.5
    assert link.link.handshakes._value == 1  # the turn is back: the next node may handshake
    assert link.wait_down_reason(timeout=30) == reason  # and it is tried again, not given up


def test_a_node_waiting_for_its_turn_to_handshake_is_not_unreachable_yet(node_factory, client_key, base):
    # a new leader takes over 1,000 nodes 32 handshakes at a time; a node's grace clock
    # (node_grace_s, then its jobs end NODE_FAIL) starts when it is first tried, not while it
    # waits in that queue. One that fails keeps the clock of its first failed attempt.
    live = node_factory("queued-live")
    known = base / "known_hosts-queued"
    pub = (live.host_key.parent / (live.host_key.name + ".pub")).read_text().split()
    known.write_text(f"[127.0.0.1]:{live.port} {pub[0]} {pub[1]}\n")
    dead_port = free_port()  # nothing listens there: each attempt is refused at once

    async def scenario():
        clock = ManualClock()
        settings = SshSettings(str(known), connect_timeout_s=5, connect_concurrency=1,
                               reconnect_max_backoff_s=0.3, telemetry_interval_s=0)
        links = NodeLinks(settings, str(client_key), clock, lambda *a: None, lambda *a: None)
        await links.handshakes.acquire()  # another node's handshake holds the only turn
        try:
            for name, port in (("live", live.port), ("dead", dead_port)):
                links.start(m.Node(name=name, address="127.0.0.1", port=port, user="root", gpus_total=4))
            await asyncio.sleep(0.5)
            clock.advance(600)  # far past any grace, still in the queue
            queued = dict(links.unreachable_since), links.problem("live"), links.problem("dead")
        finally:
            links.handshakes.release()
        first_try = clock.time()
        for _ in range(400):
            if links.connected("live") and "dead" in links.errors:
                break
            await asyncio.sleep(0.05)
        after = (links.connected("live"), dict(links.unreachable_since), links.problem("live"),
                 links.problem("dead"))
        clock.advance(30)
        for _ in range(100):  # a later attempt does not restart the dead node's clock
            await asyncio.sleep(0.05)
        later = dict(links.unreachable_since)
        await links.stop_all()
        return queued, first_try, after, later

    queued, first_try, (live_up, after, live_problem, dead_problem), later = asyncio.run(scenario())
    waiting = "waiting for its turn to connect (connect_concurrency = 1)"
    assert queued == ({}, waiting, waiting)  # what `trainyard nodes` shows for them meanwhile
    assert live_up and live_problem == ""
    assert "connection refused (is sshd running on that port?)" in dead_problem, dead_problem
    assert after == {"dead": first_try}
    assert later == {"dead": first_try}


def test_a_new_leader_tries_the_nodes_running_the_most_jobs_first_and_long_down_ones_last(client_key, base):
    # a takeover queues every node behind connect_concurrency handshakes: the nodes with
    # running jobs go first (their ends are reported soonest), a node DOWN for long goes last
    # (it is likely to hold a turn until connect_timeout_s)
    nodes = {"a-idle-up": (0, m.UP), "b-busy": (5, m.UP), "c-down": (0, m.DOWN),
             "d-one-job": (1, m.DRAINING), "e-busiest": (9, m.UP), "f-idle-drained": (0, m.DRAINED)}
    port = free_port()  # nothing listens: each attempt is refused at once and frees its turn

    async def scenario():
        settings = SshSettings(str(base / "known_hosts-none"), connect_timeout_s=5, connect_concurrency=1,
                               reconnect_max_backoff_s=30, telemetry_interval_s=0)
        links = NodeLinks(settings, str(client_key), ManualClock(), lambda *a: None, lambda *a: None)
        tried: list[str] = []
        first_attempt = links._on_attempt
        links._on_attempt = lambda name: (tried.append(name), first_attempt(name))
        await links.handshakes.acquire()
        try:
            links.start_all([m.Node(name=n, address="127.0.0.1", port=port, user="root", gpus_total=8,
                                    state=state) for n, (_, state) in sorted(nodes.items())],
                            lambda name: nodes[name][0])
            await asyncio.sleep(0.2)
            waiting = {n: links.problem(n) for n in nodes}
        finally:
            links.handshakes.release()
        for _ in range(200):
            if len(tried) >= len(nodes):
                break
            await asyncio.sleep(0.05)
        await links.stop_all()
        return waiting, tried[:len(nodes)]

    waiting, tried = asyncio.run(scenario())
    assert set(waiting.values()) == {"waiting for its turn to connect (connect_concurrency = 1)"}
    assert tried == ["e-busiest", "b-busy", "d-one-job", "a-idle-up", "c-down", "f-idle-drained"]

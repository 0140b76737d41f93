"""The sudo privilege mode: an unprivileged login that one sudo rule lets start exactly the agent.

The rule is the trainyard_node role's own template, rendered with the role's variables and
checked by visudo; the bundle is installed root-owned where the role puts it, inside each
node's private /usr/local/lib/trainyard.
"""

from __future__ import annotations

import os
import pwd
import subprocess
from pathlib import Path

import jinja2
import pytest
import yaml

from scheduler.nodes import INSTALLED_AGENT, agent_bundle
from tests.conftest import ROOT, require_or_skip

ROLE = ROOT / "playbooks" / "roles" / "trainyard_node"
LOGIN = "tyagent"  # the daemon's login account on these nodes (the role's default is trainyard)


def render_rule(login: str) -> str:
    variables = yaml.safe_load((ROLE / "vars" / "main.yml").read_text())
    template = jinja2.Template((ROLE / "templates" / "sudoers.j2").read_text(),
                               undefined=jinja2.StrictUndefined)
    return template.render(ansible_managed="trainyard tests", trainyard_node_ssh_user=login,
                           **variables) + "\n"


@pytest.fixture(scope="module")
def sudo_rule(users):
    """The login account and the role's sudo rule for it, in /etc/sudoers.d (removed after)."""
    require_or_skip(Path("/usr/bin/sudo").exists() and Path("/usr/sbin/visudo").exists(),
                    "sudo is not installed (apt-get install sudo)")
    try:
        pwd.getpwnam(LOGIN)
        made = False
    except KeyError:
        subprocess.run(["useradd", "-m", "-s", "/bin/sh", LOGIN], check=True, capture_output=True)
        made = True
    # a locked password ("!") makes sshd refuse the account without PAM; "*" only disables it
    subprocess.run(["usermod", "-p", "*", LOGIN], check=True, capture_output=True)
    rule = Path(f"/etc/sudoers.d/trainyard-tests-{os.getpid()}")
    staged = rule.with_name(rule.name + ".new")  # sudo skips names with a dot
    staged.write_text(render_rule(LOGIN))
    os.chmod(staged, 0o440)
    checked = subprocess.run(["visudo", "-cf", str(staged)], capture_output=True, text=True)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    staged.rename(rule)
    yield rule
    rule.unlink()
    if made:
        subprocess.run(["userdel", "-r", LOGIN], capture_output=True)


def install_agent(node) -> None:
    """What the trainyard_node role does: the bundle, root-owned, at INSTALLED_AGENT."""
    data, _ = agent_bundle()
    r = subprocess.run(["nsenter", "-t", str(node.proc.pid), "-m", "sh", "-c",
                        f"cat > {INSTALLED_AGENT} && chown root:root {INSTALLED_AGENT} && "
                        f"chmod 644 {INSTALLED_AGENT}"], input=data, capture_output=True)
    assert r.returncode == 0, r.stderr


def test_the_login_account_starts_the_agent_as_root_and_jobs_run_as_their_owners(
        sudo_rule, node_factory, link_factory):
    node = node_factory()
    install_agent(node)
    link = link_factory(node, user=LOGIN, privilege="sudo")
    hello = link.wait_up()
    assert hello["user"] == "root" and hello["jobs_as_owners"] is True
    assert hello["root"] == "/var/lib/trainyard" and hello["fencing"]["devices"] is True
    link.send(op="launch", key="1.0", job_id=1, user="alice", argv=["id", "-un"])
    assert link.wait_for("exited", "1.0")["rc"] == 0
    assert link.request(op="log", key="1.0")["data"] == "alice\n"


def test_the_rule_allows_nothing_but_the_agent(sudo_rule, node_factory):
    node = node_factory()
    install_agent(node)
    for argv in (["/usr/bin/python3", "-c", "print(1)"],
                 ["/usr/bin/python3", "-I", INSTALLED_AGENT, "wrap", "/home/tyagent"],
                 ["/bin/sh", "-c", "id"]):
        r = node.run(f"runuser -u {LOGIN} -- sudo -n " + " ".join(f"'{a}'" for a in argv))
        assert r.returncode != 0 and "a password is required" in r.stderr, (argv, r)


def test_the_login_account_cannot_lower_the_minimum_uid(sudo_rule, node_factory, link_factory):
    node = node_factory()
    install_agent(node)
    link = link_factory(node, user=LOGIN, privilege="sudo", min_uid=1)
    link.wait_up()
    link.send(op="launch", key="2.0", job_id=2, user="daemon", argv=["touch", "/ran"])
    assert "below the minimum uid 1000" in link.wait_for("launch_failed", "2.0")["reason"]


def test_an_agent_dir_the_login_account_could_swap_is_refused(sudo_rule, node_factory, link_factory):
    node = node_factory()
    install_agent(node)
    link = link_factory(node, user=LOGIN, privilege="sudo", agent_dir=f"/home/{LOGIN}/state")
    reason = link.wait_down_reason()
    assert f"/home/{LOGIN} above its directory /home/{LOGIN}/state belongs to {LOGIN}" in reason
    assert "another account could swap the directory" in reason


def test_a_login_without_the_sudo_rule_says_so(sudo_rule, node_factory, link_factory):
    node = node_factory()
    install_agent(node)
    reason = link_factory(node, user="bob", privilege="sudo").wait_down_reason()
    assert reason.startswith("bob may not start the agent as root with sudo")
    assert "install the rule and /usr/local/lib/trainyard/agent.pyz with `trainyard bootstrap`" in reason

"""The Unix account a job runs as on a node: looked up, and refused when it is root or a system one.

Part of the agent's bundle (standard library, Python 3.8).
"""

from __future__ import annotations

import os
import pwd
import socket

DEFAULT_MIN_UID = 1000  # Debian's and RHEL's first regular account


class AccountError(Exception):
    """The job cannot run as that account here; the message says why."""


class Account:
    """A plain class, not a dataclass: the job step imports this module in the zygote that every
    job's supervisor is a fork of, and dataclasses brings inspect, ast and dis with it (some 25
    modules, about 2 MB more to copy the page tables of on every fork)."""

    __slots__ = ("name", "uid", "gid", "groups", "home", "shell")
    FIELDS = __slots__

    def __init__(self, name: str, uid: int, gid: int, groups: list[int] | None = None,
                 home: str = "/", shell: str = "/bin/sh"):
        self.name = name
        self.uid = uid
        self.gid = gid
        self.groups = list(groups or ())
        self.home = home
        self.shell = shell

    def to_dict(self) -> dict:
        return {k: getattr(self, k) for k in self.FIELDS}

    @classmethod
    def from_dict(cls, d: dict) -> Account:
        return cls(**d)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Account) and self.to_dict() == other.to_dict()

    __hash__ = None  # mutable, as the dataclass was

    def __repr__(self) -> str:
        return "Account(" + ", ".join(f"{k}={getattr(self, k)!r}" for k in self.FIELDS) + ")"


def lookup(name, min_uid: int = DEFAULT_MIN_UID) -> Account:
    """The account `name` with its groups; AccountError for none, root or a system account."""
    host = socket.gethostname()
    min_uid = max(min_uid, sudo_floor())
    if not isinstance(name, str) or not name:
        raise AccountError("the launch names no user: an agent running as root starts jobs only "
                           "as their owners")
    try:
        pw = pwd.getpwnam(name)
    except KeyError:
        raise AccountError(f"user {name!r} has no account on {host}; create it (or map the "
                           "trainyard user to an existing account in [users])") from None
    if pw.pw_uid == 0:
        raise AccountError(f"refusing to run a job as {name!r}: uid 0 is root, and jobs never "
                           "run as root")
    if pw.pw_uid < min_uid:
        raise AccountError(f"refusing to run a job as {name!r}: uid {pw.pw_uid} is a system "
                           f"account (below the minimum uid {min_uid})")
    groups = sorted(set(os.getgrouplist(pw.pw_name, pw.pw_gid)))
    return Account(pw.pw_name, pw.pw_uid, pw.pw_gid, groups, pw.pw_dir or "/",
                   pw.pw_shell or "/bin/sh")


def sudo_floor(login_defs: str = "/etc/login.defs") -> int:
    """The lowest uid a job may have when the agent was started by sudo (the sudo privilege
    mode): the node's own UID_MIN, so that the login user, which chooses the agent's options,
    cannot lower --min-uid to reach system accounts. 0 when not started by sudo."""
    if "SUDO_UID" not in os.environ or os.geteuid() != 0:
        return 0
    try:
        with open(login_defs) as f:
            for line in f:
                words = line.split()
                if len(words) == 2 and words[0] == "UID_MIN" and words[1].isdigit():
                    return int(words[1])
    except OSError:
        pass
    return DEFAULT_MIN_UID


def become(account: Account) -> None:
    """Drop this process to the account for good (groups first, then gid, then uid)."""
    os.setgroups(account.groups)
    os.setgid(account.gid)
    os.setuid(account.uid)

"""Who is asking: the authenticated user, their role, and where the call came from."""

from __future__ import annotations

from dataclasses import dataclass

from ..models import ROLES


def role_at_least(role: str, needed: str) -> bool:
    return ROLES.index(role) >= ROLES.index(needed)


@dataclass(frozen=True)
class Caller:
    user: str
    role: str
    address: str = ""

    def at_least(self, role: str) -> bool:
        return role_at_least(self.role, role)

    def may_act_on(self, owner: str) -> bool:
        """Users act on their own jobs; operators and admins on any."""
        return self.at_least("operator") or self.user == owner


SYSTEM = Caller("trainyard", "admin")

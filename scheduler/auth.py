"""API tokens (random secrets, stored only as SHA-256 hashes) and the role ladder."""

from __future__ import annotations

import hashlib
import secrets

from .models import ROLES

TOKEN_PREFIX = "ty_"


def new_token() -> str:
    return TOKEN_PREFIX + secrets.token_urlsafe(32)


def hash_token(token: str) -> str:
    # Tokens carry 256 bits of entropy, so a fast hash is enough (as for GitHub's tokens):
    # there is nothing to brute-force, and lookups stay O(1) by hash.
    return hashlib.sha256(token.encode()).hexdigest()


def role_at_least(role: str, needed: str) -> bool:
    return ROLES.index(role) >= ROLES.index(needed)


def may_act_on_job(user: str, role: str, job_owner: str) -> bool:
    """Users act on their own jobs; operators and admins on any."""
    return role_at_least(role, "operator") or user == job_owner

"""API tokens: issue (shown once), list, revoke, and authenticate by hash."""

from __future__ import annotations

from typing import Any

from sqlmodel import select

from ..auth import hash_token, new_token
from ..models import Token
from .caller import Caller
from .clock import Clock
from .errors import NotFound
from .state import StateStore


class Tokens:
    def __init__(self, store: StateStore, clock: Clock):
        self.store = store
        self.clock = clock
        self._cache: dict[str, tuple[str, str]] = {}  # hash -> (user, role)

    def create(self, user: str, role: str, created_by: str, address: str = "") -> str:
        """A new API token; only its hash is stored, the secret is returned once."""
        token = new_token()
        with self.store.tx() as s:
            s.add(Token(user=user, role=role, token_hash=hash_token(token), created_at=self.clock.time(),
                        created_by=created_by))
            self.store.record(s, created_by, "token.create", user, {"role": role}, address)
        return token

    def any(self) -> bool:
        with self.store.read() as s:
            return s.exec(select(Token)).first() is not None

    def authenticate(self, token: str, address: str) -> Caller | None:
        digest = hash_token(token)
        hit = self._cache.get(digest)
        if hit is None:
            with self.store.read() as s:
                row = s.exec(select(Token).where(Token.token_hash == digest)).first()
            if row is None:
                return None
            hit = self._cache[digest] = (row.user, row.role)
        return Caller(hit[0], hit[1], address)

    def list(self) -> list[dict[str, Any]]:
        with self.store.read() as s:
            return [{"id": t.id, "user": t.user, "role": t.role, "created_at": t.created_at,
                     "created_by": t.created_by} for t in s.exec(select(Token).order_by(Token.id)).all()]

    def revoke(self, caller: Caller, token_id: int) -> dict[str, Any]:
        with self.store.tx() as s:
            row = s.get(Token, token_id)
            if row is None:
                raise NotFound(f"token {token_id} does not exist; `trainyard token list` shows them", "token_id")
            s.delete(row)
            self.store.record(s, caller.user, "token.revoke", row.user, {"token_id": token_id, "role": row.role},
                              caller.address)
        self._cache.pop(row.token_hash, None)  # refused from the next request on
        return {"id": token_id, "user": row.user, "revoked": True}

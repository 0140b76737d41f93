"""/v1/tokens: API tokens (admin only); the secret is shown once and stored hashed."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Path

from ...daemon import Caller
from ..deps import DaemonDep, require
from ..errors import responses
from ..schemas import MAX_ID, TokenCreate, TokenCreated, TokenRead, TokenRevoked

router = APIRouter(prefix="/v1/tokens", tags=["tokens"])
Admin = Annotated[Caller, Depends(require("admin", "managing tokens"))]


@router.post("", status_code=201, response_model=TokenCreated, responses=responses(403))
async def create_token(body: TokenCreate, d: DaemonDep, who: Admin):
    token = d.tokens.create(body.user, body.role, who.user, who.address)
    return {"user": body.user, "role": body.role, "token": token}


@router.get("", response_model=list[TokenRead], responses=responses(403))
async def list_tokens(d: DaemonDep, who: Admin):
    return d.tokens.list()


@router.delete("/{token_id}", response_model=TokenRevoked, responses=responses(403, 404))
async def revoke_token(token_id: Annotated[int, Path(ge=1, le=MAX_ID)], d: DaemonDep, who: Admin):
    """Revoke a token: refused from the next request on."""
    return d.tokens.revoke(who, token_id)

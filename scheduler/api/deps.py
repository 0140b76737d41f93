"""Dependencies: who is calling (bearer token) and whether their role may call a route."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, HTTPException, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from ..daemon import Caller, Daemon

bearer = HTTPBearer(auto_error=False, description="an API token: `trainyard token create USER --role ROLE`")


def the_daemon(request: Request) -> Daemon:
    return request.app.state.daemon


# Dependencies are `async def`: FastAPI runs a plain `def` dependency in a worker thread, a thread
# hop on every request of the API's hottest paths (submit, list)
async def daemon_of(request: Request) -> Daemon:
    return the_daemon(request)


def peer(request: Request) -> str:
    return request.client.host if request.client else ""


async def caller(request: Request,
                 cred: Annotated[HTTPAuthorizationCredentials | None, Depends(bearer)]) -> Caller:
    """The bearer token's user and role (tokens are looked up by their hash)."""
    if cred is None or cred.scheme.lower() != "bearer" or not cred.credentials:
        raise HTTPException(401, "missing bearer token: set TRAINYARD_TOKEN or run `trainyard token create`",
                            headers={"WWW-Authenticate": "Bearer"})
    daemon = the_daemon(request)
    who = daemon.tokens.authenticate(cred.credentials.strip(), peer(request))
    if who is None:
        raise HTTPException(401, "invalid token: it is unknown to this daemon", headers={"WWW-Authenticate": "Bearer"})
    request.state.caller = who
    daemon.diag.request(who.user)
    return who


def require(role: str, what: str):
    """A dependency that lets a route run only for `role` or above."""

    async def check(who: Annotated[Caller, Depends(caller)]) -> Caller:
        if not who.at_least(role):
            raise HTTPException(403, f"{what} needs the {role} role; {who.user} is {who.role}")
        return who

    return check


Who = Annotated[Caller, Depends(caller)]
DaemonDep = Annotated[Daemon, Depends(daemon_of)]

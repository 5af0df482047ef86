"""API keys: ``--api-key`` parsing, the middleware that requires one, and with
several keys (tenants) each key's own prefix-cache salt (:func:`tenant_salts`,
:func:`combined_salt`)."""

from __future__ import annotations

import hashlib
import hmac
import secrets
from collections.abc import Sequence

from runtime.frontend.server.errors import error_response

# Routes open without the API key: liveness, and the version (vLLM leaves it open too).
OPEN_ROUTES = frozenset({"/health", "/version"})
# Where ApiKeyMiddleware leaves the matched key's cache salt in the ASGI scope.
TENANT_SALT_SCOPE_KEY = "flare.tenant_salt"
# Keys the per-key salts' HMAC: a salt reveals nothing of its key, even a weak one.
# Per process: cached pages live no longer than the coordinator this frontend starts.
_TENANT_SALT_SECRET = secrets.token_bytes(32)


def api_keys(value: str | Sequence[str] | None) -> tuple[str, ...]:
    """The API keys ``--api-key`` gives: a key, a comma-separated list of keys, or
    several such values (the flag repeated); blanks dropped, duplicates once."""
    if value is None:
        return ()
    values = [value] if isinstance(value, str) else list(value)
    keys = (key.strip() for v in values for key in v.split(","))
    return tuple(dict.fromkeys(key for key in keys if key))


def tenant_salts(keys: Sequence[str]) -> dict[str, str]:
    """Each API key's own prefix-cache salt when there are several keys (tenants);
    none with one key or none.  A salt is an HMAC of its key under a per-process
    secret (``k`` + 32 hex digits): distinct per key, never the key itself."""
    if len(keys) < 2:
        return {}
    return {
        key: "k" + hmac.new(_TENANT_SALT_SECRET, key.encode(), hashlib.sha256).hexdigest()[:32]
        for key in keys
    }


def combined_salt(tenant: str, request_salt: str) -> str:
    """The cache salt a request's ``Submit`` carries: the request's ``cache_salt``
    alone without a tenant salt; else the tenant's salt, followed by a hash of the
    request's when it gave one (the tenant part keeps tenants apart whatever salts
    their requests choose; the hash keeps the result within Submit's bound)."""
    if not tenant:
        return request_salt
    if not request_salt:
        return tenant
    return f"{tenant}/{hashlib.sha256(request_salt.encode()).hexdigest()[:32]}"


class ApiKeyMiddleware:
    """Every HTTP route but /health and /version needs ``Authorization: Bearer KEY``
    with one of ``keys``; the scheme is case-insensitive (``bearer KEY`` too), as HTTP
    auth schemes are.  ``salts``: each key's cache salt (:func:`tenant_salts`), left
    in the scope under TENANT_SALT_SCOPE_KEY for the routes.

    Plain ASGI rather than ``@app.middleware``: Starlette's BaseHTTPMiddleware
    hides client disconnects from the routes, and a route must see them to
    cancel the requests of a client that left.
    """

    def __init__(self, app, keys: Sequence[str], salts: dict[str, str] | None = None) -> None:
        if not keys:
            raise ValueError("ApiKeyMiddleware needs at least one key")
        self.app = app
        self.expected = [key.encode() for key in keys]
        self.salts = [(salts or {}).get(key, "") for key in keys]

    def matched(self, header: bytes) -> int | None:
        """The index of the key the header carries (None: none).  Every key is
        compared, in constant time each, whichever matches."""
        scheme, _, credentials = header.strip().partition(b" ")
        credentials = credentials.strip()
        found = None
        for i, key in enumerate(self.expected):
            if secrets.compare_digest(credentials, key) and found is None:
                found = i
        return found if scheme.lower() == b"bearer" else None

    def authorized(self, header: bytes) -> bool:
        return self.matched(header) is not None

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["path"] not in OPEN_ROUTES:
            given = dict(scope["headers"]).get(b"authorization", b"")
            found = self.matched(given)
            if found is None:
                response = error_response(
                    401, "missing or wrong API key", None, "authentication_error"
                )
                await response(scope, receive, send)
                return
            scope[TENANT_SALT_SCOPE_KEY] = self.salts[found]
        await self.app(scope, receive, send)

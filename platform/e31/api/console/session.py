"""The console's session: a signed-in browser's cookie and its CSRF token.

The cookie holds the tenant's API token and a random session id, encrypted and signed
(Fernet) with a key derived from the installation's `secrets_key` when it has one (every API
replica then reads every replica's cookies), else one drawn when the process starts (a
restart signs everyone out). The token is never in a URL or a page, and it is checked against
the store at every request by the same `TokenService.authenticate` the API's `Caller` uses, so
a revoked token signs its session out on the very next page.

CSRF: every form that changes something carries `csrf`, an HMAC of the session id; a POST
without the right one is refused 403 (and SameSite=Strict keeps other sites' forms from
sending the cookie at all).
"""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import hmac
import json
import secrets

from cryptography.fernet import Fernet, InvalidToken
from fastapi import Request, Response

from e31.core.errors import AuthError, Forbidden
from e31.core.records import TenantRecord
from e31.edge.settings import Settings

COOKIE = "e31_console"
SESSION_MAX_AGE_S = 12 * 3600
KEY_CONTEXT = b"e31 console session v1"


class SignedOut(Exception):
    """Raised when a console page is asked without a live session: the page answers with the
    login form (a redirect), never with the page."""


@dataclasses.dataclass(frozen=True)
class Viewer:
    """Who looks: the tenant of the session's token, and the CSRF token its forms carry."""

    tenant: TenantRecord
    csrf: str


class Sessions:
    """Issues and reads the console's cookies, with one key for the process."""

    def __init__(self, settings: Settings) -> None:
        seed = settings.secrets_key.split(",")[0].strip().encode() or secrets.token_bytes(32)
        raw = hmac.new(seed, KEY_CONTEXT, hashlib.sha256).digest()
        self._fernet = Fernet(base64.urlsafe_b64encode(raw))
        self._mac_key = hmac.new(raw, b"csrf", hashlib.sha256).digest()

    def sign_in(self, request: Request, response: Response, token: str) -> None:
        """Set the session cookie for `token` (already authenticated by the caller):
        HttpOnly, SameSite=Strict, Secure when the request came over https."""
        payload = json.dumps({"token": token, "sid": secrets.token_urlsafe(16)}).encode()
        response.set_cookie(COOKIE, self._fernet.encrypt(payload).decode(),
                            max_age=SESSION_MAX_AGE_S, path="/ui", httponly=True,
                            samesite="strict", secure=request.url.scheme == "https")

    @staticmethod
    def sign_out(response: Response) -> None:
        response.delete_cookie(COOKIE, path="/ui")

    def viewer(self, request: Request) -> Viewer:
        """The signed-in tenant, authenticated now by the API's token service; `SignedOut`
        without a cookie, with one that does not open or is too old, or whose token the
        store no longer accepts (revoked, expired, a disabled tenant)."""
        sealed = request.cookies.get(COOKIE)
        if not sealed:
            raise SignedOut()
        try:
            data = json.loads(self._fernet.decrypt(sealed.encode(), ttl=SESSION_MAX_AGE_S))
            token, sid = str(data["token"]), str(data["sid"])
        except (InvalidToken, ValueError, KeyError, TypeError) as exc:
            raise SignedOut() from exc
        try:
            tenant = request.app.state.services.tokens.authenticate(token)
        except (AuthError, Forbidden) as exc:
            raise SignedOut() from exc
        return Viewer(tenant=tenant, csrf=self._csrf(sid))

    def _csrf(self, sid: str) -> str:
        return hmac.new(self._mac_key, sid.encode(), hashlib.sha256).hexdigest()

    @staticmethod
    def check_csrf(viewer: Viewer, sent: str | None) -> None:
        """Refuse (403) a form whose CSRF token is not its session's."""
        if not sent or not hmac.compare_digest(sent, viewer.csrf):
            raise Forbidden("the form's CSRF token is missing or not this session's; "
                            "reload the page and try again")

"""The upstream's OAuth token when it comes from the machine's own cloud credentials.

Vertex AI takes an OAuth bearer token, not an API key. In open mode the caller's own token
goes upstream (proxy/serve/routes.py). In tenant mode the caller presents a spanmeter key,
so spanmeter brings the token itself: from Google's Application Default Credentials
(GOOGLE_APPLICATION_CREDENTIALS, `gcloud auth application-default login`, or the metadata
server of the machine it runs on), through google-auth, an optional dependency
(`pip install 'spanmeter[vertex]'`).

Loading the credentials and refreshing a token do blocking network I/O (the token
endpoint; the metadata server probe can take seconds), so both run in a thread, never on
the event loop. The token is kept and refreshed `REFRESH_EARLY_S` before it expires, so a
call never leaves with a token that lapses on the way; one refresh runs at a time (every
call that needs one waits for the same), and a caller that goes away does not cancel it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import replace
from datetime import UTC, datetime
from typing import Any, Final

from proxy.errors import ProxyError, Unauthorized, UpstreamConnectError
from proxy.model import frozen
from proxy.serve.routes import Target

__all__ = ["REFRESH_EARLY_S", "CloudToken", "NoCloudCredentials", "authorized"]

log = logging.getLogger("spanmeter.upstream")

SCOPE: Final = "https://www.googleapis.com/auth/cloud-platform"
# Refreshed this long before it expires: a long generation may still be sending its request
# a minute later, and google-auth's own margin is under four minutes.
REFRESH_EARLY_S: Final = 300.0
# After credentials could not be found, the next calls are answered from that failure for
# this long rather than each probing again (the metadata-server probe alone takes seconds).
RETRY_AFTER_FAILURE_S: Final = 30.0

_SETUP = ("Set GOOGLE_APPLICATION_CREDENTIALS in spanmeter's environment to a service account key file, run "
          "`gcloud auth application-default login` as the user spanmeter runs as, or run it on Google Cloud "
          "with a service account attached; then restart spanmeter. (In open mode, with no tenants, the "
          "caller's own `Authorization: Bearer` token goes upstream instead.)")


class NoCloudCredentials(Unauthorized):
    """The proxy has no credentials to call the upstream with: the operator's to fix."""

    code = "no_upstream_credentials"


@frozen
class _Token:
    value: str
    expires_at: float  # unix seconds; inf: the credentials gave no expiry


class CloudToken:
    """Application Default Credentials' access token, kept and refreshed. `credentials`:
    google-auth credentials to use instead of looking up the default ones."""

    def __init__(self, credentials: Any = None, *, early_s: float = REFRESH_EARLY_S) -> None:
        self._credentials = credentials
        self._early_s = early_s
        self._token: _Token | None = None
        self._refreshing: asyncio.Future[_Token] | None = None
        self._failed: tuple[float, ProxyError] | None = None
        self.refreshes = 0  # tokens fetched, for the operator's and the tests' eyes

    async def token(self) -> str:
        now = time.time()
        token = self._token
        if token is not None and token.expires_at - self._early_s > now:
            return token.value
        if self._failed is not None and now - self._failed[0] < RETRY_AFTER_FAILURE_S:
            raise self._failed[1]
        if self._refreshing is None or self._refreshing.done():
            self._refreshing = asyncio.ensure_future(self._refresh())
            self._refreshing.add_done_callback(_retrieved)
        # Shielded: a caller that disconnects leaves the refresh to the others.
        return (await asyncio.shield(self._refreshing)).value

    async def _refresh(self) -> _Token:
        try:
            token = await asyncio.to_thread(self._fetch)
        except NoCloudCredentials as exc:
            self._failed = (time.time(), exc)
            raise
        self._token, self._failed = token, None
        self.refreshes += 1
        return token

    def _fetch(self) -> _Token:
        """In a thread: the credentials' token, refreshed unless it has `early_s` left."""
        creds = self._credentials
        if creds is None:
            creds = self._credentials = _default_credentials()
        current = _token_of(creds)
        if current is not None and current.expires_at - self._early_s > time.time():
            return current  # given with a token still good (credentials that cannot refresh)
        import google.auth.exceptions
        import google.auth.transport.requests

        try:
            creds.refresh(google.auth.transport.requests.Request())
        except google.auth.exceptions.TransportError as exc:
            if current is not None and current.expires_at > time.time():
                log.warning("could not refresh the Vertex AI token (%s); using the current one", type(exc).__name__)
                return current
            raise UpstreamConnectError(
                "spanmeter could not reach Google's token endpoint to get a token for Vertex AI "
                f"({type(exc).__name__}); nothing was sent upstream. Retry; if it persists, check the "
                "proxy's network access to oauth2.googleapis.com.") from None
        except google.auth.exceptions.RefreshError as exc:
            if current is not None and current.expires_at > time.time():
                return current  # credentials holding a token and no way to refresh it
            raise NoCloudCredentials(
                "spanmeter's Google credentials were refused when it asked for a Vertex AI token "
                f"({str(exc)[:200]}). {_SETUP}") from None
        token = _token_of(creds)
        if token is None:
            raise NoCloudCredentials(f"spanmeter's Google credentials gave no token for Vertex AI. {_SETUP}")
        return token


def _default_credentials() -> Any:
    try:
        import google.auth
        import google.auth.exceptions
    except ImportError:
        raise NoCloudCredentials(
            "spanmeter calls Vertex AI with Google's Application Default Credentials in tenant mode, and "
            "google-auth is not installed: `pip install 'spanmeter[vertex]'`, then restart.") from None
    try:
        creds, _project = google.auth.default(scopes=[SCOPE])
    except google.auth.exceptions.DefaultCredentialsError as exc:
        raise NoCloudCredentials(
            "spanmeter has no Google credentials to call Vertex AI with: Application Default Credentials "
            f"are not configured ({str(exc)[:300]}). {_SETUP}") from None
    return creds


def _token_of(creds: Any) -> _Token | None:
    value = getattr(creds, "token", None)
    if not isinstance(value, str) or not value:
        return None
    expiry = getattr(creds, "expiry", None)
    # google-auth keeps expiry as a naive datetime in UTC.
    at = expiry.replace(tzinfo=UTC).timestamp() if isinstance(expiry, datetime) else float("inf")
    return _Token(value, at)


def _retrieved(future: asyncio.Future[_Token]) -> None:
    """Every waiter may have gone: the failure is still read, so it is not logged as lost."""
    if not future.cancelled():
        future.exception()


async def authorized(target: Target, tokens: CloudToken) -> Target:
    """`target` with its bearer token, when it takes the machine's own credentials."""
    if not target.ambient_token:
        return target
    token = await tokens.token()
    return replace(target, auth={**target.auth, "Authorization": f"Bearer {token}"})

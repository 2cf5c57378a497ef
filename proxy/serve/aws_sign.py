"""SigV4 signatures for the calls spanmeter forwards to AWS Bedrock.

A caller's SigV4 signature covers spanmeter's host and the request as the caller sent it, so
it cannot go upstream: spanmeter signs each forwarded request itself, over the exact URL and
bytes it sends (after its own patches), with botocore's signer (`botocore.auth.SigV4Auth`;
the `bedrock` extra), never crypto of its own.

Credentials come from AWS's standard chain (botocore's session: environment variables, the
shared config and credentials files' profile, container and instance roles), from a named
profile, or from variables an `upstreams` entry names. Loading them may do network I/O (the
instance metadata service, an STS role) and so runs in a thread, once per source, kept;
refreshable credentials are refreshed in a thread when botocore says they are due, before
the call is admitted, so signing itself never blocks the loop.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Mapping
from typing import Any, Final

from multidict import CIMultiDict

from proxy.errors import ProxyError, Unauthorized
from proxy.model import frozen

__all__ = ["AwsSigner", "AwsSigning", "NoAwsCredentials", "signable"]

SERVICE: Final = "bedrock"
RETRY_AFTER_FAILURE_S: Final = 30.0
# The caller's own signature and what went with it: spanmeter's replaces them.
_CALLERS_SIGNATURE: Final = frozenset({"x-amz-date", "x-amz-security-token", "x-amz-content-sha256"})

_SETUP = ("Give spanmeter AWS credentials: AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (and AWS_SESSION_TOKEN) "
          "or AWS_PROFILE in its environment, a role on the machine or container it runs in, or per tenant an "
          "`upstreams:` entry with `dialect: bedrock` and `aws_profile:` or `aws_access_key_id_env:` / "
          "`aws_secret_access_key_env:`. Or send a Bedrock API key (AWS_BEARER_TOKEN_BEDROCK in the SDK) in open "
          "mode. `pip install 'spanmeter[bedrock]'` brings botocore.")


class NoAwsCredentials(Unauthorized):
    """The proxy has no AWS credentials to sign the call with: the operator's to fix."""

    code = "no_upstream_credentials"


@frozen
class AwsSigning:
    """How a Bedrock call is signed: the region, and where the credentials come from."""

    region: str
    profile: str | None = None
    # Names of the variables holding the access key id, secret and session token.
    key_envs: tuple[str, str, str | None] | None = None


class AwsSigner:
    """Credentials per source, loaded once off the loop and kept; signs requests with them."""

    def __init__(self) -> None:
        self._credentials: dict[AwsSigning, Any] = {}
        self._loading: dict[AwsSigning, asyncio.Future[Any]] = {}
        self._failed: dict[AwsSigning, tuple[float, ProxyError]] = {}
        self.loads = 0  # credential loads and refreshes, for the operator's and the tests' eyes

    async def ready(self, signing: AwsSigning) -> None:
        """Credentials for `signing` are loaded and not due for refresh, or NoAwsCredentials."""
        key = _source(signing)
        creds = self._credentials.get(key)
        if creds is not None and not _due(creds):
            return
        failed = self._failed.get(key)
        if failed is not None and time.time() - failed[0] < RETRY_AFTER_FAILURE_S:
            raise failed[1]
        loading = self._loading.get(key)
        if loading is None or loading.done():
            loading = self._loading[key] = asyncio.ensure_future(self._load(key, creds))
            loading.add_done_callback(_retrieved)
        await asyncio.shield(loading)  # a caller that leaves does not cancel the others' load

    async def _load(self, key: AwsSigning, creds: Any) -> Any:
        try:
            creds = await asyncio.to_thread(_refreshed, creds) if creds is not None else \
                await asyncio.to_thread(_load, key)
        except NoAwsCredentials as exc:
            self._failed[key] = (time.time(), exc)
            raise
        self._failed.pop(key, None)
        self._credentials[key] = creds
        self.loads += 1
        return creds

    def sign(self, signing: AwsSigning, url: str, body: bytes, headers: CIMultiDict[str]) -> CIMultiDict[str]:
        """`headers` with spanmeter's SigV4 signature of POST `url` with `body`, exactly as sent
        (`ready` first: the credentials are loaded and fresh)."""
        from botocore.auth import SigV4Auth
        from botocore.awsrequest import AWSRequest

        creds = self._credentials[_source(signing)]
        request = AWSRequest(method="POST", url=url, data=body, headers=dict(signable(headers)))
        SigV4Auth(creds.get_frozen_credentials(), SERVICE, signing.region).add_auth(request)
        return CIMultiDict(request.headers.items())


def signable(headers: Mapping[str, str]) -> CIMultiDict[str]:
    """The headers to sign and send: the caller's signature's own headers left out."""
    return CIMultiDict((k, v) for k, v in headers.items() if k.lower() not in _CALLERS_SIGNATURE)


def _source(signing: AwsSigning) -> AwsSigning:
    """Credentials are kept per source: the region does not change them."""
    return AwsSigning("", signing.profile, signing.key_envs)


def _due(creds: Any) -> bool:
    """Refreshable credentials botocore would refresh now (a check of their expiry, no I/O)."""
    from botocore.credentials import RefreshableCredentials

    return isinstance(creds, RefreshableCredentials) and creds.refresh_needed()


def _refreshed(creds: Any) -> Any:
    """In a thread: refreshable credentials brought up to date (botocore refreshes on read)."""
    creds.get_frozen_credentials()
    return creds


def _load(source: AwsSigning) -> Any:
    """In a thread: the credentials of `source` (the standard chain, a profile, or variables)."""
    try:
        import botocore.credentials
        import botocore.exceptions
        import botocore.session
    except ImportError:
        raise NoAwsCredentials("spanmeter signs Bedrock calls with botocore, which is not installed. "
                               + _SETUP) from None
    if source.key_envs is not None:
        access, secret, token = source.key_envs
        missing = [name for name in (access, secret) if not os.environ.get(name)]
        if missing:
            raise NoAwsCredentials(f"spanmeter has no AWS credentials to sign this Bedrock call: "
                                   f"{' and '.join(missing)} not set in its environment. {_SETUP}")
        return botocore.credentials.Credentials(os.environ[access], os.environ[secret],
                                                os.environ.get(token) if token else None)
    try:
        creds = botocore.session.Session(profile=source.profile).get_credentials()
    except botocore.exceptions.BotoCoreError as exc:
        raise NoAwsCredentials(f"spanmeter could not load AWS credentials to sign this Bedrock call "
                               f"({str(exc)[:200]}). {_SETUP}") from None
    if creds is None:
        raise NoAwsCredentials(f"spanmeter has no AWS credentials to sign this Bedrock call. {_SETUP}")
    return creds


def _retrieved(future: asyncio.Future[Any]) -> None:
    if not future.cancelled():
        future.exception()

"""What Bedrock's two APIs (Converse, proxy/providers/converse.py, and InvokeModel,
proxy/providers/bedrock.py) share: their paths and the model a path names, the credential
header, and errors in Bedrock's shape. Pure: no I/O.

Paths: `/model/{modelId}/converse`, `/converse-stream`, `/invoke`,
`/invoke-with-response-stream`. The model id arrives as the client encoded it: botocore
percent-encodes `:` (`anthropic.claude-3-5-sonnet-20240620-v1%3A0`), other clients send it
literally; an inference profile has a geography prefix (`us.`, `eu.`, `apac.`, `global.`);
an ARN (`arn:aws:bedrock:us-east-1:123456789012:inference-profile/us.anthropic...`) has its
`/` encoded as `%2F`. The path goes upstream as sent; the model is read from it decoded,
an ARN by its last segment (the model or profile it names).
"""

from __future__ import annotations

import re
from typing import Final
from urllib.parse import unquote

import orjson

from proxy.errors import (
    BodyTimeout,
    BodyTooLarge,
    LoopRefused,
    ProxyError,
    RateLimited,
    Refusal,
    RequestError,
    ServiceError,
    Unauthorized,
    UnknownRoute,
    UpstreamTimeout,
)
from proxy.providers.base import vocabulary
from proxy.providers.eventstream import exception_frame

__all__ = ["ACTIONS", "PATH", "arn_or_plain", "bedrock_auth", "bedrock_error_body", "bedrock_error_headers",
           "bedrock_error_type", "bedrock_stream_error", "model_id", "model_of_path", "priced_id"]

ACTIONS: Final = ("converse", "converse-stream", "invoke", "invoke-with-response-stream")
# The model id segment: what botocore and the other SDKs send. `%3A` (`:`) anywhere, `%2F`
# (`/`) only as an ARN has it: the one encoded slash routes allow, inside this segment alone
# (no server on the way decodes it into a path separator, as it never crosses a segment).
PATH: Final = re.compile(
    r"/model/(?P<model>[A-Za-z0-9](?:[A-Za-z0-9._:-]|%3[Aa]|%2[Ff])*)"
    r"/(?P<action>converse|converse-stream|invoke|invoke-with-response-stream)")
# Cross-region inference profiles: a geography, then the model id.
_GEO: Final = re.compile(r"(?:us|eu|apac|global|us-gov|jp|au|ca)\.(?=[a-z0-9-]+\.)")


def arn_or_plain(segment: str) -> bool:
    """An encoded `/` only in an ARN, and never beside a dot segment: the slash an ARN's
    resource has (`inference-profile%2Fus.anthropic...`), nothing a server could normalise."""
    if "%2f" not in segment.lower():
        return True
    return segment.lower().startswith(("arn%3a", "arn:")) and ".." not in segment


def model_id(segment: str) -> str:
    """The model id of a path segment as sent: `%3A` and `%2F` decoded."""
    return unquote(segment)


def model_of_path(path: str) -> str | None:
    """The model a Bedrock path names: its id decoded, an ARN by what it names (the last
    segment of its resource: `us.anthropic.claude-3-7-sonnet-20250219-v1:0` of an
    inference-profile ARN, the model of a foundation-model ARN). A provisioned or
    application profile's ARN names an opaque id, which no price table lists: such calls
    are unpriced, as an unknown model."""
    m = PATH.fullmatch(path)
    if m is None:
        return None
    model = model_id(m["model"])
    if model.startswith("arn:"):
        model = model.rpartition("/")[2] if "/" in model else model
    return model


def priced_id(model: str) -> str:
    """The model an inference profile runs (the geography prefix off): what the model
    family is read from."""
    return _GEO.sub("", model, count=1) if _GEO.match(model) else model


def bedrock_auth(key: str) -> dict[str, str]:
    """A Bedrock API key (what AWS_BEARER_TOKEN_BEDROCK makes the SDKs send) as a bearer token.
    A SigV4 `Authorization` is no key: spanmeter signs such calls itself (proxy/serve/aws_sign.py)."""
    if key.startswith("AWS4-"):
        return {}
    return {"Authorization": f"Bearer {key}"}


# spanmeter's errors in Bedrock's exception names (botocore raises the class of that name,
# from the `x-amzn-errortype` header; the SDKs retry ThrottlingException and 5xx).
_BEDROCK_TYPES: Final[dict[type[ProxyError], str]] = {
    ProxyError: "InternalServerException",
    ServiceError: "ServiceUnavailableException",
    RequestError: "ValidationException",
    Unauthorized: "UnrecognizedClientException",
    BodyTimeout: "ValidationException",
    UnknownRoute: "ResourceNotFoundException",
    BodyTooLarge: "ValidationException",
    Refusal: "ServiceQuotaExceededException",
    LoopRefused: "ValidationException",
    RateLimited: "ThrottlingException",
    UpstreamTimeout: "ModelTimeoutException",
}


def bedrock_error_type(error: ProxyError) -> str:
    return vocabulary(error, _BEDROCK_TYPES)


def bedrock_error_body(error: ProxyError) -> bytes:
    """Bedrock's error body: `{"message": ...}` (the type travels in `x-amzn-errortype`)."""
    return orjson.dumps({"message": error.message})


def bedrock_error_headers(error: ProxyError) -> dict[str, str]:
    return {"x-amzn-errortype": f"{bedrock_error_type(error)}:http://internal.amazon.com/coral/com.amazon.bedrock/"}


def bedrock_stream_error(error: ProxyError) -> bytes:
    """An exception frame, as Bedrock ends a failed stream (its exception names start lower-case there)."""
    name = bedrock_error_type(error)
    if isinstance(error, ServiceError) and not isinstance(error, UpstreamTimeout):
        name = "ModelStreamErrorException"  # the stream broke on the way: what Bedrock says of that
    return exception_frame(name[0].lower() + name[1:], error.message)

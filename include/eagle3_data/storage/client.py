"""boto3 client construction and translation of transport failures into messages for a person."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

import boto3
from botocore.config import Config
from botocore.exceptions import (
    ClientError,
    ConnectionClosedError,
    ConnectTimeoutError,
    EndpointConnectionError,
    NoCredentialsError,
    ReadTimeoutError,
)

from eagle3_data.forksafe import at_fork_in_child
from eagle3_data.storage.refs import StorageUnavailable

_AUTH_CODES = {"403", "InvalidAccessKeyId", "SignatureDoesNotMatch", "AccessDenied", "InvalidToken", "ExpiredToken"}
# The S3 error codes of an object that is not there: GET's NoSuchKey, and HEAD's bare 404 (a HEAD
# has no body to name the code; SeaweedFS and AWS say "404" or "NotFound").
NOT_FOUND = frozenset({"NoSuchKey", "404", "NotFound"})
NO_BUCKET = "NoSuchBucket"


def error_code(exc: ClientError) -> str:
    """The S3 error code of a refusal ("NoSuchKey", "412", ...): what the callers branch on."""
    return str(exc.response.get("Error", {}).get("Code", ""))


def s3_client(
    endpoint_url: str | None = None,
    region: str | None = None,
    *,
    access_key: str | None = None,
    secret_key: str | None = None,
    max_attempts: int | None = None,
    connect_timeout: float = 5,
    read_timeout: float = 60,
):
    """A boto3 S3 client with botocore's standard retry mode (backoff with jitter on throttling,
    5xx and connection errors). Credentials: explicit, else boto3's chain (env, profile, role).
    `endpoint_url` falls back to AWS_ENDPOINT_URL_S3 / AWS_ENDPOINT_URL (SeaweedFS, MinIO);
    `max_attempts` to boto's AWS_MAX_ATTEMPTS, else 5."""
    if max_attempts is None:
        max_attempts = int(os.environ.get("AWS_MAX_ATTEMPTS") or 5)
    endpoint_url = _checked_endpoint(endpoint_url)
    config = Config(
        retries={"mode": "standard", "total_max_attempts": max_attempts},  # first try included
        connect_timeout=connect_timeout,
        read_timeout=read_timeout,
        s3={"addressing_style": "path"} if endpoint_url else {},
    )
    return fork_safe(
        boto3.session.Session().client(
            "s3",
            endpoint_url=endpoint_url,
            region_name=region or os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION") or "us-east-1",
            aws_access_key_id=access_key,
            aws_secret_access_key=secret_key,
            config=config,
        )
    )


def _checked_endpoint(endpoint_url: str | None) -> str | None:
    """The endpoint given, else AWS_ENDPOINT_URL_S3 / AWS_ENDPOINT_URL; one without a scheme
    (`127.0.0.1:8333`) refused naming where it came from and the fix, not boto's ValueError
    traceback ("Invalid endpoint")."""
    where = "S3 endpoint"
    if not endpoint_url:
        for where in ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL"):
            if endpoint_url := os.environ.get(where):
                break
    if endpoint_url and not endpoint_url.lower().startswith(("http://", "https://")):
        from eagle3_data.errors import UserError

        if "://" in endpoint_url:
            raise UserError(f"{where} {endpoint_url!r}: the scheme must be http:// or https://")
        raise UserError(f"{where} {endpoint_url!r} has no scheme: use http://{endpoint_url}")
    return endpoint_url or None


def fork_safe(client):
    """Make a boto3 client usable in processes forked after it was used (Airflow's task processes,
    validate's workers): a child drops the pooled connections it inherited, so its requests open
    sockets of its own instead of writing into the parent's. Returns the client."""
    at_fork_in_child(client, _drop_pooled_connections)
    return client


def _drop_pooled_connections(client) -> None:
    # botocore keeps its urllib3 pools on the endpoint's session; close() empties them. Closing a
    # socket in the child releases only the child's descriptor: the parent's connection stays up.
    session = getattr(getattr(client, "_endpoint", None), "http_session", None)
    if session is not None:
        session.close()


def endpoint_of(client) -> str:
    return getattr(getattr(client, "meta", None), "endpoint_url", "?")


def describe_client_error(exc: ClientError) -> str:
    """One line for an S3 refusal that reached the top: the operation, the code and the bucket/key."""
    err = exc.response.get("Error", {})
    code, msg = err.get("Code", "?"), err.get("Message", "")
    where = err.get("BucketName") or err.get("Key") or ""
    hint = ": create it once with `eagle3-data s3 init --bucket NAME`" if code == NO_BUCKET else ""
    return f"S3 {exc.operation_name} refused: {code} {msg} {where}".strip() + hint


@contextmanager
def s3_errors(client, what: str) -> Iterator[None]:
    """Turn an unreachable endpoint or refused credentials into a StorageUnavailable naming the
    endpoint and the operation (never the keys); other ClientErrors pass through."""
    try:
        yield
    except (EndpointConnectionError, ConnectTimeoutError, ReadTimeoutError, ConnectionClosedError) as exc:
        attempts = client.meta.config.retries.get("total_max_attempts", "several")
        raise StorageUnavailable(
            f"S3 at {endpoint_of(client)} unreachable while {what} ({type(exc).__name__}, "
            f"gave up after {attempts} attempts): check the endpoint URL and that the server runs"
        ) from exc
    except NoCredentialsError as exc:
        raise StorageUnavailable(
            f"no S3 credentials while {what}: set AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY or the "
            "Airflow connection aws_default"
        ) from exc
    except ClientError as exc:
        code = exc.response.get("Error", {}).get("Code", "")
        if code in _AUTH_CODES:
            raise StorageUnavailable(
                f"S3 at {endpoint_of(client)} refused the credentials while {what} ({code}): check "
                "AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY or the Airflow connection aws_default"
            ) from exc
        raise

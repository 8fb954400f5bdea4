"""Where uploads live, checked before anything is written there.

On the local disk (``MEDIA_ROOT``) by default; in an S3 bucket when ``STORAGE_S3_BUCKET`` is set
(ragsite/settings.py). A bucket that does not exist, or credentials it refuses, are found when
a worker or ``manage.py up`` starts, and by ``/readyz``, in words that name what to fix, not
by the first upload failing in a worker."""

from __future__ import annotations

import time
from pathlib import Path

from django.conf import settings
from django.core.files.storage import default_storage

from ragsite.errors import DomainError

# What S3's error codes mean for the operator.
_MEANINGS = {
    "404": "does not exist",
    "NoSuchBucket": "does not exist",
    "403": "refuses these credentials (AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY, or the role's policy)",
    "AccessDenied": "refuses these credentials (AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY, or the role's policy)",
    "InvalidAccessKeyId": "does not know the access key (AWS_ACCESS_KEY_ID)",
    "SignatureDoesNotMatch": "refuses the secret key (AWS_SECRET_ACCESS_KEY)",
}


class StorageUnavailable(DomainError):
    """The configured object storage cannot be used; the message says why and what to set."""


def storage_description() -> str:
    if settings.STORAGE_S3_BUCKET:
        where = settings.STORAGE_S3_ENDPOINT_URL or "AWS S3"
        return f"s3://{settings.STORAGE_S3_BUCKET}/{settings.STORAGE_S3_PREFIX} at {where}"
    return f"local disk {settings.MEDIA_ROOT}"


def storage_check() -> None:
    """Raise StorageUnavailable unless uploads can be stored: for S3, the bucket is reachable
    with these credentials (one HEAD request); for the local disk, MEDIA_ROOT can be made."""
    if not settings.STORAGE_S3_BUCKET:
        try:
            Path(settings.MEDIA_ROOT).mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise StorageUnavailable(f"uploads cannot be stored in MEDIA_ROOT {settings.MEDIA_ROOT}: {exc}") from exc
        return
    from botocore.exceptions import BotoCoreError, ClientError

    bucket = f"bucket {settings.STORAGE_S3_BUCKET!r} (STORAGE_S3_BUCKET)"
    where = f"at {settings.STORAGE_S3_ENDPOINT_URL}" if settings.STORAGE_S3_ENDPOINT_URL else "on AWS S3"
    try:
        default_storage.connection.meta.client.head_bucket(Bucket=settings.STORAGE_S3_BUCKET)
    except ClientError as exc:
        code = str(exc.response.get("Error", {}).get("Code", ""))
        meaning = _MEANINGS.get(code, f"answered {code or 'an error'}")
        raise StorageUnavailable(f"uploads cannot be stored: the {bucket} {where} {meaning}") from exc
    except BotoCoreError as exc:  # no credentials, an endpoint that does not answer, a bad region
        raise StorageUnavailable(f"uploads cannot be stored: the {bucket} {where} cannot be reached: {exc}") from exc


def storage_status() -> dict:
    """``/readyz``'s entry: ``ok``, where, how long the check took, and the reason when not ok."""
    started = time.perf_counter()
    try:
        storage_check()
    except StorageUnavailable as exc:
        return {"ok": False, "where": storage_description(), "error": str(exc)}
    return {"ok": True, "where": storage_description(), "ms": round((time.perf_counter() - started) * 1000, 1)}

"""Weights from any S3-compatible store: parallel ranged reads into a file, with bounded memory.

The object is cut into parts of ``part_bytes``; ``streams`` threads each fetch
one part at a time with a ranged GET and write what they read at its offset
(``pwrite``), reading ``buffer_bytes`` at a time. Memory is about
``streams x buffer_bytes`` whatever the object's size. A hashing thread
follows the parts in order, reading back from the page cache what was just
written, so the checksum is ready when the last part lands.

The expected checksum is, in order: the one the request names; the object's
``sha256`` user metadata (``x-amz-meta-sha256``); its ETag when that is a plain
MD5 (single-part uploads). Without any of these the file is cached unverified
and the result says so.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from urllib.parse import urlparse

from forecaster.agent.errors import AgentError
from forecaster.contracts.actions import FailureReason

_MD5_ETAG = re.compile(r"^[0-9a-f]{32}$")
PART_RESUMES = 3  # ranged GETs again from where a dropped body stopped, per part, before the pre-load fails

log = logging.getLogger(__name__)


def parse_s3_uri(uri: str) -> tuple[str, str]:
    """``s3://bucket/key`` -> (bucket, key)."""
    parsed = urlparse(uri)
    if parsed.scheme != "s3" or not parsed.netloc or not parsed.path.strip("/"):
        raise AgentError(FailureReason.NOT_FOUND, f"not an s3://bucket/key URI: {uri!r}", temporary=False)
    return parsed.netloc, parsed.path.lstrip("/")


@dataclass(frozen=True)
class ObjectInfo:
    size_bytes: int
    etag: str
    sha256: str | None  # from metadata
    md5: str | None  # from a single-part ETag


def etag_md5(head: dict) -> str | None:
    """The MD5 of an object's data from its HEAD response, where its ETag is one, else None.

    A single-part upload's ETag is the MD5 of its data, unless the object is encrypted with SSE-KMS (or
    DSSE-KMS) or SSE-C: then it is not (AWS S3 API reference, ``Object.ETag``), and checking a download against it
    would refuse every object of such a bucket as a checksum mismatch. SSE-S3 (``AES256``) keeps the MD5.
    A multipart ETag (``<hex>-<parts>``) is never one.
    """
    etag = str(head.get("ETag", "")).strip('"').lower()
    encryption = str(head.get("ServerSideEncryption") or "AES256")
    if not _MD5_ETAG.match(etag) or encryption != "AES256" or head.get("SSECustomerAlgorithm"):
        return None
    return etag


def classify_s3_error(exc: BaseException, what: str) -> AgentError:
    """An S3/botocore error as an :class:`AgentError` with a reason from the fixed set."""
    from botocore.exceptions import ClientError, ConnectTimeoutError, HTTPClientError, IncompleteReadError
    from botocore.exceptions import ConnectionError as BotocoreConnectionError
    from botocore.exceptions import NoCredentialsError, ReadTimeoutError

    if isinstance(exc, AgentError):
        return exc
    if isinstance(exc, NoCredentialsError):
        return AgentError(FailureReason.UNAUTHORISED, f"{what}: no S3 credentials configured", temporary=False)
    if isinstance(exc, (ReadTimeoutError, ConnectTimeoutError)):
        return AgentError(FailureReason.TIMEOUT, f"{what}: {exc}", temporary=True)
    if isinstance(exc, (BotocoreConnectionError, ConnectionError)):
        return AgentError(FailureReason.INTERNAL, f"{what}: S3 unreachable: {exc}", temporary=True)
    # A response cut short: the connection closed or reset mid-body, fewer bytes than its Content-Length.
    if isinstance(exc, (HTTPClientError, IncompleteReadError)):
        return AgentError(FailureReason.INTERNAL, f"{what}: connection dropped: {type(exc).__name__}: {exc}",
                          temporary=True)
    if isinstance(exc, ClientError):
        error = exc.response.get("Error", {})
        code = str(error.get("Code", ""))
        status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        message = f"{what}: {code or status} {error.get('Message', '')}".strip()
        if code in ("404", "NoSuchKey", "NoSuchBucket", "NotFound") or status == 404:
            return AgentError(FailureReason.NOT_FOUND, message, temporary=False)
        if code in ("403", "401", "AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "Forbidden",
                    "InvalidToken", "ExpiredToken") or status in (401, 403):
            return AgentError(FailureReason.UNAUTHORISED, message, temporary=False)
        if code in ("SlowDown", "ServiceUnavailable", "InternalError", "RequestTimeout", "PreconditionFailed") \
                or (status or 0) >= 500 or status == 412:
            return AgentError(FailureReason.INTERNAL, message, temporary=True)
        return AgentError(FailureReason.INTERNAL, message, temporary=False)
    if isinstance(exc, OSError) and exc.errno == 28:  # ENOSPC
        return AgentError(FailureReason.NO_SPACE, f"{what}: {exc}", temporary=False)
    return AgentError(FailureReason.INTERNAL, f"{what}: {type(exc).__name__}: {exc}", temporary=False)


class _OrderedHasher(threading.Thread):
    """Hashes a file part by part, in order, as parts are reported complete."""

    def __init__(self, fd: int, parts: list[tuple[int, int]], algorithms: tuple[str, ...]) -> None:
        super().__init__(daemon=True, name="preload-hash")
        self.fd, self.parts = fd, parts
        self.hashes = {a: hashlib.new(a) for a in algorithms}
        self.done = [False] * len(parts)
        self.cond = threading.Condition()
        self.aborted = False
        self.error: BaseException | None = None

    def part_done(self, index: int) -> None:
        with self.cond:
            self.done[index] = True
            self.cond.notify()

    def abort(self) -> None:
        with self.cond:
            self.aborted = True
            self.cond.notify()

    def run(self) -> None:
        try:
            for index, (start, end) in enumerate(self.parts):
                with self.cond:
                    while not self.done[index] and not self.aborted:
                        self.cond.wait()
                    if self.aborted:
                        return
                pos = start
                while pos < end:
                    chunk = os.pread(self.fd, min(4 << 20, end - pos), pos)
                    if not chunk:
                        raise OSError(f"short read at {pos}")
                    for h in self.hashes.values():
                        h.update(chunk)
                    pos += len(chunk)
        except BaseException as exc:  # noqa: BLE001 - reported to the caller
            self.error = exc


class S3WeightsSource:
    """Reads weights objects from one S3 endpoint.

    Args:
        endpoint_url: S3 endpoint (None: AWS).
        region: signing region.
        access_key_id, secret_access_key: credentials; None uses boto3's default chain.
        streams: parallel ranged reads per object.
        part_bytes: size of one ranged read.
        buffer_bytes: bytes read at a time per stream (memory per stream).
        connect_timeout_s, read_timeout_s: per request.
    """

    def __init__(self, *, endpoint_url: str | None, region: str = "us-east-1", access_key_id: str | None = None,
                 secret_access_key: str | None = None, streams: int = 4, part_bytes: int = 16 << 20,
                 buffer_bytes: int = 1 << 20, connect_timeout_s: float = 5.0, read_timeout_s: float = 30.0) -> None:
        import boto3
        from botocore.config import Config

        self.streams, self.part_bytes, self.buffer_bytes = streams, part_bytes, buffer_bytes
        self.client = boto3.session.Session().client(
            "s3", endpoint_url=endpoint_url, region_name=region, aws_access_key_id=access_key_id,
            aws_secret_access_key=secret_access_key,
            config=Config(max_pool_connections=streams + 4, connect_timeout=connect_timeout_s,
                          read_timeout=read_timeout_s, retries={"max_attempts": 3, "mode": "standard"},
                          s3={"addressing_style": "path"}, signature_version="s3v4"))

    def head(self, uri: str) -> ObjectInfo:
        bucket, key = parse_s3_uri(uri)
        try:
            response = self.client.head_object(Bucket=bucket, Key=key)
        except Exception as exc:  # noqa: BLE001 - classified
            raise classify_s3_error(exc, f"head {uri}") from None
        etag = str(response.get("ETag", "")).strip('"')
        meta = {k.lower(): v for k, v in (response.get("Metadata") or {}).items()}
        sha = (meta.get("sha256") or "").lower() or None
        return ObjectInfo(size_bytes=int(response["ContentLength"]), etag=etag, sha256=sha,
                          md5=etag_md5(response))

    def fetch_into(self, uri: str, info: ObjectInfo, fd: int, *, deadline: float | Callable[[], float],
                   algorithms: tuple[str, ...] = ("sha256",),
                   on_progress: Callable[[int], None] = lambda n: None,
                   cancelled: Callable[[], bool] = lambda: False) -> dict[str, str]:
        """Write the object into ``fd`` (already sized) and return its hex digests.

        Raises:
            AgentError: timeout past ``deadline`` (monotonic seconds, or a callable read at each check: a
                request that joins the transfer extends it), not found, unauthorised, no space, ...
        """
        bucket, key = parse_s3_uri(uri)
        size = info.size_bytes
        parts = [(start, min(start + self.part_bytes, size)) for start in range(0, size, self.part_bytes)]
        hasher = _OrderedHasher(fd, parts, algorithms)
        hasher.start()
        stop = threading.Event()
        progress_lock = threading.Lock()
        written = [0]

        def check() -> None:
            if stop.is_set():
                raise _Stopped()
            if cancelled():
                raise AgentError(FailureReason.TIMEOUT, f"pre-load of {uri} cancelled: nobody waits for it")
            if time.monotonic() > (deadline() if callable(deadline) else deadline):
                raise AgentError(FailureReason.TIMEOUT, f"pre-load of {uri} did not finish before its deadline")

        def read_into(body, pos: int, end: int) -> int:
            """Copy ``body`` into the file from ``pos`` to ``end``; a read that fails says where it stopped."""
            while pos < end:
                check()
                try:
                    chunk = body.read(min(self.buffer_bytes, end - pos))
                except Exception as exc:  # noqa: BLE001
                    raise _BodyCut(classify_s3_error(exc, f"read {uri} at {pos}"), pos) from None
                if not chunk:
                    raise _BodyCut(AgentError(FailureReason.INTERNAL, f"{uri}: stream ended at {pos} of {end}",
                                              temporary=True), pos)
                view = memoryview(chunk)
                while view:
                    try:
                        n = os.pwrite(fd, view, pos)
                    except OSError as exc:
                        raise classify_s3_error(exc, f"write {uri}") from None
                    view = view[n:]
                    pos += n
                with progress_lock:
                    written[0] += len(chunk)
                    on_progress(written[0])
            return pos

        def fetch_part(index: int) -> None:
            start, end = parts[index]
            pos, resumes = start, 0
            while pos < end:
                check()
                # If-Match: a part of a newer object under the same key is refused, never mixed in.
                extra = {"IfMatch": f'"{info.etag}"'} if info.etag else {}
                try:
                    response = self.client.get_object(Bucket=bucket, Key=key, Range=f"bytes={pos}-{end - 1}",
                                                      **extra)
                except Exception as exc:  # noqa: BLE001
                    raise classify_s3_error(exc, f"get {uri} bytes {pos}-{end - 1}") from None
                body = response["Body"]
                try:
                    pos = read_into(body, pos, end)
                except _BodyCut as cut:
                    # A connection dropped mid-body (routine on multi-GB reads): ask again from where it stopped,
                    # a few times, rather than fail the whole object and download it again from its first byte.
                    error = cut.error
                    if not error.temporary or resumes >= PART_RESUMES:
                        raise error from None
                    resumes += 1
                    log.info("%s; resuming at byte %d (%d of %d)", error, cut.pos, resumes, PART_RESUMES)
                    pos = cut.pos
                finally:
                    body.close()
            hasher.part_done(index)

        try:
            with ThreadPoolExecutor(max_workers=min(self.streams, max(1, len(parts))),
                                    thread_name_prefix="preload") as pool:
                futures = [pool.submit(fetch_part, i) for i in range(len(parts))]
                error: BaseException | None = None
                for future in futures:
                    try:
                        future.result()
                    except BaseException as exc:  # noqa: BLE001 - first real error wins, the rest stop
                        if error is None and not isinstance(exc, _Stopped):
                            error = exc
                        stop.set()
                if error is not None:
                    raise error
        except BaseException:
            stop.set()
            hasher.abort()
            hasher.join()
            raise
        hasher.join()
        if hasher.error is not None:
            raise classify_s3_error(hasher.error, f"hash {uri}")
        return {name: h.hexdigest() for name, h in hasher.hashes.items()}


class _BodyCut(Exception):
    """A part's response body failed at byte ``pos`` of the object (``error`` says how)."""

    def __init__(self, error: AgentError, pos: int) -> None:
        super().__init__(str(error))
        self.error, self.pos = error, pos


class _Stopped(Exception):
    """Another part failed; this one stops quietly."""

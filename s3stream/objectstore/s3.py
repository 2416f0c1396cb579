"""An object store on S3 (or any S3-compatible service) through one boto3 client.

Transient failures (throttling, 5xx, dropped connections, timeouts) are retried by botocore's
"standard" retry mode with exponential backoff; what still fails is raised as ObjectStoreError
naming the operation and key, with the botocore error as its cause. Requests in flight are
bounded by `max_concurrency` across all threads and puts.

Against a store that stopped answering, one call gives up after about `max_attempts` x
`read_timeout` (8 x 30 s by default) plus botocore's waits between attempts (random, up to
0.05 x 2^(attempt-1) s, throttling up to 20 s); the uploader then retries it (upload.py). A
request in flight when the store answers again completes then: with a 40 s freeze of a moto
server and the defaults, uploads resumed 0.04 s after it (tests/engine/test_upload_faults.py).

Integrity of reads: a whole-object get asks for the server's checksum (ChecksumMode) and botocore
validates the body against it; a ranged get does not ask and is not validated (servers differ:
S3 sends no checksum with a range, rclone's serve s3 sends the whole object's, which a range can
never match). What reads ranges checks the object format's own block CRCs.

Conditional creates (put_if_absent) are PutObject with If-None-Match: *. S3, SeaweedFS and moto
enforce it; rclone's serve s3 ignores it and overwrites (probe_conditional_put detects that).
"""
from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any, Callable, Iterable, Iterator, TypeVar

import boto3
from botocore.config import Config
from botocore.exceptions import BotoCoreError, ClientError
from botocore.utils import determine_content_length

from ..errors import ConfigError, ObjectNotFoundError, ObjectStoreError, ObjectStorePermanentError
from .base import (
    BytesLike, Gathered, ObjectInfo, PutData, check_conditional_size, data_size, default_multipart_threshold,
    write_requests,
)
from .local import check_range
from ..threads import normal_priority

log = logging.getLogger("s3stream.objectstore")

#: S3 error codes that no retry can fix: the request is refused as made.
PERMANENT_CODES = frozenset({
    "AccessDenied", "AllAccessDisabled", "AccountProblem", "InvalidAccessKeyId", "InvalidBucketName",
    "NoSuchBucket", "SignatureDoesNotMatch", "InvalidSecurity", "403",
})

MiB = 1024 * 1024
#: S3 accepts at most this many keys per DeleteObjects request.
DELETE_BATCH = 1000
#: S3's minimum size of every part but the last.
MIN_PART_SIZE = 5 * MiB

_NOT_FOUND_CODES = {"NoSuchKey", "404", "NotFound"}
#: put_if_absent retries a 409 (ConditionalRequestConflict: another conditional write of the key is
#: in flight) this many times, waiting CONFLICT_BACKOFF * 2**n s (at most 1 s) before each: about
#: 4.5 s in all; then it raises ObjectStoreError.
CONFLICT_RETRIES = 8
CONFLICT_BACKOFF = 0.05
T = TypeVar("T")


def _drop_expect_continue(params: dict, **kwargs: Any) -> None:
    """Drop botocore's "Expect: 100-continue" from conditional puts and from requests with an
    empty body (botocore adds it to every PUT with a body). A conditional put is small and its
    latency matters (a WAL's): waiting for the continue costs a round trip. An empty body saves
    nothing by waiting, and SeaweedFS answers such a request at once, after which the next
    request on the connection hangs until the read timeout (30 s); botocore's
    BOTO_EXPERIMENTAL__NO_EMPTY_CONTINUE does the same for those."""
    headers = params.get("headers", {})
    if "Expect" in headers and ("If-None-Match" in headers or determine_content_length(params.get("body")) == 0):
        del headers["Expect"]


class S3ObjectStore:
    """ObjectStore on `bucket`, every key stored under `prefix` + "/".

    Objects up to `multipart_threshold` bytes (default twice `part_size`) are one PutObject;
    larger ones a multipart upload of `part_size` parts that go up concurrently and which is aborted if anything fails. `client` (a boto3 S3 client) is for
    tests; when given, the store does not close it, and its config decides which responses are
    checksum-validated (botocore's default, "when_supported", validates ranged gets too, which
    fails on servers that send the whole object's checksum with a range: use "when_required").
    """

    def __init__(
        self,
        bucket: str,
        prefix: str = "",
        *,
        endpoint_url: str | None = None,
        region_name: str | None = None,
        part_size: int = 16 * MiB,
        multipart_threshold: int | None = None,
        max_concurrency: int = 16,
        max_attempts: int = 8,
        connect_timeout: float = 5.0,
        read_timeout: float = 30.0,
        client: Any = None,
    ) -> None:
        if not bucket:
            raise ConfigError("S3 bucket name is empty; use s3://bucket[/prefix]")
        if part_size < MIN_PART_SIZE:
            raise ConfigError(
                f"part_size {part_size} is below S3's minimum part size {MIN_PART_SIZE} (5 MiB)")
        if max_concurrency < 1 or max_attempts < 1:
            raise ConfigError(f"max_concurrency ({max_concurrency}) and max_attempts "
                              f"({max_attempts}) must both be >= 1")
        self.bucket = bucket
        self.prefix = prefix.strip("/")
        self.part_size = part_size
        self.multipart_threshold = multipart_threshold or default_multipart_threshold(part_size)
        if self.multipart_threshold < part_size:
            raise ConfigError(f"multipart_threshold ({self.multipart_threshold}) must be at least part_size ({part_size})")
        self.max_concurrency = max_concurrency
        self.url = f"s3://{bucket}/{self.prefix}" if self.prefix else f"s3://{bucket}"
        self._owns_client = client is None
        if client is None:
            config = Config(
                # Config's "max_attempts" counts retries only; "total_max_attempts" counts them all.
                retries={"mode": "standard", "total_max_attempts": max_attempts},
                # Responses are validated against their x-amz-checksum-* header only when get()
                # asks (whole objects): botocore's default validates every response that has one,
                # and some servers (rclone serve s3) send the whole object's checksum with a range.
                response_checksum_validation="when_required",
                max_pool_connections=max_concurrency,
                connect_timeout=connect_timeout,
                read_timeout=read_timeout,
            )
            # A private session: boto3's default session is not thread-safe to create clients on.
            client = boto3.session.Session().client(
                "s3", endpoint_url=endpoint_url, region_name=region_name, config=config)
            client.meta.events.register_last("before-call.s3", _drop_expect_continue)
        self._client = client
        # botocore's pool does not block when full (it opens and discards extra connections), so
        # the bound on requests in flight is this semaphore, taken around every request.
        self._slots = threading.BoundedSemaphore(max_concurrency)
        self._executor = ThreadPoolExecutor(max_concurrency, thread_name_prefix="s3-part", initializer=normal_priority)
        self._stats_lock = threading.Lock()
        self._stats = dict.fromkeys(
            ("put", "put_if_absent", "upload_part", "create_multipart", "complete_multipart", "abort_multipart",
             "get", "head", "delete", "list"), 0)

    # -- helpers -------------------------------------------------------------------------------

    def _full_key(self, key: str) -> str:
        if not isinstance(key, str) or not key:
            raise ValueError(f"object key must be a non-empty string, got {key!r}")
        return f"{self.prefix}/{key}" if self.prefix else key

    def _request(self, stat: str, op: str, key: str, call: Callable[[], T]) -> T:
        """Issue one request (botocore retries inside it), counted and bounded; map failures."""
        with self._slots:
            with self._stats_lock:
                self._stats[stat] += 1
            try:
                return call()
            except ClientError as e:
                if e.response.get("Error", {}).get("Code") == "NoSuchBucket":
                    raise ObjectStorePermanentError(
                        f"S3 {op} of {key!r} failed: bucket {self.bucket!r} does not exist; create "
                        f"it (or add create_bucket=1 to the store URL)") from e
                raise
            except BotoCoreError as e:
                raise ObjectStoreError(f"S3 {op} of {key!r} in {self.url} failed: {e}") from e

    def _error(self, op: str, key: str, e: ClientError) -> ObjectStoreError:
        """ObjectStorePermanentError for refusals that retrying cannot fix (PERMANENT_CODES),
        else ObjectStoreError (throttling, server errors: worth retrying)."""
        code = str(e.response.get("Error", {}).get("Code", ""))
        if code in PERMANENT_CODES:
            return ObjectStorePermanentError(
                f"S3 {op} of {key!r} in {self.url} was refused ({code}): check the credentials, the bucket "
                f"and its policy; retrying cannot help: {e}")
        return ObjectStoreError(f"S3 {op} of {key!r} in {self.url} failed: {e}")

    # -- ObjectStore ---------------------------------------------------------------------------

    def put(self, key: str, data: PutData) -> None:
        """Store `data` under `key`: one PutObject, or a multipart upload above the threshold.
        Each request's body is one copy of its bytes (botocore takes bytes), a Gathered object's
        included."""
        full_key = self._full_key(key)
        size = data_size(data)
        view: memoryview | None = None
        if isinstance(data, Gathered):
            piece: Callable[[int, int], bytes] = data.read
        else:
            view = memoryview(data).cast("B")
            piece = lambda start, end: view[start:end].tobytes()      # noqa: E731
        try:
            if write_requests(size, self.part_size, self.multipart_threshold) == 1:
                body = data if isinstance(data, bytes) else piece(0, size)
                try:
                    self._request("put", "put", key, lambda: self._client.put_object(
                        Bucket=self.bucket, Key=full_key, Body=body))
                except ClientError as e:
                    raise self._error("put", key, e) from e
                return
            self._put_multipart(key, full_key, size, piece)
        finally:
            # A failed put's traceback keeps this frame (and `piece`) alive for as long as
            # anyone keeps the error; an unreleased view would keep the caller's buffer exported
            # that long (a reused bytearray could not be resized: BufferError). Nothing reads it
            # once put returns: the bodies were copies, and every part has finished.
            if view is not None:
                view.release()

    def put_if_absent(self, key: str, data: BytesLike) -> bool:
        """Store `data` under `key` only if no object has that key: one PutObject with
        If-None-Match: *. True if it created the object; False on 412 PreconditionFailed (the key
        exists). A 409 ConditionalRequestConflict is retried (CONFLICT_RETRIES). When botocore
        retried a request after an answer that never came (a timeout, a 5xx: that attempt may
        have landed), a 412 is checked by reading the object back: True if its bytes are `data`.
        Objects over `multipart_threshold` are refused (InvalidArgumentError): one PUT only.

        A server that ignores If-None-Match overwrites and answers 200, so this returns True
        there: see probe_conditional_put."""
        full_key = self._full_key(key)
        check_conditional_size(data_size(data), self.multipart_threshold, self.url)
        body = data if isinstance(data, bytes) else bytes(data)    # a copy: no view of `data` kept
        unsure = False      # an attempt of this call may have landed unanswered
        last_conflict: ClientError | None = None
        for conflicts in range(CONFLICT_RETRIES + 1):
            if conflicts:
                time.sleep(min(1.0, CONFLICT_BACKOFF * 2 ** (conflicts - 1)))
            try:
                self._request("put_if_absent", "put_if_absent", key, lambda: self._client.put_object(
                    Bucket=self.bucket, Key=full_key, Body=body, IfNoneMatch="*"))
                return True
            except ClientError as e:
                meta = e.response.get("ResponseMetadata", {})
                unsure = unsure or meta.get("RetryAttempts", 0) > 0
                code = str(e.response.get("Error", {}).get("Code", ""))
                status = meta.get("HTTPStatusCode")
                if code == "PreconditionFailed" or status == 412:
                    return unsure and self._holds(key, body)
                if code != "ConditionalRequestConflict" and status != 409:
                    raise self._error("put_if_absent", key, e) from e
                last_conflict = e
        raise ObjectStoreError(
            f"S3 put_if_absent of {key!r} in {self.url} met conflicting conditional writes of the key "
            f"{CONFLICT_RETRIES + 1} times (409 ConditionalRequestConflict); another writer keeps writing it: "
            f"{last_conflict}")

    def _holds(self, key: str, data: bytes) -> bool:
        """Whether the object under `key` has exactly these bytes (False if it is gone)."""
        try:
            return self.get(key) == data
        except ObjectNotFoundError:
            return False

    def _put_multipart(self, key: str, full_key: str, size: int, piece: Callable[[int, int], bytes]) -> None:
        try:
            upload_id = self._request("create_multipart", "create multipart upload", key,
                                      lambda: self._client.create_multipart_upload(
                                          Bucket=self.bucket, Key=full_key))["UploadId"]
        except ClientError as e:
            raise self._error("create multipart upload", key, e) from e
        # The last part takes the remainder (S3 parts may be up to 5 GiB): an object a little over
        # n parts is n requests, not n + 1 with a tiny last one.
        count = max(1, size // self.part_size)
        futures: list[Future] = []
        try:
            for index in range(count):
                end = (index + 1) * self.part_size if index < count - 1 else size
                futures.append(self._executor.submit(
                    self._upload_part, key, full_key, upload_id, index + 1, piece, index * self.part_size, end))
            parts = [f.result() for f in futures]
            self._request("complete_multipart", "complete multipart upload", key,
                          lambda: self._client.complete_multipart_upload(
                              Bucket=self.bucket, Key=full_key, UploadId=upload_id,
                              MultipartUpload={"Parts": parts}))
        except BaseException as e:
            for f in futures:
                f.cancel()
            # Parts still uploading would land after the abort and keep costing storage.
            wait(futures)
            self._abort(key, full_key, upload_id, e)
            if isinstance(e, ClientError):
                raise self._error("multipart put", key, e) from e
            raise

    def _upload_part(self, key: str, full_key: str, upload_id: str, number: int,
                     piece: Callable[[int, int], bytes], start: int, end: int) -> dict:
        body = piece(start, end)  # botocore wants bytes or a file, not a memoryview; copied here, in the worker
        response = self._request("upload_part", f"upload part {number}", key,
                                 lambda: self._client.upload_part(
                                     Bucket=self.bucket, Key=full_key, UploadId=upload_id,
                                     PartNumber=number, Body=body))
        return {"PartNumber": number, "ETag": response["ETag"]}

    def _abort(self, key: str, full_key: str, upload_id: str, cause: BaseException) -> None:
        try:
            self._request("abort_multipart", "abort multipart upload", key,
                          lambda: self._client.abort_multipart_upload(
                              Bucket=self.bucket, Key=full_key, UploadId=upload_id))
        except (ClientError, ObjectStoreError) as e:
            # The original failure is what the caller needs; a bucket lifecycle rule for
            # incomplete uploads cleans up what this could not. (add_note is Python 3.11+.)
            note = f"aborting multipart upload {upload_id} also failed: {e}"
            if hasattr(cause, "add_note"):
                cause.add_note(note)
            else:
                log.warning("%s: %s", key, note)

    def get(self, key: str, start: int = 0, end: int | None = None) -> bytes:
        """Bytes [start, end) of the object, clipped to its size (start past it: b"")."""
        check_range(start, end)
        full_key = self._full_key(key)
        if end is not None and start == end:
            return b""
        kwargs: dict[str, Any] = {"Bucket": self.bucket, "Key": full_key}
        if start or end is not None:
            kwargs["Range"] = f"bytes={start}-{'' if end is None else end - 1}"
        else:
            # The whole object: validated against its stored checksum where the server has one
            # (not a multipart object's composite one). A range is not: a server may answer it
            # with the whole object's checksum, and the object format's block CRCs check ranges.
            kwargs["ChecksumMode"] = "ENABLED"

        def call() -> bytes:
            return self._client.get_object(**kwargs)["Body"].read()
        try:
            return self._request("get", "get", key, call)
        except ClientError as e:
            code = e.response.get("Error", {}).get("Code")
            if code in _NOT_FOUND_CODES:
                raise ObjectNotFoundError(f"no object {key!r} in {self.url}") from e
            if code == "InvalidRange":
                return b""  # the range starts at or past the end: nothing there
            raise self._error("get", key, e) from e

    def size(self, key: str) -> int:
        """Size in bytes; ObjectNotFoundError if missing."""
        full_key = self._full_key(key)
        try:
            response = self._request("head", "size", key, lambda: self._client.head_object(
                Bucket=self.bucket, Key=full_key))
        except ClientError as e:
            if e.response.get("Error", {}).get("Code") in _NOT_FOUND_CODES:
                raise ObjectNotFoundError(f"no object {key!r} in {self.url}") from e
            raise self._error("size", key, e) from e
        return int(response["ContentLength"])

    def delete(self, keys: Iterable[str]) -> None:
        """Delete the objects in batches of 1000; missing keys are not an error."""
        batch: list[str] = []
        for key in keys:
            batch.append(key)
            if len(batch) == DELETE_BATCH:
                self._delete_batch(batch)
                batch = []
        if batch:
            self._delete_batch(batch)

    def _delete_batch(self, keys: list[str]) -> None:
        objects = [{"Key": self._full_key(k)} for k in keys]
        label = keys[0] if len(keys) == 1 else f"{keys[0]} (+{len(keys) - 1} more)"
        try:
            response = self._request("delete", "delete", label, lambda: self._client.delete_objects(
                Bucket=self.bucket, Delete={"Objects": objects, "Quiet": True}))
        except ClientError as e:
            raise self._error("delete", label, e) from e
        errors = [err for err in response.get("Errors", []) if err.get("Code") != "NoSuchKey"]
        if errors:
            first = errors[0]
            raise ObjectStoreError(
                f"S3 delete in {self.url} failed for {len(errors)} key(s), e.g. "
                f"{first.get('Key')!r}: {first.get('Code')} {first.get('Message')}")

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        """ObjectInfo of every object whose key starts with `prefix`, keys ascending."""
        strip = len(self.prefix) + 1 if self.prefix else 0
        full_prefix = (self.prefix + "/" if self.prefix else "") + prefix
        kwargs: dict[str, Any] = {"Bucket": self.bucket, "Prefix": full_prefix}
        while True:
            try:
                page = self._request("list", "list", prefix, lambda: self._client.list_objects_v2(
                    **kwargs))
            except ClientError as e:
                raise self._error("list", prefix, e) from e
            for item in page.get("Contents", []):
                # Checked here too: rclone's serve s3 takes a prefix "/" for none.
                if item["Key"].startswith(full_prefix):
                    yield ObjectInfo(item["Key"][strip:], int(item["Size"]))
            if not page.get("IsTruncated"):
                return
            kwargs["ContinuationToken"] = page["NextContinuationToken"]

    def ensure_bucket(self, create: bool = False) -> None:
        """Check that the bucket exists; create it if `create`, else raise ConfigError.
        A 403 on the check is let through: credentials may allow object access only."""
        try:
            self._client.head_bucket(Bucket=self.bucket)
            return
        except ClientError as e:
            code = e.response.get("Error", {}).get("Code")
            if code in ("403", "AccessDenied"):
                return
            if code not in ("404", "NoSuchBucket", "NotFound"):
                raise self._error("head bucket", self.bucket, e) from e
        except BotoCoreError as e:
            raise ObjectStoreError(f"S3 head bucket of {self.url} failed: {e}") from e
        if not create:
            raise ConfigError(
                f"S3 bucket {self.bucket!r} does not exist; create it, or add create_bucket=1 to "
                f"the store URL to have it created")
        region = self._client.meta.region_name
        kwargs: dict[str, Any] = {"Bucket": self.bucket}
        if region and region != "us-east-1":
            kwargs["CreateBucketConfiguration"] = {"LocationConstraint": region}
        try:
            self._client.create_bucket(**kwargs)
        except ClientError as e:
            if e.response.get("Error", {}).get("Code") not in ("BucketAlreadyOwnedByYou",):
                raise self._error("create bucket", self.bucket, e) from e
        except BotoCoreError as e:
            raise ObjectStoreError(f"S3 create bucket of {self.url} failed: {e}") from e

    def stats(self) -> dict[str, int]:
        """Requests issued so far, by kind (botocore's internal retries are not counted)."""
        with self._stats_lock:
            return dict(self._stats)

    def close(self) -> None:
        """Stop the part uploader and close the client (if the store made it)."""
        self._executor.shutdown(wait=True)
        if self._owns_client:
            self._client.close()

    def __repr__(self) -> str:
        return f"S3ObjectStore({self.url!r})"

"""The CRI image service (``runtime.v1.ImageService``) over the container runtime's socket.

This is the gRPC call kubelet makes to pull an image, so an image pulled here
is found by kubelet later (containerd keeps CRI images in the ``k8s.io``
namespace). The few CRI v1 messages needed are declared here from their field
numbers in ``k8s.io/cri-api/pkg/apis/runtime/v1/api.proto`` and built with
protobuf's descriptor API: no generated code, so no protobuf runtime version
pinning and no pure-Python protobuf switch (the ``kubernetes-cri`` package's
generated module needs both and still names the old ``runtime`` package).
Fields not declared here (annotations, the verbose ``info`` map, pod sandbox
config) are skipped on the wire by protobuf's unknown-field handling.
"""

from __future__ import annotations

import base64
import json
import time
from dataclasses import dataclass
from pathlib import Path

import grpc
from google.protobuf import descriptor_pb2, descriptor_pool

from forecaster.agent.errors import AgentError
from forecaster.contracts.actions import FailureReason, classify_pull_message

_F = descriptor_pb2.FieldDescriptorProto
_PACKAGE = "runtime.v1"


def _message(fdp: descriptor_pb2.FileDescriptorProto, name: str, fields: list[tuple]) -> None:
    msg = fdp.message_type.add(name=name)
    for number, field_name, ftype, *rest in fields:
        label = _F.LABEL_REPEATED if "repeated" in rest else _F.LABEL_OPTIONAL
        f = msg.field.add(name=field_name, number=number, type=ftype, label=label)
        type_name = next((r for r in rest if r != "repeated"), None)
        if type_name:
            f.type_name = f".{_PACKAGE}.{type_name}"


def _build_messages() -> dict[str, type]:
    fdp = descriptor_pb2.FileDescriptorProto(name="prewarm/cri_image_v1.proto", package=_PACKAGE, syntax="proto3")
    _message(fdp, "ImageSpec", [(1, "image", _F.TYPE_STRING)])
    _message(fdp, "AuthConfig", [
        (1, "username", _F.TYPE_STRING), (2, "password", _F.TYPE_STRING), (3, "auth", _F.TYPE_STRING),
        (4, "server_address", _F.TYPE_STRING), (5, "identity_token", _F.TYPE_STRING),
        (6, "registry_token", _F.TYPE_STRING),
    ])
    _message(fdp, "Image", [
        (1, "id", _F.TYPE_STRING), (2, "repo_tags", _F.TYPE_STRING, "repeated"),
        (3, "repo_digests", _F.TYPE_STRING, "repeated"), (4, "size", _F.TYPE_UINT64),
        (8, "pinned", _F.TYPE_BOOL),
    ])
    _message(fdp, "PullImageRequest", [(1, "image", _F.TYPE_MESSAGE, "ImageSpec"),
                                       (2, "auth", _F.TYPE_MESSAGE, "AuthConfig")])
    _message(fdp, "PullImageResponse", [(1, "image_ref", _F.TYPE_STRING)])
    _message(fdp, "ImageStatusRequest", [(1, "image", _F.TYPE_MESSAGE, "ImageSpec"), (2, "verbose", _F.TYPE_BOOL)])
    _message(fdp, "ImageStatusResponse", [(1, "image", _F.TYPE_MESSAGE, "Image")])
    _message(fdp, "ImageFilter", [(1, "image", _F.TYPE_MESSAGE, "ImageSpec")])
    _message(fdp, "ListImagesRequest", [(1, "filter", _F.TYPE_MESSAGE, "ImageFilter")])
    _message(fdp, "ListImagesResponse", [(1, "images", _F.TYPE_MESSAGE, "repeated", "Image")])
    _message(fdp, "RemoveImageRequest", [(1, "image", _F.TYPE_MESSAGE, "ImageSpec")])
    _message(fdp, "RemoveImageResponse", [])
    pool = descriptor_pool.DescriptorPool()
    pool.Add(fdp)
    try:
        from google.protobuf.message_factory import GetMessageClass
    except ImportError:  # protobuf < 4.22
        from google.protobuf.message_factory import MessageFactory

        GetMessageClass = MessageFactory(pool).GetPrototype  # noqa: N806
    return {m.name: GetMessageClass(pool.FindMessageTypeByName(f"{_PACKAGE}.{m.name}")) for m in fdp.message_type}


MESSAGES = _build_messages()
SERVICE = "/runtime.v1.ImageService/"


@dataclass(frozen=True)
class ImageInfo:
    """An image the runtime holds."""

    id: str
    repo_tags: tuple[str, ...]
    repo_digests: tuple[str, ...]
    size_bytes: int


def registry_host(image: str) -> str:
    """The registry host of an image reference (``docker.io`` when it names none)."""
    first, sep, _rest = image.partition("/")
    if sep and ("." in first or ":" in first or first == "localhost"):
        return first
    return "docker.io"


def registry_auth(auth_file: Path | None, image: str) -> dict | None:
    """Credentials for ``image``'s registry from a Docker config file (a ``.dockerconfigjson`` secret).

    The file is read on every call so that a rotated secret is picked up.

    Returns:
        ``{"username", "password"}`` (an ``auth`` entry decoded from base64 ``user:password``); None when the
        file has no entry for the host.
    """
    if auth_file is None:
        return None
    try:
        config = json.loads(Path(auth_file).read_text())
    except FileNotFoundError:
        raise AgentError(FailureReason.UNAUTHORISED, f"registry credentials file {auth_file} is missing",
                         temporary=False) from None
    except (OSError, ValueError) as exc:
        raise AgentError(FailureReason.UNAUTHORISED, f"cannot read registry credentials {auth_file}: {exc}",
                         temporary=False) from None
    host = registry_host(image)
    aliases = {host, f"https://{host}", f"http://{host}", f"https://{host}/v1/", f"http://{host}/v2/"}
    if host == "docker.io":
        aliases |= {"https://index.docker.io/v1/", "index.docker.io", "registry-1.docker.io"}
    for key, entry in (config.get("auths") or {}).items():
        if key.rstrip("/") in {a.rstrip("/") for a in aliases} and isinstance(entry, dict):
            # No server_address: containerd's CRI (ParseAuth) drops the credentials when that URL's host is not
            # the host it contacts, which for docker.io is registry-1.docker.io and for a mirrored registry the
            # mirror, so naming one made those pulls anonymous. Kubelet sends none either.
            if entry.get("username") is not None:
                return {"username": entry["username"], "password": entry.get("password", "")}
            if entry.get("auth"):
                user, _, password = base64.b64decode(entry["auth"]).decode().partition(":")
                return {"username": user, "password": password}
    return None


def _classify(exc: grpc.RpcError, what: str) -> AgentError:
    code = exc.code() if hasattr(exc, "code") else None
    detail = (exc.details() if hasattr(exc, "details") else str(exc)) or str(code)
    message = f"{what}: {detail}"
    if code == grpc.StatusCode.UNAVAILABLE:
        return AgentError(FailureReason.RUNTIME_UNAVAILABLE, message, temporary=True)
    if code == grpc.StatusCode.UNIMPLEMENTED:
        return AgentError(FailureReason.RUNTIME_UNAVAILABLE, f"{message} (is the CRI plugin enabled?)",
                          temporary=False)
    if code in (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED):
        return AgentError(FailureReason.TIMEOUT, message, temporary=True)
    reason, temporary = classify_pull_message(detail, not_found_code=code == grpc.StatusCode.NOT_FOUND)
    if reason is FailureReason.INTERNAL and temporary:
        message += " (registry unreachable)"
    return AgentError(reason, message, temporary=temporary)


class CriImageService:
    """Client of ``runtime.v1.ImageService`` on a Unix socket.

    Args:
        socket_path: the runtime's CRI socket (containerd: ``/run/containerd/containerd.sock``).
    """

    def __init__(self, socket_path: Path | str) -> None:
        self.socket_path = str(socket_path)
        self._channel = grpc.insecure_channel(f"unix://{self.socket_path}")
        self._calls = {}
        for method, req, resp in (("PullImage", "PullImageRequest", "PullImageResponse"),
                                  ("ImageStatus", "ImageStatusRequest", "ImageStatusResponse"),
                                  ("ListImages", "ListImagesRequest", "ListImagesResponse"),
                                  ("RemoveImage", "RemoveImageRequest", "RemoveImageResponse")):
            self._calls[method] = self._channel.unary_unary(
                SERVICE + method, request_serializer=MESSAGES[req].SerializeToString,
                response_deserializer=MESSAGES[resp].FromString)

    def close(self) -> None:
        self._channel.close()

    def pull_image(self, image: str, *, auth: dict | None = None, deadline: float,
                   still_wanted=lambda: True) -> str:
        """Pull ``image``; returns the image id (``sha256:...``).

        Args:
            image: the reference as a pod spec would name it.
            auth: credentials (see :func:`registry_auth`).
            deadline: ``time.monotonic()`` value after which the pull is cancelled.
            still_wanted: polled about once a second; returning False cancels the pull.
                It may also return a new monotonic deadline (later joiners extend it).

        Raises:
            AgentError: with the reason from the fixed set.
        """
        request = MESSAGES["PullImageRequest"](image=MESSAGES["ImageSpec"](image=image))
        if auth:
            request.auth.CopyFrom(MESSAGES["AuthConfig"](**auth))
        call = self._calls["PullImage"].future(request)
        while True:
            extended = still_wanted()
            if extended is False:
                call.cancel()
                raise AgentError(FailureReason.TIMEOUT, f"pull of {image} cancelled: nobody waits for it any more")
            if isinstance(extended, float):
                deadline = max(deadline, extended)
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                call.cancel()
                raise AgentError(FailureReason.TIMEOUT, f"pull of {image} did not finish before its deadline")
            try:
                return call.result(timeout=min(1.0, remaining)).image_ref
            except grpc.FutureTimeoutError:
                continue
            except grpc.RpcError as exc:
                raise _classify(exc, f"pull of {image}") from None

    def image_status(self, image: str, *, timeout_s: float = 10.0) -> ImageInfo | None:
        """The image if the runtime holds it, else None."""
        request = MESSAGES["ImageStatusRequest"](image=MESSAGES["ImageSpec"](image=image))
        try:
            response = self._calls["ImageStatus"](request, timeout=timeout_s)
        except grpc.RpcError as exc:
            raise _classify(exc, f"status of {image}") from None
        if not response.HasField("image") or not response.image.id:
            return None
        return _info(response.image)

    def list_images(self, *, timeout_s: float = 10.0) -> list[ImageInfo]:
        try:
            response = self._calls["ListImages"](MESSAGES["ListImagesRequest"](), timeout=timeout_s)
        except grpc.RpcError as exc:
            raise _classify(exc, "list images") from None
        return [_info(i) for i in response.images]

    def remove_image(self, image: str, *, timeout_s: float = 30.0) -> None:
        request = MESSAGES["RemoveImageRequest"](image=MESSAGES["ImageSpec"](image=image))
        try:
            self._calls["RemoveImage"](request, timeout=timeout_s)
        except grpc.RpcError as exc:
            raise _classify(exc, f"remove {image}") from None


def _info(image) -> ImageInfo:
    return ImageInfo(id=image.id, repo_tags=tuple(image.repo_tags), repo_digests=tuple(image.repo_digests),
                     size_bytes=int(image.size))

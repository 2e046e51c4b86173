"""gRPC bindings of KEDA's ``externalscaler.ExternalScaler``, read from the service descriptor of
``externalscaler_pb2`` (what ``externalscaler.proto`` declares), so they cannot drift from the proto.

This replaces protoc's ``*_pb2_grpc.py``: that module's servicer base class answers every RPC with UNIMPLEMENTED,
which prewarm never wants (a method the proto gains without an implementation should fail at start-up, not at a
KEDA call). :func:`add_to_server` registers an implementation and refuses one that lacks an RPC; :class:`Stub` is
the client (tests, benchmarks, an operator's probe).
"""

from __future__ import annotations

import grpc

from api.proto import externalscaler_pb2 as pb

SERVICE = pb.DESCRIPTOR.services_by_name["ExternalScaler"]


def _messages(method) -> tuple[type, type]:
    """The request and response classes of a method of :data:`SERVICE`."""
    return getattr(pb, method.input_type.name), getattr(pb, method.output_type.name)


def add_to_server(service: object, server) -> None:
    """Serve every RPC of :data:`SERVICE` on ``server`` (sync or ``grpc.aio``) with ``service``'s method of that name.

    Raises:
        TypeError: ``service`` lacks one of the proto's RPCs.
    """
    handlers = {}
    missing = [m.name for m in SERVICE.methods if not callable(getattr(service, m.name, None))]
    if missing:
        raise TypeError(f"{type(service).__name__} does not implement {', '.join(missing)} of {SERVICE.full_name}")
    for method in SERVICE.methods:
        request, response = _messages(method)
        if method.client_streaming:
            raise TypeError(f"{SERVICE.full_name}/{method.name}: client streaming is not supported")
        make = grpc.unary_stream_rpc_method_handler if method.server_streaming else grpc.unary_unary_rpc_method_handler
        handlers[method.name] = make(getattr(service, method.name), request_deserializer=request.FromString,
                                     response_serializer=response.SerializeToString)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE.full_name, handlers),))
    server.add_registered_method_handlers(SERVICE.full_name, handlers)


class Stub:
    """Client of :data:`SERVICE` on ``channel``: one callable attribute per RPC (``stub.GetMetrics(request)``)."""

    def __init__(self, channel) -> None:
        for method in SERVICE.methods:
            request, response = _messages(method)
            call = channel.unary_stream if method.server_streaming else channel.unary_unary
            setattr(self, method.name, call(f"/{SERVICE.full_name}/{method.name}",
                                            request_serializer=request.SerializeToString,
                                            response_deserializer=response.FromString, _registered_method=True))

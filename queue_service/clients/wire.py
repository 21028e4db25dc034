"""The client API on the server, registered so that a request that does not parse is refused
with INVALID_ARGUMENT.

The generated ``add_TierflowServicer_to_server`` parses each request with ``FromString`` before
the servicer runs; when that raises (a string field that is not valid UTF-8, a truncated or
garbled message), grpc answers UNKNOWN with the Python exception's text. Registered here, each
method parses its request itself, and one that does not parse reaches the servicer as
``Unparsable``, which it refuses (``ClientApi``): the client's mistake, said as one.
"""

from __future__ import annotations

from dataclasses import dataclass

import grpc
from google.protobuf.message import DecodeError

from tierflow.v1 import serving_pb2

SERVICE = serving_pb2.DESCRIPTOR.services_by_name["Tierflow"]


@dataclass(frozen=True)
class Unparsable:
    """A request whose bytes are not a valid message of its type."""

    type_name: str
    error: str

    @property
    def message(self) -> str:
        return f"the request is not a valid {self.type_name}: {self.error}"


def _parser(message_class):
    def parse(data: bytes):
        try:
            return message_class.FromString(data)
        except DecodeError as exc:
            return Unparsable(message_class.DESCRIPTOR.full_name, str(exc))

    return parse


def add_client_api(servicer, server: grpc.aio.Server) -> None:
    """``tierflow.v1.Tierflow`` on ``server``, like the generated registration except for how
    requests are parsed."""
    handlers = {}
    for method in SERVICE.methods:
        request_class = getattr(serving_pb2, method.input_type.name)
        response_class = getattr(serving_pb2, method.output_type.name)
        make = (
            grpc.unary_stream_rpc_method_handler
            if method.server_streaming
            else grpc.unary_unary_rpc_method_handler
        )
        handlers[method.name] = make(
            getattr(servicer, method.name),
            request_deserializer=_parser(request_class),
            response_serializer=response_class.SerializeToString,
        )
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(SERVICE.full_name, handlers),)
    )
    server.add_registered_method_handlers(SERVICE.full_name, handlers)

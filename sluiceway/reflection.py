"""gRPC server reflection under both of its names: `grpc.reflection.v1` (grpcurl, Postman,
grpc-java and grpc-go clients ask for it first) and `grpc.reflection.v1alpha` (older ones).

grpcio-reflection ships v1alpha only (grpc/grpc#38576). The v1 proto is v1alpha's under
another package: the same messages with the same field numbers, so v1alpha's servicer
answers a v1 call byte for byte. v1's descriptors, v1alpha's renamed, go into the default
pool, so that reflection describes the v1 service as well.
"""

from __future__ import annotations

from collections.abc import Sequence

import grpc
from google.protobuf import descriptor_pb2, descriptor_pool
from google.protobuf.descriptor import FileDescriptor
from grpc_reflection.v1alpha import reflection, reflection_pb2, reflection_pb2_grpc

V1ALPHA_PACKAGE = reflection_pb2.DESCRIPTOR.package  # grpc.reflection.v1alpha
V1_PACKAGE = "grpc.reflection.v1"
V1_FILE = "grpc/reflection/v1/reflection.proto"  # its name in grpc's source tree
V1ALPHA_SERVICE_NAME: str = reflection.SERVICE_NAME
V1_SERVICE_NAME = f"{V1_PACKAGE}.ServerReflection"


def v1_file_descriptor() -> FileDescriptor:
    """The v1 reflection proto's descriptor in the default pool (added on the first call):
    v1alpha's, with every name and the Go and Java package options moved to v1's (as in
    grpc's grpc/reflection/v1/reflection.proto), and not deprecated."""
    pool = descriptor_pool.Default()
    try:
        return pool.FindFileByName(V1_FILE)
    except KeyError:
        pass
    proto = descriptor_pb2.FileDescriptorProto()
    reflection_pb2.DESCRIPTOR.CopyToProto(proto)
    proto.name, proto.package = V1_FILE, V1_PACKAGE
    proto.options.go_package = "google.golang.org/grpc/reflection/grpc_reflection_v1"
    proto.options.java_package = "io.grpc.reflection.v1"
    proto.options.ClearField("deprecated")
    old, new = f".{V1ALPHA_PACKAGE}.", f".{V1_PACKAGE}."
    for message in proto.message_type:
        for field in message.field:
            if field.type_name:  # a message field's
                field.type_name = field.type_name.replace(old, new)
    for method in proto.service[0].method:
        method.input_type = method.input_type.replace(old, new)
        method.output_type = method.output_type.replace(old, new)
    pool.Add(proto)
    return pool.FindFileByName(V1_FILE)


def enable_server_reflection(service_names: Sequence[str], server: grpc.aio.Server) -> None:
    """Serves reflection of `service_names` (fully qualified) on `server`, under v1 and
    v1alpha; both list the same services, `service_names` and the two reflection
    services. Call before `server.start()`."""
    v1_file_descriptor()
    names = [*service_names, V1_SERVICE_NAME, V1ALPHA_SERVICE_NAME]
    servicer = reflection.aio.ReflectionServicer(names)
    reflection_pb2_grpc.add_ServerReflectionServicer_to_server(servicer, server)
    v1 = grpc.stream_stream_rpc_method_handler(
        servicer.ServerReflectionInfo,
        request_deserializer=reflection_pb2.ServerReflectionRequest.FromString,
        response_serializer=reflection_pb2.ServerReflectionResponse.SerializeToString,
    )
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(V1_SERVICE_NAME, {"ServerReflectionInfo": v1}),)
    )

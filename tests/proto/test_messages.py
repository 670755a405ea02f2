"""Every control message encodes and decodes equal inside an Envelope; the contracts' shape rules hold."""

from __future__ import annotations

from typing import Any

import pytest
from google.protobuf import descriptor_pb2, message_factory
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import Message

from splitserve.v1 import control_pb2, serving_pb2
from splitserve.wire import pack_ids

FD = FieldDescriptor
# Extreme values, so varint and sign handling are exercised too.
_SCALARS: dict[int, Any] = {
    FD.TYPE_INT32: -(2**31),
    FD.TYPE_UINT32: 2**32 - 1,
    FD.TYPE_INT64: -(2**63),
    FD.TYPE_UINT64: 2**64 - 1,
    FD.TYPE_FLOAT: 0.25,
    FD.TYPE_DOUBLE: 1e-300,
    FD.TYPE_BOOL: True,
    FD.TYPE_STRING: "ünïcode ✓",
    FD.TYPE_BYTES: pack_ids([0, 2**31 - 1, -1]),
}
ENVELOPE_MEMBERS = [f.name for f in control_pb2.Envelope.DESCRIPTOR.oneofs_by_name["msg"].fields]


def _proto3_optional(descriptor: Descriptor) -> set[str]:
    proto = descriptor_pb2.DescriptorProto()
    descriptor.CopyToProto(proto)
    return {f.name for f in proto.field if f.proto3_optional}


def filled(descriptor: Descriptor) -> Message:
    """An instance of `descriptor` with every field set to a non-default value (first member of each oneof)."""
    msg = message_factory.GetMessageClass(descriptor)()
    if descriptor.full_name == "google.protobuf.Struct":
        msg.update({"enable_thinking": False, "depth": 2.0})  # type: ignore[attr-defined]
        return msg
    optional = _proto3_optional(descriptor)
    oneofs_done: set[str] = set()
    for field in descriptor.fields:
        oneof = field.containing_oneof
        if oneof is not None and field.name not in optional:
            if oneof.name in oneofs_done:
                continue
            oneofs_done.add(oneof.name)
        _set(msg, field)
    return msg


def _value(field: FieldDescriptor) -> Any:
    if field.enum_type is not None:
        return field.enum_type.values[-1].number
    return _SCALARS[field.type]


def _set(msg: Message, field: FieldDescriptor) -> None:
    repeated = field.is_repeated
    if field.message_type is not None:
        values = [filled(field.message_type) for _ in range(2 if repeated else 1)]
        if repeated:
            getattr(msg, field.name).extend(values)
        else:
            getattr(msg, field.name).CopyFrom(values[0])
    elif repeated:
        getattr(msg, field.name).extend([_value(field)] * 2)
    else:
        setattr(msg, field.name, _value(field))


@pytest.mark.parametrize("member", ENVELOPE_MEMBERS)
def test_control_message_round_trips_in_envelope(member: str) -> None:
    inner_descriptor = control_pb2.Envelope.DESCRIPTOR.fields_by_name[member].message_type
    assert inner_descriptor is not None
    inner = filled(inner_descriptor)
    assert inner.ListFields(), "filler set nothing"
    envelope = control_pb2.Envelope()
    getattr(envelope, member).CopyFrom(inner)
    decoded = control_pb2.Envelope.FromString(envelope.SerializeToString())
    assert decoded.WhichOneof("msg") == member
    assert getattr(decoded, member) == inner
    assert decoded == envelope


@pytest.mark.parametrize("name", sorted(serving_pb2.DESCRIPTOR.message_types_by_name))
def test_public_message_round_trips(name: str) -> None:
    msg = filled(serving_pb2.DESCRIPTOR.message_types_by_name[name])
    assert type(msg).FromString(msg.SerializeToString()) == msg


def _reachable(descriptor: Descriptor, seen: set[str]) -> set[str]:
    if descriptor.full_name not in seen:
        seen.add(descriptor.full_name)
        for field in descriptor.fields:
            if field.message_type is not None:
                _reachable(field.message_type, seen)
    return seen


def test_every_control_message_travels_in_the_envelope() -> None:
    reachable = _reachable(control_pb2.Envelope.DESCRIPTOR, set())
    defined = {d.full_name for d in control_pb2.DESCRIPTOR.message_types_by_name.values()}
    assert defined - reachable == set(), "control messages no Envelope member can carry"
    assert len(ENVELOPE_MEMBERS) == len(control_pb2.Envelope.DESCRIPTOR.fields), (
        "Envelope fields outside `msg`"
    )


def test_control_id_lists_are_packed_bytes() -> None:
    """No repeated integer field in control.proto: ids travel as packed bytes (splitserve.wire)."""
    integer_types = {
        FD.TYPE_INT32,
        FD.TYPE_UINT32,
        FD.TYPE_INT64,
        FD.TYPE_UINT64,
        FD.TYPE_SINT32,
        FD.TYPE_SINT64,
    }
    offenders = [
        f"{d.name}.{f.name}"
        for d in control_pb2.DESCRIPTOR.message_types_by_name.values()
        for f in d.fields
        if f.is_repeated and f.type in integer_types
    ]
    assert offenders == []


def test_control_reuses_public_enums_and_pool_messages() -> None:
    fields = control_pb2.Heartbeat.DESCRIPTOR.fields_by_name
    assert fields["pool"].message_type is serving_pb2.KvPoolState.DESCRIPTOR
    assert fields["load"].message_type is serving_pb2.WorkerLoad.DESCRIPTOR
    assert (
        control_pb2.Tokens.DESCRIPTOR.fields_by_name["finish_reason"].enum_type
        is serving_pb2.FinishReason.DESCRIPTOR
    )
    assert (
        control_pb2.Register.DESCRIPTOR.fields_by_name["role"].enum_type is serving_pb2.WorkerRole.DESCRIPTOR
    )

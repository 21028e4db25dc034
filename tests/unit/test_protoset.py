"""`tierflow protoset` writes a descriptor set that needs nothing else: what grpcurl's
``-protoset`` (and Envoy's transcoder) read, with the google/api imports included."""

from __future__ import annotations

from google.protobuf import descriptor_pb2, descriptor_pool

from launch.cli import main


def test_the_descriptor_set_is_self_contained(tmp_path, capsys):
    out = tmp_path / "tierflow.pb"
    assert main(["protoset", "--out", str(out)]) == 0
    assert str(out) in capsys.readouterr().out
    files = descriptor_pb2.FileDescriptorSet.FromString(out.read_bytes())
    names = {f.name for f in files.file}
    assert {
        "tierflow/v1/serving.proto",
        "tierflow/v1/queue.proto",
        "google/api/annotations.proto",
        "google/api/http.proto",
        "google/protobuf/descriptor.proto",
    } <= names
    pool = descriptor_pool.DescriptorPool()
    for f in files.file:  # in dependency order, each import present: it loads on its own
        pool.Add(f)
    service = pool.FindServiceByName("tierflow.v1.Tierflow")
    assert {m.name for m in service.methods} >= {"Generate", "GetRequest"}
    assert pool.FindMessageTypeByName("tierflow.v1.QueuedRequest")

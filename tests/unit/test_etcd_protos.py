"""``store.etcd_protos``: etcd3's protobuf modules rebuilt so that protobuf's C implementation loads
them; the descriptors must be etcd3's own, byte for byte."""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys

from elasticd.store.etcd_protos import MODULES, descriptor_bytes


def test_the_descriptors_are_etcd3s_own() -> None:
    """etcd3's modules load only in pure Python: read theirs in a fresh interpreter in that mode."""
    code = (
        "import base64, json\n"
        "from etcd3.etcdrpc import kv_pb2, auth_pb2, rpc_pb2\n"
        "print(json.dumps({n: base64.b64encode(m.DESCRIPTOR.serialized_pb).decode()\n"
        "                  for n, m in (('kv', kv_pb2), ('auth', auth_pb2), ('rpc', rpc_pb2))}))\n"
    )
    env = os.environ | {"PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION": "python"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60, check=True)
    theirs = json.loads(out.stdout)
    for name in MODULES:
        assert descriptor_bytes(name) == base64.b64decode(theirs[name]), name


def test_the_client_runs_on_the_c_implementation_and_etcd3_uses_the_rebuilt_messages() -> None:
    code = (
        "import elasticd.store.etcd, etcd3\n"
        "from google.protobuf.internal import api_implementation\n"
        "r = etcd3.etcdrpc.RangeRequest(key=b'/a', limit=3)\n"
        "print(api_implementation.Type(), type(r).__module__, etcd3.etcdrpc.Compare.EQUAL,\n"
        "      etcd3.etcdrpc.RangeRequest.FromString(r.SerializeToString()).limit)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.split() == ["upb", "etcd3.etcdrpc.rpc_pb2", "0", "3"]

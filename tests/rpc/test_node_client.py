"""The public contract from outside Python: a Node.js @grpc/grpc-js client (tests/node_client/client.js),
given only the shipped .proto files, calls health, Generate and GenerateStream on `pdllm serve --role all`.

Skipped only when `node` or the client's npm packages are missing: `.ci/setup.sh` installs both, and
leaves the packages out (with a warning) when the npm registry cannot be reached.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import grpc
import pytest
from google.protobuf import json_format

from pdllm.protos.pdllm.v1 import generation_pb2 as pb
from pdllm.shared.rpc.client import PdllmClient
from tests.services.cluster import ServeProcess

NODE_CLIENT = Path(__file__).resolve().parents[1] / "node_client"
TOKEN = "node-client-test-token"
# The shipped model, asked for a fact the context lacks, at temperature 1: the answer (a number) depends on
# the seed, so the seed must reach the server intact for the two clients to agree.
REQUEST = {
    "context": "The archive reopened in spring. The access code of Mira Halden is 4821. The maps date from 1912. "
    * 3,
    "question": "What is the badge number of Then Themvom?",
    "generation": {"gen_length": 8, "steps": 8, "block_length": 4, "temperature": 1.0, "seed": 7},
    "method": {"method": "pdllm", "chunk_size": 32, "top_k": 2},
    # A message added after the first release (DecodePolicyParams): proto-loader must find it in the shipped files.
    "decode_policy": {"decode_policy": "dual-cache"},
}


def _node() -> str:
    node = shutil.which("node") or shutil.which("nodejs")
    if node is None:
        pytest.skip("node is not installed (Debian: apt-get install nodejs npm)")
    for package in ("@grpc/grpc-js", "@grpc/proto-loader"):
        if not (NODE_CLIENT / "node_modules" / package / "package.json").is_file():
            pytest.skip(
                f"{package} is not installed: run `npm ci --prefix {NODE_CLIENT}` (needs the npm registry)"
            )
    return node


@pytest.fixture(scope="module")
def server():
    node = _node()  # skip before paying for a server
    proc = ServeProcess(
        "all", ["--port", "0", "--metrics-port", "-1"], env={"PDLLM_AUTH_TOKEN": TOKEN}
    ).start()
    yield node, proc.address
    proc.kill()


def _run_node(node: str, address: str, token: str | None) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "PDLLM_AUTH_TOKEN"}
    if token:
        env["PDLLM_AUTH_TOKEN"] = token
    done = subprocess.run(
        [node, str(NODE_CLIENT / "client.js"), address, json.dumps(REQUEST)],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_node_client_matches_the_python_client(server) -> None:
    node, address = server
    got = _run_node(node, address, TOKEN)
    assert got["health"] == {"": "SERVING", "pdllm.v1.Generation": "SERVING"}

    with PdllmClient(address, token=TOKEN) as client:
        expected = client.generate_request(json_format.ParseDict(REQUEST, pb.GenerateRequest()))
    unary = got["unary"]
    assert "error" not in unary, unary
    assert unary["text"].strip() and unary["text"] == expected.text
    assert unary["token_ids"] == list(expected.token_ids)
    assert unary["finish_reason"] == expected.finish_reason
    assert unary["trace"]["method"] == "pdllm" and len(unary["trace"]["selected_chunk_ids"]) == 2
    assert unary["trace"]["decode_policy"]["policy"] == "dual-cache"
    assert unary["trace"]["decode_policy"]["refreshes"] == 2  # one per block

    stream = got["stream"]
    assert "error" not in stream, stream
    unmasked = [p["unmasked"] for p in stream["partials"]]
    assert unmasked and unmasked == sorted(unmasked) and unmasked[-1] == 8
    assert [p["step"] for p in stream["partials"]] == list(range(1, len(unmasked) + 1))
    (final,) = stream["finals"]
    assert (final["text"], final["token_ids"]) == (unary["text"], unary["token_ids"])


def test_node_client_without_token_gets_health_only(server) -> None:
    node, address = server
    got = _run_node(node, address, None)
    assert got["health"][""] == "SERVING"
    assert got["unary"]["error"]["code"] == grpc.StatusCode.UNAUTHENTICATED.value[0]
    assert got["stream"]["error"]["code"] == grpc.StatusCode.UNAUTHENTICATED.value[0]
    assert got["stream"]["partials"] == [] and got["stream"]["finals"] == []

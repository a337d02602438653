"""A loopback HTTP server that speaks the discovery.k8s.io/v1 EndpointSlice list/watch API shape.

It keeps objects and an event history keyed by resourceVersion like the API server does: a list returns the
current objects and the collection resourceVersion; a watch from resourceVersion N streams every later event as
newline-delimited JSON, then blocks for new ones until it expires; a watch from a version older than the
compacted history gets the API server's ``ERROR`` event with a 410 ``Expired`` Status and the stream ends.
Objects are built from ``data/endpointslice_list.json`` (the API's response format for EndpointSliceList).
"""

from __future__ import annotations

import copy
import json
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlparse

from kubernetes import client

DATA = Path(__file__).parent / "data"
NAMESPACE = "pdllm"
PATH = f"/apis/discovery.k8s.io/v1/namespaces/{NAMESPACE}/endpointslices"


def recorded_list() -> dict[str, Any]:
    return json.loads((DATA / "endpointslice_list.json").read_text())


def make_slice(name: str, service: str, endpoints: list[tuple[str, bool | None]]) -> dict[str, Any]:
    """An EndpointSlice shaped like the recorded one, with the given (ip, ready) endpoints."""
    template = copy.deepcopy(recorded_list()["items"][0])
    template["metadata"].update(name=name, uid=f"uid-{name}")
    template["metadata"]["labels"]["kubernetes.io/service-name"] = service
    base_endpoint = template["endpoints"][0]
    template["endpoints"] = []
    for ip, ready in endpoints:
        endpoint = copy.deepcopy(base_endpoint)
        endpoint["addresses"] = [ip]
        endpoint["conditions"] = (
            {} if ready is None else {"ready": ready, "serving": ready, "terminating": False}
        )
        template["endpoints"].append(endpoint)
    return template


class FakeApiServer:
    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.rv = 1000
        self.objects: dict[str, dict[str, Any]] = {}
        self.history: list[tuple[int, str, dict[str, Any]]] = []
        self.compacted_rv = 0
        self.generation = 0  # bumping it ends every open watch (server-side expiry)
        self.hold = False  # while set, watches do not deliver events (a stalled connection)
        self.fail_with: int | None = None  # answer every request with this HTTP status
        self.requests: list[dict[str, list[str]]] = []
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.httpd.daemon_threads = True
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def api_client(self) -> client.ApiClient:
        config = client.Configuration()
        config.host = self.url
        return client.ApiClient(config)

    def apply(self, obj: dict[str, Any]) -> None:
        with self.cond:
            self.rv += 1
            obj = copy.deepcopy(obj)
            obj["metadata"]["resourceVersion"] = str(self.rv)
            kind = "MODIFIED" if obj["metadata"]["name"] in self.objects else "ADDED"
            self.objects[obj["metadata"]["name"]] = obj
            self.history.append((self.rv, kind, obj))
            self.cond.notify_all()

    def delete(self, name: str) -> None:
        with self.cond:
            self.rv += 1
            obj = self.objects.pop(name)
            obj["metadata"]["resourceVersion"] = str(self.rv)
            self.history.append((self.rv, "DELETED", obj))
            self.cond.notify_all()

    def compact(self) -> None:
        """Forget history up to now, as etcd compaction does: older watch versions become 410 Gone."""
        with self.cond:
            self.compacted_rv = self.rv
            self.history.clear()

    def expire_watches(self) -> None:
        with self.cond:
            self.generation += 1
            self.cond.notify_all()

    def set_hold(self, hold: bool) -> None:
        with self.cond:
            self.hold = hold
            self.cond.notify_all()

    def watch_requests(self) -> list[dict[str, list[str]]]:
        return [q for q in self.requests if q.get("watch") == ["true"]]

    def _matches(self, obj: dict[str, Any], selector: str) -> bool:
        if not selector:
            return True
        key, _, value = selector.partition("=")
        return obj["metadata"].get("labels", {}).get(key) == value

    def _list_body(self, selector: str) -> bytes:
        with self.cond:
            items = [copy.deepcopy(o) for o in self.objects.values() if self._matches(o, selector)]
            body = {
                "kind": "EndpointSliceList",
                "apiVersion": "discovery.k8s.io/v1",
                "metadata": {"resourceVersion": str(self.rv)},
                "items": items,
            }
        return json.dumps(body).encode()

    def _watch_events(self, selector: str, since: int, timeout_s: float) -> Iterator[bytes]:
        deadline = time.monotonic() + timeout_s
        with self.cond:
            if since < self.compacted_rv:
                status = {
                    "kind": "Status",
                    "apiVersion": "v1",
                    "metadata": {},
                    "status": "Failure",
                    "message": f"too old resource version: {since} ({self.compacted_rv})",
                    "reason": "Expired",
                    "code": 410,
                }
                yield (json.dumps({"type": "ERROR", "object": status}) + "\n").encode()
                return
            generation = self.generation
        cursor = since
        while True:
            with self.cond:
                pending = [] if self.hold else [e for e in self.history if e[0] > cursor]
                if not pending:
                    remaining = deadline - time.monotonic()
                    if self.generation != generation or remaining <= 0:
                        return
                    self.cond.wait(min(remaining, 0.2))
                    continue
            for rv, kind, obj in pending:
                cursor = rv
                if self._matches(obj, selector):
                    event = dict(obj, kind="EndpointSlice", apiVersion="discovery.k8s.io/v1")
                    yield (json.dumps({"type": kind, "object": event}) + "\n").encode()

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = (
                "HTTP/1.1"  # watches stream with chunked transfer encoding, as the API server does
            )

            def log_message(self, *args: Any) -> None:
                pass

            def do_GET(self) -> None:
                url = urlparse(self.path)
                query = parse_qs(url.query)
                server.requests.append(query)
                if url.path != PATH:
                    return self._send(404, b'{"kind":"Status","code":404}')
                if server.fail_with is not None:
                    status = {
                        "kind": "Status",
                        "apiVersion": "v1",
                        "code": server.fail_with,
                        "message": "boom",
                    }
                    return self._send(server.fail_with, json.dumps(status).encode())
                selector = query.get("labelSelector", [""])[0]
                if query.get("watch") != ["true"]:
                    return self._send(200, server._list_body(selector))
                since = int(query.get("resourceVersion", ["0"])[0])
                timeout_s = float(query.get("timeoutSeconds", ["30"])[0])
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()
                try:
                    for line in server._watch_events(selector, since, timeout_s):
                        self.wfile.write(b"%x\r\n%s\r\n" % (len(line), line))
                        self.wfile.flush()
                    self.wfile.write(b"0\r\n\r\n")
                except (BrokenPipeError, ConnectionResetError):
                    self.close_connection = True

            def _send(self, code: int, body: bytes) -> None:
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        return Handler


def wait_until(predicate: Callable[[], bool], timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return predicate()

"""A fake kubelet: the pod-resources v1 gRPC service on a unix socket, answering what the test
says (``pods``), or misbehaving as a broken kubelet does (``mode``)."""

from __future__ import annotations

import os
import socket
import threading
from collections.abc import Iterator
from concurrent import futures
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from exporter.core.podresources import api_pb2, api_pb2_grpc

#: (namespace, pod, container, resource, device IDs) for each container's devices
Pods = list[tuple[str, str, str, str, list[str]]]


def response(pods: Pods) -> Any:
    """A ListPodResourcesResponse of ``pods`` (one container per row; rows of one pod merge)."""
    answer = api_pb2.ListPodResourcesResponse()
    by_pod: dict[tuple[str, str], Any] = {}
    for namespace, pod, container, resource, devices in pods:
        entry = by_pod.get((namespace, pod))
        if entry is None:
            entry = by_pod[(namespace, pod)] = answer.pod_resources.add(
                name=pod, namespace=namespace
            )
        one = entry.containers.add(name=container)
        one.devices.add(resource_name=resource, device_ids=devices)
        one.cpu_ids.extend([0, 1])  # what the agent ignores, as a real kubelet sends it
    return answer


@dataclass
class FakeKubelet:
    """The running fake: change ``pods`` or ``mode`` at any time; ``calls`` counts Lists."""

    path: str
    pods: Pods = field(default_factory=list)
    #: "ok", "hang" (never answers), "error" (UNAVAILABLE), "garbage" (bytes that are not
    #: a ListPodResourcesResponse)
    mode: str = "ok"
    calls: int = 0
    released: threading.Event = field(default_factory=threading.Event)

    def list(self, request: Any, context: Any) -> Any:
        self.calls += 1
        if self.mode == "hang":
            self.released.wait(30)
        if self.mode == "error":
            context.abort(grpc.StatusCode.UNAVAILABLE, "kubelet is restarting")
        return response(self.pods)


class _Lister(api_pb2_grpc.PodResourcesListerServicer):
    def __init__(self, fake: FakeKubelet) -> None:
        self.fake = fake

    def List(self, request: Any, context: Any) -> Any:
        return self.fake.list(request, context)


def _serialize(message: Any) -> bytes:
    return message if isinstance(message, bytes) else message.SerializeToString()


class _Garbled(grpc.GenericRpcHandler):
    """Answers List with bytes that do not parse as its response, while mode is garbage."""

    def __init__(self, fake: FakeKubelet) -> None:
        self.fake = fake

    def service(self, details: Any) -> Any:
        if self.fake.mode != "garbage" or details.method != "/v1.PodResourcesLister/List":
            return None

        def garbled(request: Any, context: Any) -> bytes:
            self.fake.calls += 1
            return b"\x0a\xff\xff\xff\xff\x0f not a message"

        return grpc.unary_unary_rpc_method_handler(garbled, response_serializer=_serialize)


@contextmanager
def fake_kubelet(folder: Path, pods: Pods | None = None) -> Iterator[FakeKubelet]:
    """A fake kubelet listening on ``folder``/kubelet.sock until the block ends."""
    path = str(folder / "kubelet.sock")
    fake = FakeKubelet(path, list(pods or []))
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    server.add_generic_rpc_handlers((_Garbled(fake),))
    api_pb2_grpc.add_PodResourcesListerServicer_to_server(_Lister(fake), server)
    server.add_insecure_port(f"unix://{path}")
    server.start()
    try:
        yield fake
    finally:
        fake.released.set()
        server.stop(grace=None).wait(5)
        if os.path.exists(path):
            os.unlink(path)


@contextmanager
def raw_socket(folder: Path, reply: bytes) -> Iterator[str]:
    """A unix socket that is no kubelet: it writes ``reply`` to whoever connects and closes."""
    path = str(folder / "kubelet.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(8)
    listener.settimeout(0.2)
    stop = threading.Event()

    def answer() -> None:
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except OSError:
                continue
            with conn, suppress(OSError):
                conn.sendall(reply)

    thread = threading.Thread(target=answer, daemon=True)
    thread.start()
    try:
        yield path
    finally:
        stop.set()
        thread.join(5)
        listener.close()
        os.unlink(path)

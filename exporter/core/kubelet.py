"""Which container the kubelet allocated each device to: its pod-resources API (v1, gRPC over a
unix socket).

One ``List`` call per sample: :meth:`PodResourcesClient.begin` starts it when the sample starts,
:meth:`PodResourcesClient.finish` takes its answer at the end, so the kubelet answers while NVML
is read, and a kubelet that hangs costs the sample at most the call's timeout (shorter than the
interval). A socket that does not exist means "not a Kubernetes node": no call, no error.
Everything else that goes wrong (a path that is not a socket, no grpcio, a kubelet that refuses,
hangs or answers garbage) is a ``problem``: attribution from the kubelet is absent, the rest of
the sample goes on.

grpcio is imported on the first call only (the ``kubernetes`` extra): commands that never meet a
kubelet socket never pay for it.
"""

from __future__ import annotations

import os
import re
import stat
from collections.abc import Collection, Iterator
from dataclasses import dataclass
from typing import Any

DEFAULT_SOCKET = "/var/lib/kubelet/pod-resources/kubelet.sock"
#: The NVIDIA device plugin's resources: whole GPUs (``nvidia.com/gpu``; ``.shared`` when
#: time-slicing renames them) and MIG devices under the mixed strategy (``nvidia.com/mig-1g.10gb``).
GPU_RESOURCES = ("nvidia.com/gpu", "nvidia.com/gpu.shared", "nvidia.com/mig-*")
#: A resource name (``vendor.example/name``), or a prefix of names ending in ``*``.
RESOURCE_NAME = re.compile(r"[a-z0-9]([a-z0-9.-]*[a-z0-9])?/[A-Za-z0-9][A-Za-z0-9._-]*\*?")
_MAX_MESSAGE_BYTES = 16 << 20  # a kubelet of 250 pods answers in well under 1 MiB


@dataclass(frozen=True, slots=True)
class PodDevice:
    """One device the kubelet allocated to a container."""

    namespace: str
    pod: str
    container: str
    resource: str  # nvidia.com/gpu, ...
    device: str  # as the device plugin names it: GPU-..., MIG-..., an index; no ``::N`` suffix


@dataclass(frozen=True)
class PodDevices:
    """The kubelet's answer: the allocated devices of the resources asked for, or why there is
    none (``problem``; then ``devices`` is empty)."""

    devices: tuple[PodDevice, ...] = ()
    problem: str = ""


def resource_names(value: Any) -> tuple[str, ...]:
    """Resource names from config: a list, or one comma-separated string; ``*`` ends a prefix."""
    items = value.split(",") if isinstance(value, str) else value
    if not isinstance(items, (list, tuple)):
        raise ValueError(f"expected a list of resource names, got {value!r}")
    names = tuple(str(item).strip() for item in items if str(item).strip())
    for name in names:
        if not RESOURCE_NAME.fullmatch(name):
            raise ValueError(
                f"{name!r} is not a resource name like example.com/gpu"
                " (or a prefix of names: example.com/gpu-*)"
            )
    return names


def _wanted(resource: str, names: Collection[str]) -> bool:
    return any(
        resource.startswith(name[:-1]) if name.endswith("*") else resource == name for name in names
    )


class PodResourcesClient:
    """The kubelet's pod-resources API on ``socket``, for the GPU resources and ``resources``."""

    def __init__(self, socket: str, resources: Collection[str] = (), timeout: float = 1.0) -> None:
        self.socket = socket
        self.resources = (*GPU_RESOURCES, *resources)
        self.timeout = timeout
        self._channel: Any = None
        self._stub: Any = None
        self._grpc: Any = None
        self._call: Any = None
        self._state: PodDevices | None = None  # the answer when no call was made

    def begin(self) -> None:
        """Start this sample's call (a no-op without a socket)."""
        if self._call is not None:  # the last sample's, never finished
            self._call.cancel()
        self._call = None
        self._state = self._check()
        if self._state is not None:
            return
        try:
            self._call = self._connect().List.future(
                self._request(), timeout=self.timeout, wait_for_ready=False
            )
        except ImportError as exc:
            self._state = PodDevices(
                problem=f"{self.socket} exists but grpcio or protobuf cannot be imported ({exc}):"
                " install the kubernetes extra (pip install 'gpu-exporter[kubernetes]')"
            )

    def finish(self) -> PodDevices | None:
        """The answer of the call :meth:`begin` started; None where no kubelet socket exists."""
        if self._call is None:
            state = self._state
            self._state = None
            return None if state is _OFF else state
        call, self._call = self._call, None
        grpc = self._grpc
        try:
            response = call.result(timeout=self.timeout + 0.5)
        except grpc.FutureTimeoutError:
            call.cancel()
            return PodDevices(problem=f"{self.socket}: no answer within {self.timeout:g}s")
        except grpc.RpcError as exc:
            return PodDevices(problem=f"{self.socket}: {_describe(exc)}")
        try:
            return PodDevices(tuple(self._devices(response)))
        except (AttributeError, TypeError, ValueError) as exc:  # a message of another shape
            return PodDevices(problem=f"{self.socket}: unexpected answer: {exc}")

    def close(self) -> None:
        """Close the channel (a later :meth:`begin` opens another)."""
        if self._call is not None:
            self._call.cancel()
            self._call = None
        if self._channel is not None:
            self._channel.close()
        self._channel = self._stub = None

    def _check(self) -> PodDevices | None:
        """None when the socket is there to call; else the answer without a call."""
        try:
            mode = os.stat(self.socket).st_mode
        except FileNotFoundError:
            return _OFF
        except OSError as exc:
            return PodDevices(problem=f"{self.socket}: {exc.strerror or exc}")
        if not stat.S_ISSOCK(mode):
            return PodDevices(problem=f"{self.socket} is not a socket")
        return None

    def _connect(self) -> Any:
        if self._stub is None:
            import grpc

            from exporter.core.podresources import api_pb2_grpc

            self._grpc = grpc
            self._channel = grpc.insecure_channel(
                f"unix://{os.path.abspath(self.socket)}",
                options=[
                    ("grpc.max_receive_message_length", _MAX_MESSAGE_BYTES),
                    # a restarted kubelet is found again within seconds, not gRPC's default 2 min
                    ("grpc.initial_reconnect_backoff_ms", 500),
                    ("grpc.max_reconnect_backoff_ms", 5000),
                    ("grpc.enable_http_proxy", 0),
                ],
            )
            self._stub = api_pb2_grpc.PodResourcesListerStub(self._channel)
        return self._stub

    @staticmethod
    def _request() -> Any:
        from exporter.core.podresources import api_pb2

        return api_pb2.ListPodResourcesRequest()  # type: ignore[attr-defined]

    def _devices(self, response: Any) -> Iterator[PodDevice]:
        for pod in response.pod_resources:
            for container in pod.containers:
                for devices in container.devices:
                    if not _wanted(devices.resource_name, self.resources):
                        continue
                    for device in dict.fromkeys(d.partition("::")[0] for d in devices.device_ids):
                        yield PodDevice(
                            pod.namespace, pod.name, container.name, devices.resource_name, device
                        )


_OFF = PodDevices(problem="off")  # no socket: not a Kubernetes node (never reported)


def _describe(exc: Any) -> str:
    """An RpcError in a line: its status and details."""
    try:
        return f"{exc.code().name}: {exc.details()}"
    except Exception:  # an RpcError that is not a Call
        return str(exc) or type(exc).__name__

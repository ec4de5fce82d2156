"""The kubelet's pod-resources v1 API: its published proto and the modules generated from it
(``api_pb2``, ``api_pb2_grpc``; see ``regenerate.sh``). Only :mod:`exporter.core.kubelet`
imports them, and only when the kubelet's socket exists: they need grpcio and protobuf, the
``kubernetes`` extra."""

"""A client that shares no code with the federation: it runs as its own process, imports only
``grpc``, ``protobuf`` and the modules ``grpc_tools.protoc`` made from the .proto files in the
folder given first, and never ``federation``.

    python independent_client.py GENERATED_DIR < calls.json > results.json

Each call names a service and method of ``federation.api.v1``, a request (protobuf JSON), the
TLS files to present (``cert`` and ``key`` may be left out: no client certificate) and, for
Connect, the stream messages to send and how long to read. Each result gives the status code
name, its message, and for a stream the kinds of messages the coordinator sent.
"""

from __future__ import annotations

import importlib
import json
import pkgutil
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
from google.protobuf import json_format, message_factory

PACKAGE = "federation.api.v1"


def load_generated(folder: str) -> dict[str, Any]:
    """Every generated ``*_pb2_grpc`` module in ``folder``, by the stubs it defines."""
    sys.path.insert(0, folder)
    stubs: dict[str, Any] = {}
    for info in pkgutil.iter_modules([folder]):
        if info.name.endswith("_pb2_grpc"):
            module = importlib.import_module(info.name)
            for name in dir(module):
                if name.endswith("Stub"):
                    stubs[name.removesuffix("Stub")] = getattr(module, name)
    return stubs


def credentials(tls: dict[str, str]) -> grpc.ChannelCredentials:
    ca = Path(tls["ca"]).read_bytes()
    if "cert" not in tls:
        return grpc.ssl_channel_credentials(root_certificates=ca)
    return grpc.ssl_channel_credentials(
        root_certificates=ca,
        private_key=Path(tls["key"]).read_bytes(),
        certificate_chain=Path(tls["cert"]).read_bytes(),
    )


def request_class(stub: Any, method: str) -> Any:
    """The request message class of ``method``, from the descriptor of the stub's module."""
    module = sys.modules[stub.__module__.removesuffix("_grpc")]
    service = module.DESCRIPTOR.services_by_name[stub.__name__.removesuffix("Stub")]
    return message_factory.GetMessageClass(service.methods_by_name[method].input_type)


def run_call(stubs: dict[str, Any], call: dict[str, Any]) -> dict[str, Any]:
    stub_class = stubs[call["service"]]
    result: dict[str, Any] = {"row": call["row"]}
    with grpc.secure_channel(call["target"], credentials(call["tls"])) as channel:
        rpc = getattr(stub_class(channel), call["method"])
        request_type = request_class(stub_class, call["method"])
        try:
            if "stream" in call:
                result["received"] = run_stream(rpc, request_type, call)
                result["code"] = "OK"
            else:
                request = json_format.ParseDict(call.get("request", {}), request_type())
                reply = rpc(request, timeout=call.get("timeout_s", 10))
                result["code"] = "OK"
                result["reply"] = json_format.MessageToDict(reply)
        except grpc.RpcError as err:
            result["code"] = err.code().name  # type: ignore[attr-defined]
            result["message"] = err.details()  # type: ignore[attr-defined]
            result["debug"] = err.debug_error_string()  # type: ignore[attr-defined]
    return result


def run_stream(rpc: Any, request_type: Any, call: dict[str, Any]) -> list[str]:
    """Send the stream's messages, read for ``read_s`` (or until the coordinator ends the
    stream), then hang up; return the kinds of message the coordinator sent."""
    done = threading.Event()
    hung_up = threading.Event()

    def hang_up_now() -> None:
        hung_up.set()
        responses.cancel()

    def requests() -> Iterator[Any]:
        for body in call["stream"]:
            yield json_format.ParseDict(body, request_type())
        done.wait()

    responses = rpc(requests())
    hang_up = threading.Timer(call.get("read_s", 3.0), hang_up_now)
    hang_up.start()
    received: list[str] = []
    try:
        for response in responses:
            received += [m.WhichOneof("body") or "empty" for m in response.messages]
    except grpc.RpcError:
        if not hung_up.is_set():
            raise
        received.append(f"(still open after {call.get('read_s', 3.0):g} s; hung up)")
    finally:
        hang_up.cancel()
        done.set()
    return received


def main() -> int:
    stubs = load_generated(sys.argv[1])
    calls = json.load(sys.stdin)
    results = []
    for call in calls:
        started = time.monotonic()
        result = run_call(stubs, call)
        result["elapsed_s"] = round(time.monotonic() - started, 3)
        results.append(result)
    assert not any(name.split(".")[0] == "federation" for name in sys.modules), "not independent"
    json.dump(results, sys.stdout, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

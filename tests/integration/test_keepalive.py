"""Clients that send gRPC keepalive pings are served however long their request waits."""

from __future__ import annotations

import threading
import time

import grpc
import pytest

from sluiceway.client import Client
from sluiceway.grpc_server import MIN_CLIENT_PING_INTERVAL_MS, channel_options
from sluiceway.v1 import inference_pb2_grpc
from tests.integration.conftest import start_stack, stop_stack

pytestmark = pytest.mark.slow

QUEUE_WAIT_S = 30.0  # C-core's default policy drops this client within it (GOAWAY too_many_pings)


def test_a_pinging_client_is_served_through_a_long_queue_wait() -> None:
    # One running sequence at a time: a long request ahead makes the pinging client's
    # request wait in the queue, where the server sends it no header or data frame.
    stack = start_stack("--max-num-seqs", "1")
    try:
        long_client = stack.client()
        ahead = long_client.stub.Generate(
            Client.request("Count to ten thousand:", temperature=0, max_tokens=4000,
                           ignore_eos=True),
            timeout=300,
        )  # fmt: skip
        next(ahead)  # the long request runs
        # Pings at the fastest rate the server's policy accepts, with or without calls,
        # without the client's own limit of 2 pings between data frames.
        options = [
            *channel_options(),
            ("grpc.keepalive_time_ms", MIN_CLIENT_PING_INTERVAL_MS),
            ("grpc.keepalive_timeout_ms", 5000),
            ("grpc.keepalive_permit_without_calls", 1),
            ("grpc.http2.max_pings_without_data", 0),
        ]
        with grpc.insecure_channel(stack.target, options=options) as channel:
            stub = inference_pb2_grpc.InferenceStub(channel)
            # an idle connection first: pings without a call in flight
            grpc.channel_ready_future(channel).result(timeout=10)
            time.sleep(3 * MIN_CLIENT_PING_INTERVAL_MS / 1000)
            outcome: dict[str, object] = {}
            first_token_at: list[float] = []

            def pinging() -> None:
                try:
                    n = 0
                    request = Client.request("Hi", temperature=0, max_tokens=4, ignore_eos=True)
                    for r in stub.Generate(request, timeout=300):
                        if not first_token_at:
                            first_token_at.append(time.monotonic())
                        n += len(r.token_ids)
                    outcome["tokens"] = n
                except grpc.RpcError as e:
                    outcome["error"] = (e.code(), e.details())

            sent_at = time.monotonic()
            thread = threading.Thread(target=pinging)
            thread.start()
            thread.join(timeout=QUEUE_WAIT_S)
            assert "error" not in outcome, outcome
            assert first_token_at == []  # still waiting behind the long request
            ahead.cancel()  # the queue moves on
            thread.join(timeout=60)
            assert outcome == {"tokens": 4}
            assert first_token_at[0] - sent_at >= QUEUE_WAIT_S
        long_client.close()
    finally:
        assert stop_stack(stack) == 0, "".join(stack.log[-30:])

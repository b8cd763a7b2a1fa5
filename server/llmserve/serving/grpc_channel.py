"""gRPC channel options for our clients of Triton: tritonclient's own defaults, and a reconnect
backoff kept short.

gRPC waits 1 s after a failed connect, then 1.6 times longer each time, up to 120 s. A client made
before Triton listens (the supervisor's readiness poll at start-up, the HTTP front end's workers) or
one whose Triton was restarted would find it up seconds late; with these options, within 0.5 s.
"""

from __future__ import annotations

from tritonclient.grpc import MAX_GRPC_MESSAGE_SIZE, KeepAliveOptions

RECONNECT_BACKOFF_MS = (100, 500)  # first wait, longest wait


def channel_args() -> list[tuple[str, int]]:
    """Options for `InferenceServerClient(url, channel_args=...)` (sync or aio): those replace all of
    tritonclient's defaults, so these repeat them."""
    ka = KeepAliveOptions()
    first, longest = RECONNECT_BACKOFF_MS
    return [
        ("grpc.max_send_message_length", MAX_GRPC_MESSAGE_SIZE),
        ("grpc.max_receive_message_length", MAX_GRPC_MESSAGE_SIZE),
        ("grpc.keepalive_time_ms", ka.keepalive_time_ms),
        ("grpc.keepalive_timeout_ms", ka.keepalive_timeout_ms),
        ("grpc.keepalive_permit_without_calls", ka.keepalive_permit_without_calls),
        ("grpc.http2.max_pings_without_data", ka.http2_max_pings_without_data),
        ("grpc.initial_reconnect_backoff_ms", first),
        ("grpc.min_reconnect_backoff_ms", first),
        ("grpc.max_reconnect_backoff_ms", longest),
    ]

"""The wire between the engine process and its clients (Triton adapter, supervisor).

The engine process binds a ZMQ ROUTER on 127.0.0.1:INTER_PROC_PORT; each
client connects a DEALER. Messages are msgpack maps with an `op` (binary, compact; no JSON on the hot path):

client -> engine
  {"op": "hello", "role": "adapter" | "monitor"}    sent on every (re)connect
  {"op": "add", "req_id": str, "request": {...}}
                                   the native request's record (native.record: every field,
                                   checked where it entered, not validated again here); the
                                   engine checks it against the model's limits
  {"op": "abort", "req_id": str}
engine -> client
  {"op": "out", "items": [...]}    one message per step and client: every request's
                                   new tokens (native response shape, without
                                   `send_idx`: the adapter numbers what it sends)
  {"op": "hb", "stalled": float}   heartbeat (adapters), every HEARTBEAT_S, from the
                                   engine server's loop, which never waits on a step
                                   (the core process runs them): it says the process
                                   lives however long a step takes; `stalled` is how
                                   long the core has had work without finishing a step
                                   (a hang is `stalled` past CHECK_HEALTH_INTERVAL)
  {"op": "stats", ...}             heartbeat with stats and metric deltas (monitors)

An abort for a req_id the engine does not hold (finished, or from before a restart) is ignored.
A client that disconnects (its process died) needs no message: the engine's ROUTER
(ROUTER_MANDATORY) fails its next send to it, at the latest the next heartbeat, and the
engine aborts every request the client had in flight. Routing ids are per socket (the
adapter's holds its pid and a random suffix), so a restarted client is a new one.

The engine binds only once its model is loaded (and warmed up), so "connected"
means "engine up". A dead engine process closes its TCP connections at once:
the DEALER's monitor reports the disconnect, and clients fail what is in flight.
"""

from __future__ import annotations

from typing import Any

import zmq
from zmq.utils.monitor import recv_monitor_message

from llmserve.utils.wire import dumps, loads  # noqa: F401 - the wire's codec, for its users

HEARTBEAT_S = 0.5


MAX_RECV = 10_000  # messages taken per recv_all: the caller's loop gets its turn under a flood


def endpoint(port: int) -> str:
    return f"tcp://127.0.0.1:{port}"


class EngineLink:
    """A client's DEALER to the engine process, with connect/disconnect events.

    Not thread-safe (ZMQ sockets never are): one thread owns it and polls
    `sock` and `monitor` (see `poller`).
    """

    def __init__(self, port: int, role: str, identity: str, ctx: zmq.Context | None = None) -> None:
        self.role = role
        self.ctx = ctx or zmq.Context.instance()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.ROUTING_ID, identity.encode())
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.IMMEDIATE, 1)  # queue nothing while no engine is connected
        # Retry every 100 ms (on loopback, cheap): a growing wait would find the engine up to 0.5 s
        # after it starts (or restarts) listening, and readiness waits for the adapters' hellos.
        self.sock.setsockopt(zmq.RECONNECT_IVL, 100)
        self.sock.setsockopt(zmq.RECONNECT_IVL_MAX, 100)
        self.sock.setsockopt(zmq.SNDHWM, 100_000)
        self.sock.setsockopt(zmq.RCVHWM, 100_000)
        # HANDSHAKE_SUCCEEDED, not CONNECTED: only then does a send with IMMEDIATE go through.
        self.monitor = self.sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED)
        self.sock.connect(endpoint(port))
        self.connected = False

    def register(self, poller: zmq.Poller) -> None:
        poller.register(self.sock, zmq.POLLIN)
        poller.register(self.monitor, zmq.POLLIN)

    def events(self) -> list[str]:
        """Drain monitor events: 'connected' / 'disconnected' (a hello is sent on connect)."""
        out = []
        while self.monitor.poll(0):
            ev = recv_monitor_message(self.monitor)["event"]
            if ev == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self.connected = True
                self.send({"op": "hello", "role": self.role})
                out.append("connected")
            elif ev == zmq.EVENT_DISCONNECTED:
                self.connected = False
                out.append("disconnected")
        return out

    def send(self, msg: dict[str, Any]) -> bool:
        """False when no engine is connected (the message is dropped)."""
        try:
            self.sock.send(dumps(msg), zmq.NOBLOCK)
            return True
        except zmq.Again:
            return False

    def recv_all(self) -> list[dict[str, Any]]:
        msgs = []
        while len(msgs) < MAX_RECV:
            try:
                msgs.append(loads(self.sock.recv(zmq.NOBLOCK)))
            except zmq.Again:
                break
        return msgs

    def close(self) -> None:
        self.sock.disable_monitor()
        self.monitor.close(0)
        self.sock.close(0)

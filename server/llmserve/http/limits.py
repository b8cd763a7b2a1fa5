"""A cap on the size of a request's head (request line + headers).

uvicorn's httptools parser accepts headers of any size (a 16 MiB header is
buffered and served), and h11 only limits an event while it is incomplete.
This protocol counts the bytes of each request's head as they arrive and
answers 431 (and closes the connection) once they pass MAX_HEADER_BYTES, so
that memory per connection stays bounded. The body is capped separately by
the app's FrontDoor (413).
"""

from __future__ import annotations

import json

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

MAX_HEADER_BYTES = 64 << 10


class LimitedHttpToolsProtocol(HttpToolsProtocol):
    max_header_bytes = MAX_HEADER_BYTES

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._in_head = True  # a connection starts with a request head
        self._head_bytes = 0  # bytes received since the head began (while it is incomplete)
        self._too_big = False

    def data_received(self, data: bytes) -> None:
        if self._in_head:
            self._head_bytes += len(data)
        super().data_received(data)
        # Still in the head after parsing all that came: the head alone is this big.
        if self._in_head and self._head_bytes > self.max_header_bytes and not self.transport.is_closing():
            self._too_large()

    def on_headers_complete(self) -> None:
        self._in_head = False
        self._head_bytes = 0
        size = len(self.url) + sum(len(n) + len(v) + 4 for n, v in self.headers)
        if size > self.max_header_bytes:  # a whole head that came in one piece
            self._too_big = True
            raise ValueError("request head too large")  # stops the parser; answered in send_400_response
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        super().on_message_complete()
        self._in_head = True
        self._head_bytes = 0

    def send_400_response(self, msg: str) -> None:
        if self._too_big:
            self._too_large()
        else:
            super().send_400_response(msg)

    def _too_large(self) -> None:
        msg = f"the request head (request line and headers) exceeds {self.max_header_bytes} bytes"
        self.logger.warning(msg)
        body = json.dumps(
            {
                "error_msg": msg,
                "error_code": 431,
                "error": {"message": msg, "type": "invalid_request_error", "param": None, "code": "headers_too_large"},
            }
        ).encode()
        head = (
            b"HTTP/1.1 431 Request Header Fields Too Large\r\n"
            b"content-type: application/json\r\n"
            b"content-length: " + str(len(body)).encode() + b"\r\nconnection: close\r\n\r\n"
        )
        self.transport.write(head + body)
        self.transport.close()

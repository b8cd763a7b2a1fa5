"""The responses one HTTP worker keeps for `previous_response_id` and `GET /v1/responses/{id}`.

In memory, per front-end worker process: a response is kept for TTL_S (1 hour) after it was made, and
the store holds at most MAX_RESPONSES of them and MAX_CHARS characters of their conversations (the
oldest go first). Nothing is shared between workers or kept across a restart: with several HTTP
workers (PUSH_MODE_HTTP_WORKERS > 1) a follow-up request may land on a worker that does not have the
response, and is refused with a 400 naming `previous_response_id` (send the conversation as `input`
instead, or run one HTTP worker).
"""

from __future__ import annotations

import json
import time
from collections import OrderedDict
from dataclasses import dataclass

TTL_S = 3600.0
MAX_RESPONSES = 1024
MAX_CHARS = 64 << 20  # of the kept conversations' JSON, so a few long chats cannot grow a worker without bound


@dataclass
class Kept:
    messages: list[dict]  # the whole conversation in chat messages, this response's output included
    response: dict  # the Response object as it was sent
    expires: float
    size: int


class ResponseStore:
    def __init__(self, ttl_s: float = TTL_S, max_responses: int = MAX_RESPONSES, max_chars: int = MAX_CHARS) -> None:
        self.ttl_s, self.max_responses, self.max_chars = ttl_s, max_responses, max_chars
        self._kept: OrderedDict[str, Kept] = OrderedDict()  # oldest first
        self._chars = 0

    def put(self, response_id: str, messages: list[dict], response: dict) -> None:
        size = len(json.dumps(messages, ensure_ascii=False)) + len(json.dumps(response, ensure_ascii=False))
        if size > self.max_chars:
            return  # larger than the whole store: not kept (a follow-up is refused by name)
        self._drop(response_id)
        self._kept[response_id] = Kept(messages, response, time.monotonic() + self.ttl_s, size)
        self._chars += size
        while len(self._kept) > self.max_responses or self._chars > self.max_chars:
            self._drop(next(iter(self._kept)))

    def get(self, response_id: str) -> Kept | None:
        self._expire()
        return self._kept.get(response_id)

    def delete(self, response_id: str) -> bool:
        self._expire()
        return self._drop(response_id)

    def _drop(self, response_id: str) -> bool:
        kept = self._kept.pop(response_id, None)
        if kept is not None:
            self._chars -= kept.size
        return kept is not None

    def _expire(self) -> None:
        now = time.monotonic()
        while self._kept:
            oldest_id, oldest = next(iter(self._kept.items()))
            if oldest.expires > now:
                break
            self._drop(oldest_id)

    def __len__(self) -> int:
        self._expire()
        return len(self._kept)

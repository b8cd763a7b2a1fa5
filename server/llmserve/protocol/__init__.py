"""Wire formats: the native (PaddleNLP-style) protocol and the OpenAI API."""

# A Triton request parameter: the request aborts the request in flight whose req_id its IN names (the
# HTTP front end's requests share one gRPC stream, which cannot cancel one of them; triton/model.py).
ABORT_PARAM = "llmserve_abort"
# A Triton request parameter: IN holds a request the HTTP front end validated, as a msgpack record
# (native.record); its value is EDGE_TOKEN's, without which the adapter validates the record itself.
RECORD_PARAM = "llmserve_record"
CANCELLED = 499  # the error code that ends a request its client aborted


def error_response(req_id: str | None, code: int, msg: str, param: str | None = None) -> dict:
    """The native error item (`error_param`: the request field at fault, when one is); here (no
    imports) so the Triton stub can use it without pydantic."""
    item = {"req_id": req_id, "is_end": 1, "error_code": code, "error_msg": msg}
    if param:
        item["error_param"] = param
    return item


def cancelled_response(req_id: str) -> dict:
    """The error item that ends a request its client aborted (CANCELLED)."""
    return error_response(req_id, CANCELLED, "aborted: its client went away")

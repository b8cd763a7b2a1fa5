"""Wire formats: the native (PaddleNLP-style) protocol and the OpenAI API."""


def error_response(req_id: str | None, code: int, msg: str) -> dict:
    """The native error item; here (no imports) so the Triton stub can use it without pydantic."""
    return {"req_id": req_id, "is_end": 1, "error_code": code, "error_msg": msg}

"""Wire formats: the native (PaddleNLP-style) protocol and the OpenAI API."""


def error_response(req_id: str | None, code: int, msg: str, param: str | None = None) -> dict:
    """The native error item (`error_param`: the request field at fault, when one is); here (no
    imports) so the Triton stub can use it without pydantic."""
    item = {"req_id": req_id, "is_end": 1, "error_code": code, "error_msg": msg}
    if param:
        item["error_param"] = param
    return item

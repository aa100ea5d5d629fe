"""OpenAI's error body, {"error": {"message", "type", "param", "code"}}, and ``ApiError``, the exception
that carries one with its HTTP status. Framework-free: the protocol, chat templates and the server's
middlewares all raise or write it."""
from __future__ import annotations

import json


class ApiError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param=None, code=None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code


def error_body(message: str, type_: str = "invalid_request_error", param=None, code=None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def error_bytes(message: str, type_: str, code: str) -> bytes:
    """error_body as the JSON bytes an ASGI middleware sends."""
    return json.dumps(error_body(message, type_, None, code)).encode()


__all__ = ["ApiError", "error_body", "error_bytes"]

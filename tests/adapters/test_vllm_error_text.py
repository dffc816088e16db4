"""What an error from vLLM's server says reaches the user whole: the message of vLLM's own JSON error body
(built here with vLLM's ``ErrorResponse``), FastAPI's ``detail``, or a long plain body cut with a mark.
Before, every body was cut at 300 characters, which lost the end of vLLM's validation messages (the part
naming the bad value)."""

from __future__ import annotations

import pytest

httpx = pytest.importorskip("httpx")
protocol = pytest.importorskip("vllm.entrypoints.serve.engine.protocol")

from hybridmem.adapters.vllm.server.client import ERROR_TEXT_CHARS, error_text  # noqa: E402


def test_vllms_error_message_is_quoted_whole():
    message = "1 validation error for UpdateWeightsRequest: " + "x" * 400 + " -- field 'names' must be a list"
    body = protocol.ErrorResponse(error=protocol.ErrorInfo(message=message, type="BadRequestError", code=400))
    response = httpx.Response(400, content=body.model_dump_json(),
                              headers={"content-type": "application/json"})
    assert error_text(response) == f"HTTP 400: {message}"


def test_fastapis_detail_and_a_plain_body():
    detail = httpx.Response(404, json={"detail": "Not Found"})
    assert error_text(detail) == "HTTP 404: Not Found"
    long = "boom " * 1000
    text = error_text(httpx.Response(500, text=long))
    assert text == f"HTTP 500: {long[:ERROR_TEXT_CHARS]}..."
    assert error_text(httpx.Response(502, text="bad gateway")) == "HTTP 502: bad gateway"

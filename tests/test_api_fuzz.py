"""Fuzz the HTTP API against its own OpenAPI schema (schemathesis), briefly in CI.

Checks: no 5xx, every response matches the documented status codes, content types and schemas
(errors are the OpenAI error object), and the server stays healthy with nothing leaked. The
operations are driven through schemathesis' hypothesis strategies directly (its pytest plugin does
not support this pytest version).
"""

from __future__ import annotations

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis.checks import (content_type_conformance, not_a_server_error, response_headers_conformance,
                                 response_schema_conformance, status_code_conformance)

from ds4serve.server.inprocess import serve


@pytest.fixture(scope="module")
def fuzz_server(random_ckpt):
    with serve(random_ckpt, settings={"max_seqs": 4, "max_model_len": 64, "max_queue": 64},
               limits={"request_timeout_s": 20, "max_body_bytes": 200_000}) as srv:
        yield srv


def _operations(base: str):
    schema = schemathesis.openapi.from_url(base + "/openapi.json")
    return [r.ok() for r in schema.get_all_operations()]


def test_api_conforms_to_its_schema(fuzz_server):
    ops = _operations(fuzz_server.base)
    assert {op.path for op in ops} >= {"/v1/chat/completions", "/v1/completions", "/v1/models", "/health"}
    failures = []
    for op in ops:
        @given(case=op.as_strategy())
        @settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True,
                  database=None)
        def check(case):
            response = case.call(base_url=fuzz_server.base, timeout=60)
            assert response.status_code < 500, f"{response.status_code} {response.text[:300]}"
            # semantic refusals of schema-valid input (unknown model, context too long) are correct
            # behaviour, so schemathesis' "positive data acceptance" check is not applied
            case.validate_response(response, checks=[not_a_server_error, status_code_conformance,
                                                     content_type_conformance, response_schema_conformance,
                                                     response_headers_conformance])

        try:
            check()
        except Exception as exc:  # collect every operation's failure, then report them together
            failures.append(f"{op.method.upper()} {op.path}: {exc}")
    assert not failures, "\n\n".join(failures)


def test_server_healthy_after_fuzzing(fuzz_server):
    assert httpx.get(fuzz_server.base + "/health").status_code == 200
    assert fuzz_server.loop.call(lambda core: core.leaks()) == ""

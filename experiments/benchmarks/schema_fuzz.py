"""Schema fuzzing of a live server: schemathesis cases for every operation of its OpenAPI schema.

Why: the hand-written bad-input tests (tests/entrypoints/test_server_errors.py) cover the
inputs someone thought of. Here the server's own schema (GET /openapi.json) says what each
operation takes, and schemathesis generates bodies, headers and query strings from it:
positive cases (valid by the schema, which should mostly be served) and negative ones
(each violating it somewhere, which must be refused). The contract checked on every
response is the server's, not schemathesis's defaults:

    server_error       status >= 500 (the catch-all handler's 500 means a bug)
    timeout            no whole response (a stream read to its end) within the timeout
    connection         the request could not be sent or its response read (a crashed server)
    driver_error       the driver itself failed on a case (so that it is never silent)
    unexpected_status  1xx or 3xx
    error_shape        a 4xx whose body is not OpenAI's {"error": {message, type, param, code}}
    not_json           a body that is not JSON where the schema promises JSON
    content_type       a media type the schema does not document for that status
    response_schema    a JSON body that does not match the documented response schema
    stream             an SSE stream with a non-JSON event, an error event or no final [DONE]

A negative case answered 2xx is no failure (this server reads JSON whatever the
Content-Type, and ignores unknown fields), but it is counted (`negative_accepted`, with
its smallest example): a schema that says "invalid" about what the server serves.

The driver calls schemathesis's Python API only to generate (`from_dict`,
`get_all_operations`, `APIOperation.as_strategy` under hypothesis' `@given`) and to
serialize a case (`Case.as_transport_kwargs`); requests go out through httpx, so that a
stream is read whole under one deadline. A generated case's cost can be bounded before it
is sent (`prepare`, e.g. `bound_generation_cost`): a fuzzer is after inputs, not long
generations. Findings are grouped by (kind, status, message); each group keeps its
smallest reproducer (method, path, query, body, status, response text).
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Callable
from typing import Any

import httpx

from experiments.benchmarks.schema_fuzz_checks import judge, promised_content

Prepare = Callable[[str, str, Any], Any]  # (method, path, JSON body) -> the body to send
Progress = Callable[[str, int, int], None]  # (operation label, cases sent, max_examples)
MAX_GROUPS = 20  # finding groups kept per operation (the count still counts them all)
TEXT_LIMIT = 600  # characters of a response kept in a reproducer


@dataclasses.dataclass(frozen=True)
class FuzzConfig:
    max_examples: int = 50  # hypothesis examples per operation (positive and negative together)
    seconds: float = 300.0  # time for all operations; each gets the rest divided by those left
    request_timeout_s: float = 60.0  # longer without a whole response (stream included) is a hang
    negative: bool = True  # also cases that violate the schema (half the examples, where it has any)
    seed: int | None = 0  # hypothesis seed (None: random)
    operations: tuple[str, ...] | None = None  # labels such as "POST /tokenize" (None: all)


@dataclasses.dataclass
class Group:
    kind: str
    status: int | None
    detail: str
    count: int
    reproducer: dict


@dataclasses.dataclass
class OperationReport:
    label: str
    cases: int = 0
    by_mode: dict = dataclasses.field(default_factory=lambda: {"positive": 0, "negative": 0})
    status_classes: dict = dataclasses.field(default_factory=dict)  # "2xx" / "4xx" / ... / "no response"
    status_codes: dict = dataclasses.field(default_factory=dict)
    failures: list[Group] = dataclasses.field(default_factory=list)
    negative_accepted: list[Group] = dataclasses.field(default_factory=list)
    seconds: float = 0.0
    slowest_case_s: float = 0.0
    stopped_by: str = "max_examples"  # or "time", "no negative cases", "<mode> generation: <error>"

    @property
    def num_failures(self) -> int:
        return sum(g.count for g in self.failures)

    def to_dict(self) -> dict:
        return {"cases": self.cases, "by_mode": self.by_mode, "status_classes": self.status_classes,
                "status_codes": dict(sorted(self.status_codes.items())), "num_failures": self.num_failures,
                "failures": [dataclasses.asdict(g) for g in self.failures],
                "num_negative_accepted": sum(g.count for g in self.negative_accepted),
                "negative_accepted": [dataclasses.asdict(g) for g in self.negative_accepted],
                "seconds": round(self.seconds, 1), "slowest_case_s": round(self.slowest_case_s, 2),
                "stopped_by": self.stopped_by}


@dataclasses.dataclass
class FuzzReport:
    base_url: str
    operations: dict[str, OperationReport]
    seconds: float

    @property
    def num_failures(self) -> int:
        return sum(r.num_failures for r in self.operations.values())

    def to_dict(self) -> dict:
        return {"operations": {k: r.to_dict() for k, r in self.operations.items()},
                "num_operations": len(self.operations), "cases": sum(r.cases for r in self.operations.values()),
                "num_failures": self.num_failures, "seconds": round(self.seconds, 1)}


class _OutOfTime(Exception):
    """Raised inside the hypothesis test once the operation's time is spent; caught outside."""


def load_schema(base_url: str, api_key: str | None = None, timeout: float = 60.0):
    """(the raw OpenAPI dict, schemathesis' schema of it): from the live server itself."""
    import schemathesis
    from schemathesis.config import SchemathesisConfig
    r = httpx.get(base_url + "/openapi.json", headers=_auth(api_key), timeout=timeout)
    r.raise_for_status()
    spec = r.json()
    # an explicit config: no schemathesis.toml discovered from the working directory changes the run
    return spec, schemathesis.openapi.from_dict(spec, config=SchemathesisConfig())


def _auth(api_key: str | None) -> dict:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def bound_generation_cost(method: str, path: str, body: Any, *, max_tokens: int = 4, n: int = 2) -> Any:
    """A `prepare` for the completion routes: values the schema allows but that only make a
    case slow (max_tokens 500, n 128, none or a null one: OpenAI's 16, or up to
    max_model_len) are lowered to `max_tokens` / `n`. Values outside the schema stay as
    generated, so a negative case stays negative."""
    if method != "POST" or path not in ("/v1/completions", "/v1/chat/completions") or not isinstance(body, dict):
        return body
    body = dict(body)
    keys = ("max_tokens",) if path == "/v1/completions" else ("max_tokens", "max_completion_tokens")
    for key in keys:
        if _whole(body.get(key)) and body[key] > max_tokens:
            body[key] = max_tokens
    if all(body.get(k) is None for k in keys):  # absent: 16 (completions) or up to max_model_len (chat)
        body[keys[-1]] = max_tokens
    if _whole(body.get("n")) and n < body["n"] <= 128:
        body["n"] = n
    return body


def _whole(value) -> bool:
    """A JSON integer, also when written 2.0 (the server reads it as 2: json_body.py)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and float(value).is_integer()


def send(kwargs: dict, timeout: float) -> tuple[int | None, str, bytes, str | None]:
    """(status, media type, whole body, error) of one request; a stream is read to its end
    within `timeout` seconds in all, else error is "timeout"."""
    deadline = time.monotonic() + timeout
    request = {k: kwargs[k] for k in ("method", "url", "headers", "params", "cookies") if kwargs.get(k)}
    if "json" in kwargs:
        request["content"] = json.dumps(kwargs["json"], default=str).encode()  # NaN and all, as generated
    elif kwargs.get("data") is not None:
        data = kwargs["data"]
        request["content"] = data if isinstance(data, bytes) else str(data).encode()
    try:
        with httpx.Client(timeout=httpx.Timeout(timeout)) as client, client.stream(**request) as response:
            parts = []
            for chunk in response.iter_raw():
                parts.append(chunk)
                if time.monotonic() > deadline:
                    return response.status_code, _media(response), b"".join(parts), "timeout"
            return response.status_code, _media(response), b"".join(parts), None
    except httpx.TimeoutException:
        return None, "", b"", "timeout"
    except httpx.HTTPError as exc:
        return None, "", b"", f"connection: {type(exc).__name__}: {exc}"


def _media(response: httpx.Response) -> str:
    return response.headers.get("content-type", "").split(";")[0].strip().lower()


def _reproducer(kwargs: dict, mode: str, status, text: str) -> dict:
    body = kwargs.get("json", kwargs.get("data"))
    if isinstance(body, bytes):
        body = body.decode("utf-8", "backslashreplace")
    url = httpx.URL(kwargs["url"])
    headers = {k: v for k, v in (kwargs.get("headers") or {}).items()
               if k.lower() not in ("authorization", "user-agent", "accept-encoding", "accept", "connection",
                                    "x-schemathesis-testcaseid")}
    return {"method": kwargs["method"], "path": url.path, "query": kwargs.get("params") or {}, "headers": headers,
            "body": body, "mode": mode, "status": status, "response": text[:TEXT_LIMIT]}


def _size(reproducer: dict) -> int:
    return len(json.dumps(reproducer["body"], default=str)) + len(json.dumps(reproducer["query"], default=str))


def _add(groups: list[Group], kind: str, status, detail: str, reproducer: dict) -> None:
    for g in groups:
        if (g.kind, g.status, g.detail) == (kind, status, detail):
            g.count += 1
            if _size(reproducer) < _size(g.reproducer):
                g.reproducer = reproducer
            return
    if len(groups) < MAX_GROUPS:
        groups.append(Group(kind, status, detail, 1, reproducer))
    else:
        groups[-1].count += 1  # counted with the last group kept, so the total stays right


def _status_class(status: int | None) -> str:
    return "no response" if status is None else f"{status // 100}xx"


def _negative_in(case) -> list[str]:
    """Where a negative case violates the schema (body, header, query, ...), as schemathesis says."""
    components = case.meta.components if case.meta is not None else {}
    return sorted(str(getattr(loc, "value", loc)) for loc, info in components.items() if info.mode.is_negative)


def fuzz_operation(operation, spec: dict, base_url: str, api_key: str | None, config: FuzzConfig, seconds: float,
                   prepare: Prepare | None = None, progress: Progress | None = None) -> OperationReport:
    """Up to config.max_examples cases of one schemathesis APIOperation (half of them
    negative, where the schema has anything to violate), for `seconds` at most. The API key
    is a fixed header: cases vary what is sent, not who sends it (the 401s have their own
    tests)."""
    from hypothesis import HealthCheck, Phase, Verbosity, given, seed, settings
    from hypothesis.errors import Unsatisfiable
    from schemathesis import GenerationMode

    report = OperationReport(operation.label)
    documented = spec["paths"][operation.path][operation.method.lower()]
    start = time.monotonic()
    deadline = start + seconds
    headers = _auth(api_key)

    def run_case(case) -> None:
        if time.monotonic() > deadline:
            raise _OutOfTime()
        try:
            check_case(case)
        except Exception as exc:  # the driver's own bug: counted as a failure, never silent
            _add(report.failures, "driver_error", None, f"{type(exc).__name__}: {exc}"[:300],
                 {"method": case.method, "path": case.path, "body": repr(case.body)[:TEXT_LIMIT]})

    def check_case(case) -> None:
        mode = case.meta.generation.mode.value if case.meta is not None else "positive"
        kwargs = case.as_transport_kwargs(base_url=base_url, headers=headers)
        if prepare is not None and "json" in kwargs:
            kwargs["json"] = prepare(case.method.upper(), case.path, kwargs["json"])
        sent = time.monotonic()
        status, media, raw, error = send(kwargs, config.request_timeout_s)
        report.slowest_case_s = max(report.slowest_case_s, time.monotonic() - sent)
        text = raw.decode("utf-8", "replace")
        report.cases += 1
        report.by_mode[mode] = report.by_mode.get(mode, 0) + 1
        cls = "no response" if error is not None else _status_class(status)
        report.status_classes[cls] = report.status_classes.get(cls, 0) + 1
        if status is not None:
            report.status_codes[str(status)] = report.status_codes.get(str(status), 0) + 1
        reproducer = _reproducer(kwargs, mode, status, text)
        if mode == "negative":
            reproducer["negative_in"] = _negative_in(case)
        if error is not None:
            kind, _, detail = error.partition(": ")
            _add(report.failures, kind, status, detail or f"no whole response in {config.request_timeout_s:g} s",
                 reproducer)
        else:
            for kind, detail in judge(status, media, raw, promised_content(documented, status), spec):
                _add(report.failures, kind, status, detail, reproducer)
            if mode == "negative" and 200 <= status < 300:
                _add(report.negative_accepted, "negative_accepted", status, ",".join(reproducer["negative_in"]),
                     reproducer)
        if progress is not None:
            progress(report.label, report.cases, config.max_examples)

    half = config.max_examples // 2 if config.negative else 0
    runs = [(GenerationMode.POSITIVE, config.max_examples - half), (GenerationMode.NEGATIVE, half)]
    notes = []
    for mode, examples in runs:
        if examples == 0:
            continue
        strategy = operation.as_strategy(generation_mode=mode, headers=headers or None)
        test = settings(max_examples=examples, deadline=None, database=None, phases=[Phase.generate],
                        suppress_health_check=list(HealthCheck), verbosity=Verbosity.quiet,
                        report_multiple_bugs=False)(given(case=strategy)(run_case))
        if config.seed is not None:
            test = seed(config.seed)(test)
        try:
            test()
        except _OutOfTime:
            notes.append("time")
            break
        except Unsatisfiable:  # nothing in the operation to violate (a GET without parameters)
            notes.append(f"no {mode.value} cases")
        except Exception as exc:  # schemathesis could not generate: say so, go on
            notes.append(f"{mode.value} generation: {type(exc).__name__}: {str(exc)[:300]}")
    report.stopped_by = "; ".join(notes) or "max_examples"
    report.seconds = time.monotonic() - start
    return report


def fuzz(base_url: str, api_key: str | None = None, config: FuzzConfig = FuzzConfig(), *,
         prepare: Prepare | None = None, progress: Progress | None = None,
         on_operation: Callable[[OperationReport], None] | None = None) -> FuzzReport:
    """Every operation of the server's schema (cheap GETs first), each bounded by
    config.max_examples and its share of config.seconds."""
    spec, schema = load_schema(base_url, api_key)
    operations = [r.ok() for r in schema.get_all_operations()]
    if config.operations is not None:
        operations = [op for op in operations if op.label in config.operations]
    operations.sort(key=lambda op: (op.method.upper() != "GET", op.label))
    start, reports = time.monotonic(), {}
    for i, operation in enumerate(operations):
        share = max(0.0, config.seconds - (time.monotonic() - start)) / (len(operations) - i)
        report = fuzz_operation(operation, spec, base_url, api_key, config, share, prepare, progress)
        reports[operation.label] = report
        if on_operation is not None:
            on_operation(report)
    return FuzzReport(base_url, reports, time.monotonic() - start)


def served_greedy(base_url: str, api_key: str | None, model: str, *, prompt: str | None = None,
                  messages: list | None = None, max_tokens: int = 16, timeout: float = 120) -> dict:
    """The server's greedy answer to one prompt (completions) or conversation (chat):
    {"status", "token_ids", "text", "finish_reason"}, to compare with the offline engine's
    after a fuzz run (the engine must still answer as before)."""
    body = {"model": model, "max_tokens": max_tokens, "temperature": 0, "return_token_ids": True}
    path = "/v1/completions" if messages is None else "/v1/chat/completions"
    body.update({"prompt": prompt} if messages is None else {"messages": messages})
    r = httpx.post(base_url + path, json=body, headers=_auth(api_key), timeout=timeout)
    if r.status_code != 200:
        return {"status": r.status_code, "token_ids": None, "text": None, "finish_reason": None,
                "response": r.text[:TEXT_LIMIT]}
    choice = r.json()["choices"][0]
    text = choice["text"] if messages is None else choice["message"]["content"]
    return {"status": 200, "token_ids": choice.get("token_ids"), "text": text,
            "finish_reason": choice["finish_reason"]}

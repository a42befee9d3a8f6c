"""vLLM's command line, the metrics the contract reads back from it, and the passthrough's observing
of what vLLM's app sends (no vLLM needed: tests/integration/test_vllm_backend.py runs the real one)."""

import asyncio
import json
import logging
import logging.config
import os
from pathlib import Path
from types import SimpleNamespace

import pytest

from service.admission import Admission
from service.after_requests import after_requests
from service.api.passthrough import Passthrough, _asking_for_usage, _object, _refused_before_the_engine, openai_error
from service.engine.base import EngineStats
from service.engine.vllm_server import (MIDDLEWARE, RUNTIME_FILE_ENV, Resolved, cpu_preload, gauges_from_vllm,
                                        vllm_arguments, write_logging_config)
from service.logs import request_id_var
from service.manifest import Profile, ProfileTags
from service.metrics import ServiceMetrics
from service.model_signature import Verification
from service.settings import Settings, SettingsError, load_settings


def arguments(env: dict[str, str] | None = None, **profile_kwargs) -> list[str]:
    tags = {"engine": "vllm", "precision": "bf16", "tp": 2, "gpu": "h100", **profile_kwargs.pop("tags", {})}
    profile = Profile(tags=ProfileTags(**tags), **profile_kwargs)
    return vllm_arguments(Path("/models/m"), "m", profile, load_settings({}, env or {}),
                          max_model_len=4096, max_num_seqs=16, max_queue=100)


def flag(args: list[str], name: str) -> str | None:
    """The last value given for --name (vLLM's argparse keeps the last)."""
    values = [args[i + 1] for i, arg in enumerate(args[:-1]) if arg == name]
    return values[-1] if values else None


def test_profile_tags_become_vllm_flags():
    args = arguments(engine_args={"enforce_eager": True, "max_queue": 9, "kv_cache_dtype": "fp8"})
    assert flag(args, "--model") == "/models/m" and flag(args, "--served-model-name") == "m"
    assert (flag(args, "--host"), flag(args, "--port")) == ("0.0.0.0", "8000")  # vLLM serves the clients
    assert flag(args, "--tensor-parallel-size") == "2" and flag(args, "--dtype") == "bfloat16"
    assert "--enforce-eager" in args and flag(args, "--kv-cache-dtype") == "fp8"
    assert "--max-queue" not in args  # the runtime's own bound, not vLLM's
    assert (flag(args, "--max-model-len"), flag(args, "--max-num-seqs")) == ("4096", "16")
    assert "--enable-prefix-caching" in args
    assert flag(args, "--max-num-queued-reqs") == "116", "NIM_MAX_QUEUE waiting beyond max_num_seqs running"
    assert flag(args, "--middleware") == MIDDLEWARE and "--disable-uvicorn-access-log" in args
    assert flag(args, "--shutdown-timeout") == "30"


def test_nim_settings_reach_vllms_server_arguments():
    args = arguments({"NIM_SERVER_PORT": "9000", "NIM_SERVER_HOST": "127.0.0.1", "NIM_SHUTDOWN_GRACE_SECONDS": "2.5"})
    assert (flag(args, "--host"), flag(args, "--port"), flag(args, "--shutdown-timeout")) == ("127.0.0.1", "9000", "3")


def test_the_tool_call_parser_turns_on_vllms_auto_tool_choice():
    assert "--enable-auto-tool-choice" not in arguments() and flag(arguments(), "--tool-call-parser") is None
    args = arguments({"NIM_TOOL_CALL_PARSER": "hermes"})
    assert "--enable-auto-tool-choice" in args and flag(args, "--tool-call-parser") == "hermes"
    with pytest.raises(SettingsError, match="NIM_TOOL_CALL_PARSER='made-up'"):
        load_settings({}, {"NIM_TOOL_CALL_PARSER": "made-up"})


def test_fp8_profiles_quantize_and_structured_args_are_json():
    args = arguments(tags={"precision": "fp8"}, engine_args={"compilation_config": {"level": 0}})
    assert flag(args, "--quantization") == "fp8" and flag(args, "--dtype") is None
    assert flag(args, "--compilation-config") == '{"level": 0}'


def test_settings_override_the_profile_and_passthrough_overrides_both():
    args = arguments({"NIM_TENSOR_PARALLEL_SIZE": "4", "NIM_ENABLE_KV_CACHE_REUSE": "0",
                      "NIM_PASSTHROUGH_ARGS": "--tensor-parallel-size 8 --swap-space '2'"})
    assert flag(args, "--tensor-parallel-size") == "8" and flag(args, "--swap-space") == "2"
    assert "--no-enable-prefix-caching" in args and "--enable-prefix-caching" not in args
    assert args.index("--no-enable-prefix-caching") < args.index("--swap-space")


def test_peft_settings_turn_on_vllms_lora_with_the_registrys_adapters(tmp_path):
    from service.adapters import Adapter

    adapters = [Adapter("a", tmp_path / "a", 8, 2.0, frozenset({"q_proj"}), (1,)),
                Adapter("b", tmp_path / "b", 4, 2.0, frozenset({"v_proj"}), (1,))]
    settings = load_settings({}, {"NIM_PEFT_SOURCE": str(tmp_path), "NIM_MAX_LORA_RANK": "24",
                                  "NIM_MAX_GPU_LORAS": "4", "NIM_MAX_CPU_LORAS": "2"})
    profile = Profile(tags=ProfileTags(engine="vllm", precision="bf16", tp=1, gpu="h100"))
    args = vllm_arguments(Path("/models/m"), "m", profile, settings, 4096, 16, 100, adapters)
    assert "--enable-lora" in args
    assert flag(args, "--max-lora-rank") == "32", "vLLM takes 8, 16, 32, ...: the smallest that holds 24"
    assert (flag(args, "--max-loras"), flag(args, "--max-cpu-loras")) == ("4", "4"), "vLLM needs cpu >= gpu"
    modules = args[args.index("--lora-modules") + 1:args.index("--middleware")]
    assert modules == [f"a={tmp_path / 'a'}", f"b={tmp_path / 'b'}"]
    assert "--enable-lora" not in arguments() and "--lora-modules" not in arguments()


VLLM_METRICS = """\
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 3.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 1.0
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25
# TYPE vllm:prefix_cache_queries counter
vllm:prefix_cache_queries_total{engine="0",model_name="m"} 480.0
# TYPE vllm:prefix_cache_hits counter
vllm:prefix_cache_hits_total{engine="0",model_name="m"} 320.0
"""


def test_gauges_come_from_vllms_exposition_and_keep_the_last_values_when_absent():
    previous = EngineStats(running=0, waiting=0, max_num_seqs=16, kv_cache_usage=0.0)
    stats = gauges_from_vllm(VLLM_METRICS, 16, previous)
    assert (stats.running, stats.waiting, stats.kv_cache_usage) == (3, 1, 0.25)
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (480, 320)
    assert gauges_from_vllm("", 16, stats) == stats



# -- the passthrough: what vLLM's app sends, observed on its way to the client ----------------------
def _runtime(app) -> SimpleNamespace:
    """A runtime whose engine app is `app`: a scripted stand-in for vLLM's app, which sends exactly
    the messages a test needs (its real counterpart runs in the integration tests)."""
    stats = EngineStats(running=0, waiting=0, max_num_seqs=4, kv_cache_usage=0.0)
    return SimpleNamespace(admission=Admission(4, 4, 8), metrics=ServiceMetrics("m", 512, lambda: stats),
                           engine=SimpleNamespace(app=app, root_app="vllm-app", http_metrics=None))


def _sample(rt, name: str, **labels) -> float:
    """The value a scrape would see now (it counts what after_requests holds first)."""
    after_requests.flush()
    return rt.metrics.registry.get_sample_value(name, {"model_name": "m", **labels}) or 0


def _engine(status: int, headers: dict[bytes, bytes], bodies: list[bytes], then=None, complete: bool = True):
    async def app(scope, receive, send):
        assert scope["app"] == "vllm-app" and dict(scope["headers"])[b"x-request-id"] == b"req-1"
        app.received = (await receive())["body"]
        await send({"type": "http.response.start", "status": status, "headers": list(headers.items())})
        for i, body in enumerate(bodies):
            await send({"type": "http.response.body", "body": body, "more_body": not complete or i < len(bodies) - 1})
        if then:
            raise then
    return app


SSE = {b"content-type": b"text/event-stream; charset=utf-8"}
ROLE = b'data: {"choices":[{"index":0,"delta":{"role":"assistant","content":""},"finish_reason":null}]}\n\n'
HI = b'data: {"choices":[{"index":0,"delta":{"content":"hi"},"finish_reason":null}]}\n\n'
END = b'data: {"choices":[{"index":0,"delta":{"content":" there"},"finish_reason":"length"}]}\n\n'
USAGE = b'data: {"choices":[],"usage":{"prompt_tokens":3,"completion_tokens":2,"total_tokens":5}}\n\n'
DONE = b"data: [DONE]\n\n"


def _pass(rt, body: bytes = b"{}", keep_usage: bool = False, on_message=None, token_per_event: bool = True) -> list[dict]:
    sent: list[dict] = []

    async def send(message):
        sent.append(message)
        if on_message:
            on_message(message)

    async def receive():
        return {"type": "http.disconnect"}

    rt.admission.enter(bounded=False)
    scope = {"type": "http", "headers": [(b"content-length", b"2")], "state": {"request_id": "req-1"}}
    asyncio.run(Passthrough(rt, body, generates=True, keep_usage=keep_usage, token_per_event=token_per_event)(
        scope, receive, send))
    return sent


def test_a_stream_passes_as_sent_counted_before_its_last_event_without_the_usage_it_did_not_ask_for():
    rt = _runtime(_engine(200, SSE, [ROLE, HI, END, USAGE, DONE]))

    def counted_before_done(message) -> None:
        if message.get("body", b"").endswith(DONE):
            assert (_sample(rt, "request_success_total", finished_reason="length"), rt.admission.in_flight) == (1, 0)

    sent = _pass(rt, on_message=counted_before_done)
    assert b"".join(m.get("body", b"") for m in sent) == ROLE + HI + END + DONE
    assert (_sample(rt, "prompt_tokens_total"), _sample(rt, "generation_tokens_total")) == (3, 2)
    assert _sample(rt, "time_to_first_token_seconds_count") == 1, "the role event carries no output"
    assert _sample(rt, "time_per_output_token_seconds_count") == 1
    kept = _pass(_runtime(_engine(200, SSE, [HI, END, USAGE, DONE])), keep_usage=True)
    assert b"".join(m.get("body", b"") for m in kept) == HI + END + USAGE + DONE


def test_after_the_first_output_each_event_until_the_last_is_a_tokens():
    held = b'data: {"choices":[{"index":0,"delta":{"content":""},"finish_reason":null}]}\n\n'  # its text held back
    rt = _runtime(_engine(200, SSE, [ROLE, HI, held, END, USAGE, DONE, b""]))  # Starlette ends with an empty body
    _pass(rt)
    assert _sample(rt, "time_per_output_token_seconds_count") == 2, "HI to the held token, it to END; no more"
    assert _sample(rt, "time_to_first_token_seconds_count") == 1

    # A /v1/responses stream also tells of its items: only its deltas are tokens.
    item = b'event: response.output_item.added\ndata: {"type":"response.output_item.added","item":{}}\n\n'
    delta = b'event: response.output_text.delta\ndata: {"type":"response.output_text.delta","delta":"hi"}\n\n'
    completed = (b'event: response.completed\ndata: {"type":"response.completed","response":'
                 b'{"usage":{"input_tokens":5,"output_tokens":2}}}\n\n')
    rt = _runtime(_engine(200, SSE, [item, delta, item, delta, item, completed]))
    _pass(rt, keep_usage=True, token_per_event=False)
    assert _sample(rt, "time_per_output_token_seconds_count") == 1 and _sample(rt, "generation_tokens_total") == 2


def test_tokens_that_came_in_one_event_count_a_gap_of_zero_each():
    """vLLM merges the tokens its API server had not yet sent into one event (RequestOutputCollector):
    the usage says how many came, and each token but the first is a gap, those merged zero."""
    two = b'data: {"choices":[{"index":0,"delta":{"content":"hi you"},"finish_reason":null}]}\n\n'
    usage_of_four = USAGE.replace(b'"completion_tokens":2', b'"completion_tokens":4')
    rt = _runtime(_engine(200, SSE, [ROLE, two, END, usage_of_four, DONE]))
    _pass(rt)
    assert _sample(rt, "time_per_output_token_seconds_count") == 3, "two events, four tokens"
    assert _sample(rt, "time_per_output_token_seconds_bucket", le="0.01") == 3, "two zeros, and a test's instant"
    assert _sample(rt, "generation_tokens_total") == 4 and _sample(rt, "time_to_first_token_seconds_count") == 1


def test_a_stream_through_the_request_id_layer_gets_its_header_once_and_every_event(caplog):
    from service.api.middleware import RequestContextMiddleware

    # Starlette ends a stream with an empty body; one that ends on a token's event is over there, not
    # aborted when the app returns (it has no usage: not counted, as an engine's 4xx).
    for bodies, finished in (([ROLE, HI, HI, END, USAGE, DONE, b""], "length"), ([ROLE, HI, HI], None)):
        rt, sent = _runtime(_engine(200, SSE, bodies)), []

        async def send(message):
            sent.append(message)

        async def receive():
            return {"type": "http.disconnect"}

        async def passthrough(scope, receive, send):
            await Passthrough(rt, b"{}", generates=True, keep_usage=True)(scope, receive, send)

        scope = {"type": "http", "method": "POST", "path": "/v1/chat/completions",
                 "headers": [(b"content-length", b"2"), (b"x-request-id", b"req-1")]}
        rt.admission.enter(bounded=False)
        with caplog.at_level("INFO", logger="service.access"):
            asyncio.run(RequestContextMiddleware(passthrough)(scope, receive, send))
        assert [v for k, v in sent[0]["headers"] if k == b"x-request-id"] == [b"req-1"]
        assert [m["body"] for m in sent[1:]] == bodies
        assert (_sample(rt, "request_failure_total", reason="abort"), rt.admission.in_flight) == (0, 0)
        assert _sample(rt, "request_success_total", finished_reason="length") == (1 if finished else 0)
        assert _sample(rt, "time_per_output_token_seconds_count") == (2 if finished else 0)
        assert caplog.records[-1].status == 200


def test_a_client_that_leaves_mid_stream_is_an_abort():
    from starlette.requests import ClientDisconnect

    for then in (None, ClientDisconnect()):  # the app returns early, or raises as Starlette does
        rt = _runtime(_engine(200, SSE, [HI, HI], then=then, complete=False))
        try:
            _pass(rt)
        except ClientDisconnect:
            pass
        assert (_sample(rt, "request_failure_total", reason="abort"), rt.admission.in_flight) == (1, 0), then
        assert _sample(rt, "request_success_total", finished_reason="stop") == 0


def test_a_whole_answer_counts_its_usage_and_a_responses_stream_its_final_event():
    reply = {"choices": [{"index": 0, "text": "x", "finish_reason": "stop"}],
             "usage": {"prompt_tokens": 4, "completion_tokens": 1}}
    body = json.dumps(reply).encode()
    rt = _runtime(_engine(200, {b"content-type": b"application/json", b"content-length": b"9"},
                          [body[:10], body[10:]]))
    start, whole = _pass(rt)
    assert dict(start["headers"])[b"content-length"] == str(len(body)).encode() and whole["body"] == body
    assert _sample(rt, "request_success_total", finished_reason="stop") == 1 and _sample(rt, "prompt_tokens_total") == 4

    delta = b'event: response.output_text.delta\ndata: {"type":"response.output_text.delta","delta":"hi"}\n\n'
    completed = (b'event: response.completed\ndata: {"type":"response.completed","response":'
                 b'{"usage":{"input_tokens":5,"output_tokens":2}}}\n\n')
    rt = _runtime(_engine(200, SSE, [delta, completed]))
    _pass(rt, keep_usage=True)
    assert (_sample(rt, "prompt_tokens_total"), _sample(rt, "generation_tokens_total")) == (5, 2)
    assert _sample(rt, "time_to_first_token_seconds_count") == 1


def test_engine_errors_reach_the_client_in_the_openai_shape_and_503_with_retry_after():
    busy = b'{"error": {"message": "busy", "type": "ServiceUnavailable", "param": null, "code": 503}}'
    rt = _runtime(_engine(503, {b"content-type": b"application/json"}, [busy]))
    start, whole = _pass(rt)
    assert start["status"] == 503 and dict(start["headers"])[b"retry-after"] == b"1" and whole["body"] == busy
    assert _sample(rt, "request_failure_total", reason="error") == 1 and rt.admission.in_flight == 0
    rt = _runtime(_engine(405, {b"content-type": b"application/json"}, [b'{"detail": "Method Not Allowed"}']))
    start, whole = _pass(rt)
    assert json.loads(whole["body"])["error"]["message"] == "Method Not Allowed"
    assert _sample(rt, "request_failure_total", reason="error") == 0, "a client's error is not the engine's"

    shaped = b'{"error": {"message": "bad n", "type": "BadRequestError", "param": "n", "code": 400}}'
    assert openai_error(400, shaped) == shaped
    unknown = b'{"error": {"message": "The model `x` does not exist.", "type": "NotFoundError", "param": null, "code": 404}}'
    assert json.loads(openai_error(404, unknown))["error"] == {
        "message": "The model `x` does not exist.", "type": "NotFoundError", "param": "model", "code": "model_not_found"}
    for status, body, message in ((404, b'{"detail": "Not Found"}', "Not Found"), (500, b"Internal Server Error", None),
                                  (422, b'{"detail": [{"loc": ["body", "n"]}]}', None)):
        error = json.loads(openai_error(status, body))["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["code"] == status
        assert error["message"] == (message or error["message"]) and error["message"]


def asking_for_usage(body: bytes, rewrite: bool) -> tuple[bytes, bool]:
    return _asking_for_usage(body, _object(body), rewrite)


def test_streams_ask_the_engine_for_usage_and_remember_whether_the_client_did():
    plain = json.dumps({"model": "m", "prompt": "x", "stream": True}).encode()
    body, asked = asking_for_usage(plain, rewrite=True)
    assert json.loads(body)["stream_options"] == {"include_usage": True} and not asked
    asking = json.dumps({"stream": True, "stream_options": {"include_usage": True}}).encode()
    assert asking_for_usage(asking, rewrite=True) == (asking, True)
    for unchanged in (b'{"stream": false}', b'{"stream": ', b'{"prompt": "x"}', b'[1]'):
        assert asking_for_usage(unchanged, rewrite=True) == (unchanged, True)
    assert asking_for_usage(plain, rewrite=False) == (plain, True)  # /v1/responses carries usage anyway


def test_stream_and_include_usage_are_read_as_vllm_reads_booleans():
    for stream in ("true", "yes", 1, 1.0, "on"):
        for include_usage in (None, False, "false", "no", 0, "off"):
            options = {} if include_usage is None else {"stream_options": {"include_usage": include_usage}}
            body, asked = asking_for_usage(json.dumps({"stream": stream, **options}).encode(), rewrite=True)
            assert json.loads(body)["stream_options"] == {"include_usage": True} and not asked, (stream, include_usage)
        for include_usage in (True, "true", "yes", 1):
            body = json.dumps({"stream": stream, "stream_options": {"include_usage": include_usage}}).encode()
            assert asking_for_usage(body, rewrite=True) == (body, True)
    kept = json.dumps({"stream": "1", "stream_options": {"include_usage": "0", "continuous_usage_stats": True}}).encode()
    assert json.loads(asking_for_usage(kept, rewrite=True)[0])["stream_options"] == {
        "include_usage": True, "continuous_usage_stats": True}
    for refused in ({"stream": True, "stream_options": "usage"}, {"stream": True, "stream_options": [1]},
                    {"stream": True, "stream_options": {"include_usage": "maybe"}}, {"stream": "maybe"},
                    {"stream": "false"}, {"stream": 0}, {"stream": None}):
        body = json.dumps(refused).encode()
        assert asking_for_usage(body, rewrite=True) == (body, True), refused  # vLLM's 400, or no stream


def test_vllms_processes_log_in_the_runtimes_format(tmp_path, capsys, restored_logging):
    settings = load_settings({}, {"NIM_JSONL_LOGGING": "1"})
    config = json.loads(write_logging_config(tmp_path, settings).read_text())
    logging.config.dictConfig(config)
    token = request_id_var.set("req-7")
    logging.getLogger("vllm.engine").info("hello %s", "there")
    request_id_var.reset(token)
    for handler in logging.getLogger().handlers:
        handler.close()  # what its writer thread had queued is written
    line = json.loads(capsys.readouterr().err.strip().splitlines()[-1])
    assert (line["logger"], line["message"], line["request_id"], line["level"]) == (
        "vllm.engine", "hello there", "req-7", "INFO")


def test_the_passthrough_app_refuses_other_methods_and_waits_for_readiness():
    from service.api.passthrough import PassthroughApp

    rt = _runtime(_engine(200, {b"content-type": b"application/json"}, [b'{"usage": {}}']))
    rt.ready, rt.not_ready_reason = False, lambda: "Service is not ready: the engine is loading."

    def call(method: str) -> tuple[int, dict, dict]:
        sent: list[dict] = []

        async def receive():
            return {"type": "http.request", "body": b'{"prompt": "x"}', "more_body": False}

        async def send(message):
            sent.append(message)

        scope = {"type": "http", "method": method, "path": "/v1/completions", "headers": [],
                 "state": {"request_id": "req-1"}}
        asyncio.run(PassthroughApp(rt)(scope, receive, send))
        return sent[0]["status"], dict(sent[0]["headers"]), json.loads(sent[1]["body"])

    status, _, body = call("GET")
    assert status == 405 and "POST" in body["error"]["message"]
    status, headers, body = call("POST")
    assert (status, headers[b"retry-after"], body["error"]["message"]) == (
        503, b"1", "Service is not ready: the engine is loading.")
    rt.ready = True
    assert call("POST")[0] == 200 and rt.engine.app.received == b'{"prompt": "x"}' and rt.admission.in_flight == 0


def test_with_json_logs_what_bypasses_logging_is_wrapped_too(capfd):
    """Native code's warnings, stdout and a child process's output become JSON records; JSON lines
    pass as they are."""
    import os
    import subprocess
    import sys

    from service.logs import json_lines_for_raw_output

    with json_lines_for_raw_output():
        os.write(2, b'{"level": "INFO", "message": "already JSON"}\n')
        os.write(2, b"[W utils.cpp:41] Warning: numa_migrate_pages failed\n\n")
        os.write(1, b"printed\n")  # as print does outside pytest, which replaces sys.stdout
        subprocess.run([sys.executable, "-c", "import sys; print('from a child', file=sys.stderr)"], check=True)
    captured = capfd.readouterr()
    lines = [json.loads(line) for line in (captured.out + captured.err).splitlines()]
    assert lines[0] == {"level": "INFO", "message": "already JSON"}
    assert [line["message"] for line in lines[1:]] == [
        "[W utils.cpp:41] Warning: numa_migrate_pages failed", "printed", "from a child"]
    assert all(line["logger"] == "output" and line["time"] for line in lines[1:])


class _SlowStream:
    """stderr as a container's log pipe that is behind: each write waits until `release` is set."""

    def __init__(self) -> None:
        import threading

        self.release, self.lines = threading.Event(), []

    def write(self, text: str) -> None:
        self.release.wait(5)
        self.lines += text.splitlines()  # the handler's writer may write several lines at once

    def flush(self) -> None:
        pass


@pytest.fixture
def restored_logging():
    """The root logger and the loggers the config names, as they were before the test configured them."""
    names = ("vllm", "uvicorn", "uvicorn.error", "uvicorn.access", "service")
    saved = {name: (logging.getLogger(name).handlers[:], logging.getLogger(name).level,
                    logging.getLogger(name).propagate) for name in (None, *names)}
    yield
    for name, (handlers, level, propagate) in saved.items():
        logger = logging.getLogger(name)
        for handler in logger.handlers:
            if handler not in handlers:
                handler.close()
        logger.handlers[:], logger.level, logger.propagate = handlers, level, propagate


def vllm_logging_config(tmp_path, stream) -> dict:
    config = json.loads(write_logging_config(tmp_path, Settings(jsonl_logging=True)).read_text())
    config["handlers"]["nim"]["stream"] = stream
    return config


def test_the_logging_config_vllm_gets_writes_off_the_serving_thread(tmp_path, restored_logging):
    """The config handed to vLLM's processes, applied as they apply it: by vLLM, then again by uvicorn
    after the contract was added to vLLM's app. A stderr reader that is behind cannot stall the
    serving thread; each record keeps its request id and its arguments as they were when logged."""
    import time

    stream = _SlowStream()
    for _ in range(2):
        logging.config.dictConfig(vllm_logging_config(tmp_path, stream))
    token = request_id_var.set("req-1")
    status = [200]
    start = time.perf_counter()
    logging.getLogger("service.access").info("POST %s %d", "/v1/completions", status[0])
    assert time.perf_counter() - start < 0.5
    request_id_var.reset(token)
    status[0] = 500
    stream.release.set()
    deadline = time.monotonic() + 5
    while not stream.lines and time.monotonic() < deadline:
        time.sleep(0.01)
    records = [json.loads(line) for line in stream.lines]
    assert [(r["message"], r["request_id"], r["logger"]) for r in records] == [
        ("POST /v1/completions 200", "req-1", "service.access")]


def test_what_was_queued_is_written_before_the_handler_closes_and_after_a_fork(tmp_path, restored_logging):
    """logging's exit hook (and a dictConfig that replaces the handler) closes it: what it had queued
    is written first. A forked child (vLLM may fork its engine processes) writes through a writer of
    its own; a closed handler writes in the caller."""
    import os

    stream = _SlowStream()
    logging.config.dictConfig(vllm_logging_config(tmp_path, stream))
    handler = logging.getLogger().handlers[0]
    for i in range(3):
        logging.getLogger("service").info("line %d", i)
    stream.release.set()
    handler.close()
    assert [json.loads(line)["message"] for line in stream.lines] == ["line 0", "line 1", "line 2"]
    logging.getLogger("service").info("after close")
    assert json.loads(stream.lines[-1])["message"] == "after close"

    read_end, write_end = os.pipe()
    with os.fdopen(write_end, "w") as pipe:
        logging.config.dictConfig(vllm_logging_config(tmp_path, pipe))
        pid = os.fork()
        if pid == 0:  # the child: log, then end as an interpreter does (logging's exit hook)
            logging.getLogger("service").info("from the child")
            logging.shutdown()
            os._exit(0)
        os.waitpid(pid, 0)
    with os.fdopen(read_end) as pipe:
        assert [json.loads(line)["message"] for line in pipe.read().splitlines()] == ["from the child"]


@pytest.mark.parametrize("body,refused", [
    (b'{"prompt": "x", "structured_outputs": [null, null]}', True),
    (b'{"prompt": "x", "structured_outputs": "json"}', True),
    (b'{"prompt": "x", "structured_outputs": {"regex": "a"}}', False),  # vLLM validates an object itself
    (b'{"prompt": "x", "structured_outputs": null}', False),
    (b'{"prompt": "x"}', False),
    (b'{not json "structured_outputs"', False),  # vLLM answers malformed JSON
])
def test_what_vllm_would_answer_with_a_500_is_a_400_first(body, refused):
    error = _refused_before_the_engine("/v1/completions", _object(body))
    assert (error is not None) == refused
    if refused:
        assert (error.status, error.param) == (400, "structured_outputs")
    assert _refused_before_the_engine("/tokenize", _object(body)) is None


@pytest.mark.parametrize("body,param", [
    ({"messages": [], "n": 25}, "n"), ({"prompt": "x", "n": "25"}, "n"), ({"prompt": "x", "n": 10**6}, "n"),
    ({"prompt": ["a", "b", "c"], "n": 9}, "prompt"), ({"prompt": [[1], [2], [3], [4], [5]], "n": 5}, "prompt"),
    ({"prompt": "x", "n": 24}, None), ({"prompt": [1, 2, 3], "n": 24}, None), ({"prompt": ["a", "b"], "n": 12}, None),
    ({"prompt": "x", "n": "many"}, None), ({"prompt": "x", "n": None}, None), ({"prompt": "x"}, None),
])
def test_more_sequences_than_vllms_queue_bound_is_a_400_not_its_503(body, param):
    """vLLM counts a request's sequences against --max-num-queued-reqs (NIM_MAX_NUM_SEQS +
    NIM_MAX_QUEUE) and answers 503 "busy" to one that no wait admits; n above NIM_MAX_NUM_SEQS
    alone it serves, as the sequences fit."""
    from service.admission import Admission
    from service.api.passthrough import _too_large

    admission = Admission(max_num_seqs=8, max_queue=16, max_seqs_per_request=24)
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    error = _too_large(path, body, admission)
    assert (error and (error.status, error.param)) == ((400, param) if param else None)
    assert _too_large("/v1/responses", body, admission) is None


def union(width: int) -> dict:
    return {"anyOf": [{"type": "string", "pattern": f"u{i}"} for i in range(width)]}


def grammar(rules: int) -> str:
    return "\n".join([f'root ::= r0 "x"', *(f'r{i} ::= "z" r{i} | "i{i}"' for i in range(rules - 1))])


def tool(name: str, parameters: dict) -> dict:
    return {"type": "function", "function": {"name": name, "parameters": parameters}}


@pytest.mark.parametrize("path,param,build", [
    ("/v1/chat/completions", "response_format",
     lambda width: {"response_format": {"type": "json_schema", "json_schema": {"name": "u", "schema": union(width)}}}),
    ("/v1/chat/completions", "tools", lambda width: {"tools": [tool("f", union(width - 502)), tool("g", union(500))]}),
    ("/v1/chat/completions", "tools", lambda width: {"tools": [tool(f"f{i}", {"type": "object"}) for i in range(width)]}),
    ("/v1/completions", "structured_outputs", lambda width: {"structured_outputs": {"json": union(width)}}),
    ("/v1/completions", "structured_outputs", lambda width: {"structured_outputs": {"grammar": grammar(width)}}),
    ("/v1/responses", "text", lambda width: {"text": {"format": {"type": "json_schema", "name": "u", "schema": union(width)}}}),
])
def test_a_constraint_wider_than_the_matcher_serves_is_refused_before_vllm(path, param, build):
    """vLLM's engine core makes the matcher and accepts its tokens, each in time quadratic in the
    width (service.engine.grammar): every request waits on them."""
    def refused(width: int, route: str = path):
        return _refused_before_the_engine(route, {"model": "m", **build(width)})

    error = refused(1001)
    assert (error.status, error.param) == (400, param) and "1001" in error.message
    assert refused(1000) is None
    assert refused(1001, "/v1/embeddings") is None


def test_a_body_nested_past_the_json_parsers_depth_goes_to_vllm_as_it_is():
    deep = b'{"prompt": "x", "stream": true, "structured_outputs": {}, "x": ' + b"[" * 5000 + b"]" * 5000 + b"}"
    assert _object(deep) is None and _object(b"[1]") is None and _object(b'{"a": ') is None
    assert asking_for_usage(deep, True) == (deep, True)  # vLLM answers it with its 400


def test_vllms_cpu_processes_get_tcmalloc_and_intel_openmp_unless_already_preloaded(tmp_path, monkeypatch):
    monkeypatch.setattr("ctypes.util.find_library", lambda name: {"tcmalloc_minimal": "libtcmalloc_minimal.so.4"}.get(name))
    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "libiomp5.so").touch()
    iomp = str(tmp_path / "lib" / "libiomp5.so")
    assert cpu_preload("", tmp_path) == f"libtcmalloc_minimal.so.4:{iomp}"
    assert cpu_preload("/opt/libjemalloc.so", tmp_path) == f"libtcmalloc_minimal.so.4:{iomp}:/opt/libjemalloc.so"
    assert cpu_preload("/usr/lib/libtcmalloc.so.4:/x/libiomp5.so", tmp_path) == "/usr/lib/libtcmalloc.so.4:/x/libiomp5.so"
    assert cpu_preload("", tmp_path / "elsewhere") == "libtcmalloc_minimal.so.4"  # an environment without intel-openmp
    monkeypatch.setattr("ctypes.util.find_library", lambda name: None)
    assert cpu_preload("", tmp_path / "elsewhere") == ""  # a base without TCMalloc: nothing to preload


def test_the_dry_run_line_names_the_environment_vllms_processes_get(tmp_path, monkeypatch):
    """`serve --dry-run` prints what vLLM's docs would have one type: LD_PRELOAD on the CPU build,
    then `vllm serve` (what the harness's own-server peer is started with); nothing on other builds."""
    import shlex

    from service.engine.vllm_server import VllmServer

    monkeypatch.setattr("ctypes.util.find_library", lambda name: {"tcmalloc_minimal": "libtcmalloc_minimal.so.4"}.get(name))
    monkeypatch.delenv("LD_PRELOAD", raising=False)
    server = VllmServer(["--model", "/models/my model"], "m", 4096, 16)
    monkeypatch.setattr("service.engine.vllm_server.vllm_build", lambda: "cpu")
    assert shlex.split(server.describe()) == ["LD_PRELOAD=libtcmalloc_minimal.so.4", "vllm", "serve", "--model", "/models/my model"]
    monkeypatch.setattr("service.engine.vllm_server.vllm_build", lambda: "cuda")
    assert server.describe() == "vllm serve --model '/models/my model'"


def test_the_settings_vllm_reads_from_its_environment_reach_it_unless_its_own_variable_is_set(monkeypatch):
    from service.engine.vllm_server import VllmServer

    monkeypatch.setattr("service.engine.vllm_server.vllm_build", lambda: "cuda")
    monkeypatch.delenv("VLLM_MAX_STOP_STRINGS", raising=False)
    server = VllmServer(["--model", "m"], "m", 4096, 16, {"VLLM_MAX_STOP_STRINGS": "6"})
    assert server.describe() == "VLLM_MAX_STOP_STRINGS=6 vllm serve --model m"
    assert server.environment({"VLLM_MAX_STOP_STRINGS": "9"}) == {}


@pytest.mark.parametrize("verification", [None, Verification("verified", key="ab" * 32, artifact="oci://r/m@sha256:" + "0" * 64)])
def test_what_the_launcher_resolved_reaches_vllms_processes_as_it_was(tmp_path, monkeypatch, verification):
    monkeypatch.delenv(RUNTIME_FILE_ENV, raising=False)
    settings = load_settings({}, {"NIM_API_KEY": "secret", "NIM_MAX_MODEL_LEN": "512"})
    resolved = Resolved(settings, "p1", tmp_path / "weights", verification)
    resolved.write(tmp_path / "runtime.json")
    assert os.environ[RUNTIME_FILE_ENV] == str(tmp_path / "runtime.json")  # what vLLM's processes inherit
    assert (tmp_path / "runtime.json").stat().st_mode & 0o777 == 0o600  # it holds the API key
    assert Resolved.read() == resolved


def test_the_writer_writes_the_lines_of_a_burst_together(tmp_path, restored_logging):
    """Lines logged within BATCH_S of the first go out in one write: a busy server wakes the writer
    thread a few times a second, not once a line."""
    import time

    from service import logs

    writes: list[str] = []
    stream = SimpleNamespace(write=writes.append, flush=lambda: None)
    logging.config.dictConfig(vllm_logging_config(tmp_path, stream))
    for i in range(20):
        logging.getLogger("service").info("line %d", i)
    time.sleep(logs.BATCH_S * 3)
    assert len(writes) < 5
    assert [json.loads(line)["message"] for w in writes for line in w.splitlines()] == [f"line {i}" for i in range(20)]

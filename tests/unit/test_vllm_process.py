"""The vLLM child's command line and the metrics the runtime reads back from it (no vLLM needed)."""

import asyncio
from pathlib import Path
import json
from types import SimpleNamespace

from service.admission import Admission
from service.api.proxy import Observed, _event, _relay, openai_error
from service.engine.base import EngineStats
from service.engine.vllm_process import gauges_from_vllm, vllm_arguments
from service.manifest import Profile, ProfileTags
from service.metrics import ServiceMetrics
from service.settings import load_settings


def arguments(env: dict[str, str] | None = None, **profile_kwargs) -> list[str]:
    tags = {"engine": "vllm", "precision": "bf16", "tp": 2, "gpu": "h100", **profile_kwargs.pop("tags", {})}
    profile = Profile(tags=ProfileTags(**tags), **profile_kwargs)
    return vllm_arguments(Path("/models/m"), "m", profile, load_settings({}, env or {}),
                          max_model_len=4096, max_num_seqs=16, port=8001)


def flag(args: list[str], name: str) -> str | None:
    """The last value given for --name (vLLM's argparse keeps the last)."""
    values = [args[i + 1] for i, arg in enumerate(args[:-1]) if arg == name]
    return values[-1] if values else None


def test_profile_tags_become_vllm_flags():
    args = arguments(engine_args={"enforce_eager": True, "max_queue": 9, "kv_cache_dtype": "fp8"})
    assert flag(args, "--model") == "/models/m" and flag(args, "--served-model-name") == "m"
    assert (flag(args, "--host"), flag(args, "--port")) == ("127.0.0.1", "8001")
    assert flag(args, "--tensor-parallel-size") == "2" and flag(args, "--dtype") == "bfloat16"
    assert "--enforce-eager" in args and flag(args, "--kv-cache-dtype") == "fp8"
    assert "--max-queue" not in args  # the runtime's own bound, not vLLM's
    assert (flag(args, "--max-model-len"), flag(args, "--max-num-seqs")) == ("4096", "16")
    assert "--enable-prefix-caching" in args


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


def test_the_usage_chunk_the_runtime_added_is_observed_then_dropped():
    observed = Observed()
    content = b'data: {"choices":[{"index":0,"delta":{"content":"hi"},"finish_reason":null}]}'
    usage = b'data: {"choices":[],"usage":{"prompt_tokens":3,"completion_tokens":1,"total_tokens":4}}'
    assert _event(content, observed, keep_usage_chunk=False) == content + b"\n\n"
    assert _event(usage, observed, keep_usage_chunk=False) == b""
    assert _event(b"data: [DONE]", observed, keep_usage_chunk=False) == b"data: [DONE]\n\n"
    assert observed.usage == {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4} and observed.ended
    assert observed.first is not None and _event(usage, Observed(), keep_usage_chunk=True) == usage + b"\n\n"


class _Upstream:
    """The engine's streamed response as aiohttp gives it: the body in the pieces the socket
    delivered (an event may be split across reads, or several may come in one), then released
    (read to the end) or closed (the connection dropped, which aborts the request in the engine)."""

    def __init__(self, body: bytes, cuts: tuple[int, ...] = ()) -> None:
        self.pieces = [body[i:j] for i, j in zip((0, *cuts), (*cuts, len(body)))]
        self.content = SimpleNamespace(iter_any=self._pieces)
        self.ended: str | None = None

    async def _pieces(self):
        for piece in self.pieces:
            yield piece

    def release(self) -> None:
        self.ended = "released"

    def close(self) -> None:
        self.ended = "closed"


def _relayed(upstream: _Upstream, keep_usage_chunk: bool = False) -> tuple[list[bytes], SimpleNamespace]:
    rt = _runtime()

    async def read_all() -> list[bytes]:
        return [piece async for piece in _relay(rt, upstream, Observed(), keep_usage_chunk)]

    return asyncio.run(read_all()), rt


def test_events_are_relayed_as_they_arrive_whatever_the_reads_cut():
    first = b'data: {"choices":[{"index":0,"text":"hi","finish_reason":null}]}\n\n'
    second = b'data: {"choices":[{"index":0,"text":" there","finish_reason":"stop"}]}\n\n'
    usage = b'data: {"choices":[],"usage":{"prompt_tokens":3,"completion_tokens":2}}\n\n'
    body = first + second + usage + b"data: [DONE]\n\n"
    for cuts in ((), (10,), (len(first),), (len(first) - 1, len(first) + 1), tuple(range(1, len(body)))):
        upstream = _Upstream(body, cuts)
        pieces, rt = _relayed(upstream)
        assert b"".join(pieces) == first + second + b"data: [DONE]\n\n", cuts  # the usage chunk dropped
        assert all(pieces), "no empty writes"
        assert (_succeeded(rt), rt.admission.in_flight, upstream.ended) == (1, 0, "released")
    pieces, _ = _relayed(_Upstream(body.replace(b"\n", b"\r\n"), (7,)), keep_usage_chunk=True)
    assert b"".join(pieces) == body, "CRLF line ends are read as LF, and the usage chunk kept when asked for"


def _runtime() -> SimpleNamespace:
    stats = EngineStats(running=0, waiting=0, max_num_seqs=4, kv_cache_usage=0.0)
    return SimpleNamespace(admission=Admission(1, 1, 2, in_flight=1), metrics=ServiceMetrics("m", 512, lambda: stats))


def _succeeded(rt) -> float:
    return rt.metrics.registry.get_sample_value("request_success_total", {"model_name": "m", "finished_reason": "stop"}) or 0


def _aborted(rt) -> float:
    return rt.metrics.registry.get_sample_value("request_failure_total", {"model_name": "m", "reason": "abort"}) or 0


def test_a_stream_is_counted_before_its_final_event_reaches_the_client():
    """A client may scrape, or close, as soon as it has [DONE]: neither may find the request uncounted."""
    rt = _runtime()
    events = (b'data: {"choices":[{"index":0,"text":"hi","finish_reason":"stop"}]}\n\n'
              b'data: {"choices":[],"usage":{"prompt_tokens":3,"completion_tokens":1}}\n\n')
    upstream = _Upstream(events + b"data: [DONE]\n\n", (len(events),))

    async def client_leaves_on_done() -> list[str]:
        relay, seen = _relay(rt, upstream, Observed(), keep_usage_chunk=False), []
        async for event in relay:
            seen.append(event)
            if event.endswith(b"data: [DONE]\n\n"):
                assert (_succeeded(rt), rt.admission.in_flight) == (1, 0), "counted only after the client had [DONE]"
                await relay.aclose()  # the client closes before the engine ends its stream
        return seen

    assert len(asyncio.run(client_leaves_on_done())) == 2
    assert (_succeeded(rt), rt.admission.in_flight, upstream.ended) == (1, 0, "closed")
    assert _aborted(rt) == 0


def test_a_client_that_leaves_mid_stream_is_an_abort_and_a_responses_stream_counts_its_usage():
    rt = _runtime()
    first = b'data: {"choices":[{"index":0,"text":"hi","finish_reason":null}]}\n\n'
    upstream = _Upstream(first + b"data: [DONE]\n\n", (len(first),))

    async def leave_after_first() -> None:
        relay = _relay(rt, upstream, Observed(), keep_usage_chunk=False)
        await relay.__anext__()
        await relay.aclose()

    asyncio.run(leave_after_first())
    assert _aborted(rt) == 1
    assert (_succeeded(rt), rt.admission.in_flight, upstream.ended) == (0, 0, "closed")

    observed = Observed()
    _event(b'event: response.completed\n'
           b'data: {"type":"response.completed","response":{"usage":{"input_tokens":5,"output_tokens":2}}}',
           observed, keep_usage_chunk=False)
    assert observed.ended and observed.usage == {"prompt_tokens": 5, "completion_tokens": 2}


def test_engine_errors_reach_the_client_in_the_openai_shape():
    shaped = b'{"error": {"message": "bad n", "type": "BadRequestError", "param": "n", "code": 400}}'
    assert openai_error(400, shaped) == shaped
    for status, body, message in ((404, b'{"detail": "Not Found"}', "Not Found"), (500, b"Internal Server Error", None),
                                  (422, b'{"detail": [{"loc": ["body", "n"]}]}', None)):
        error = json.loads(openai_error(status, body))["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["code"] == status
        assert error["message"] == (message or error["message"]) and error["message"]

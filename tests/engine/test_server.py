"""The engine's vLLM-compatible HTTP API, against a real uvicorn server on 127.0.0.1."""

import json
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
import uvicorn
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from inharness.engine.sampling import MAX_N
from inharness.engine.server import CompletionRequest, EngineState, _ChoiceOutput, _prepare, create_app
from inharness.engine.tiny import IM_END, init_tiny

PROMPT = [300, 75, 417, 893, 220, 16, 10, 17, 28]


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # Built per module (about a second) rather than in a conftest: tests/ modules import `conftest` by name.
    return init_tiny(tmp_path_factory.mktemp("tiny-engine") / "tiny", seed=0)


@dataclass
class Engine:
    url: str
    state: EngineState
    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path) -> Iterator[Engine]:
    app = create_app(str(tiny_model_dir), served_model_name="tiny")
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while True:
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                break
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, "engine did not become healthy"
        time.sleep(0.05)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    yield Engine(url, app.state.engine, model, AutoTokenizer.from_pretrained(tiny_model_dir))
    server.should_exit = True
    thread.join(timeout=10)
    sock.close()


def post(engine: Engine, **body: Any) -> httpx.Response:
    return httpx.post(f"{engine.url}/v1/completions", json={"model": "tiny", **body}, timeout=60)


def complete(engine: Engine, **body: Any) -> dict[str, Any]:
    response = post(engine, **body)
    assert response.status_code == 200, response.text
    return response.json()


def stream(engine: Engine, **body: Any) -> list[dict[str, Any]]:
    chunks: list[dict[str, Any]] = []
    payload = {"model": "tiny", "stream": True, **body}
    with httpx.stream("POST", f"{engine.url}/v1/completions", json=payload, timeout=60) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        raw = "".join(response.iter_text())
    events = [e for e in raw.split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]"
    for event in events[:-1]:
        chunks.append(json.loads(event.removeprefix("data: ")))
    return chunks


def recomputed_logprobs(
    engine: Engine, prompt: list[int], completion: list[int], temperature: float
) -> list[float]:
    with torch.no_grad():
        logits = engine.model(torch.tensor([prompt + completion])).logits[0].float()
    logp = torch.log_softmax(logits / (temperature or 1.0), dim=-1)
    return [logp[len(prompt) - 1 + i, t].item() for i, t in enumerate(completion)]


def test_health_and_models(engine: Engine) -> None:
    health = httpx.get(f"{engine.url}/health")
    assert health.status_code == 200 and health.content == b""
    models = httpx.get(f"{engine.url}/v1/models").json()
    assert models["object"] == "list"
    (card,) = models["data"]
    assert card["id"] == "tiny" and card["object"] == "model" and card["max_model_len"] == 2048


def test_token_ids_in_ids_text_logprobs_out(engine: Engine) -> None:
    body = complete(
        engine, prompt=PROMPT, max_tokens=10, temperature=0.8, seed=11, logprobs=0, return_token_ids=True
    )
    assert body["id"].startswith("cmpl-") and body["object"] == "text_completion" and body["model"] == "tiny"
    assert isinstance(body["created"], int)
    (choice,) = body["choices"]
    assert set(choice) >= {
        "index",
        "text",
        "logprobs",
        "finish_reason",
        "stop_reason",
        "token_ids",
        "prompt_token_ids",
    }
    assert choice["index"] == 0 and choice["finish_reason"] == "length" and choice["stop_reason"] is None
    assert choice["prompt_token_ids"] == PROMPT and len(choice["token_ids"]) == 10
    assert choice["text"] == engine.tokenizer.decode(choice["token_ids"], skip_special_tokens=True)
    logprobs = choice["logprobs"]
    assert logprobs["top_logprobs"] is None
    assert logprobs["tokens"] == [engine.tokenizer.decode([t]) for t in choice["token_ids"]]
    offsets = [0]
    for token in logprobs["tokens"][:-1]:
        offsets.append(offsets[-1] + len(token))
    assert logprobs["text_offset"] == offsets
    expected = recomputed_logprobs(engine, PROMPT, choice["token_ids"], 0.8)
    assert logprobs["token_logprobs"] == pytest.approx(expected, abs=1e-4)
    assert body["usage"] == {
        "prompt_tokens": len(PROMPT),
        "completion_tokens": 10,
        "total_tokens": len(PROMPT) + 10,
    }


def test_defaults_and_optional_fields(engine: Engine) -> None:
    body = complete(engine, prompt=PROMPT, seed=1, some_vllm_option={"x": 1}, echo=False)
    (choice,) = body["choices"]
    assert body["usage"]["completion_tokens"] == 16  # vLLM's default max_tokens
    assert choice["logprobs"] is None and choice["token_ids"] is None and choice["prompt_token_ids"] is None


def test_string_prompt_is_tokenized(engine: Engine) -> None:
    text = "What is 2+3?"
    ids = engine.tokenizer.encode(text)
    by_text = complete(engine, prompt=text, max_tokens=5, temperature=0, return_token_ids=True)
    by_ids = complete(engine, prompt=ids, max_tokens=5, temperature=0, return_token_ids=True)
    assert by_text["choices"][0]["prompt_token_ids"] == ids
    assert by_text["choices"] == by_ids["choices"]


def test_greedy_deterministic_and_seeded_reproducible(engine: Engine) -> None:
    greedy = [
        complete(engine, prompt=PROMPT, max_tokens=12, temperature=0, return_token_ids=True) for _ in "ab"
    ]
    assert greedy[0]["choices"] == greedy[1]["choices"]
    seeded = [complete(engine, prompt=PROMPT, max_tokens=12, seed=42, return_token_ids=True) for _ in "ab"]
    assert seeded[0]["choices"] == seeded[1]["choices"]
    other = complete(engine, prompt=PROMPT, max_tokens=12, seed=43, return_token_ids=True)
    assert other["choices"][0]["token_ids"] != seeded[0]["choices"][0]["token_ids"]


def test_stop_token_ids(engine: Engine) -> None:
    free = complete(engine, prompt=PROMPT, max_tokens=30, seed=5, return_token_ids=True, logprobs=0)[
        "choices"
    ][0]
    stop = free["token_ids"][5]
    cut = free["token_ids"].index(stop) + 1
    body = complete(
        engine, prompt=PROMPT, max_tokens=30, seed=5, stop_token_ids=[stop], return_token_ids=True, logprobs=0
    )
    (choice,) = body["choices"]
    assert choice["finish_reason"] == "stop" and choice["stop_reason"] == stop
    assert choice["token_ids"] == free["token_ids"][:cut]  # the stop token is kept in the ids ...
    assert choice["text"] == engine.tokenizer.decode(free["token_ids"][: cut - 1])  # ... but not in the text
    assert len(choice["logprobs"]["tokens"]) == cut
    assert body["usage"]["completion_tokens"] == cut


def test_stop_strings_end_generation_and_are_cut_from_the_text(engine: Engine) -> None:
    free = complete(engine, prompt=PROMPT, max_tokens=40, seed=5, return_token_ids=True)["choices"][0]
    text = free["text"]
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    assert len(stop) == 2 and stop.strip(), text
    options = {"prompt": PROMPT, "max_tokens": 40, "seed": 5, "stop": [stop], "return_token_ids": True}
    (choice,) = complete(engine, **options)["choices"]
    assert (choice["finish_reason"], choice["stop_reason"]) == ("stop", stop)
    assert choice["text"] == text[: text.find(stop)]
    assert len(choice["token_ids"]) < len(free["token_ids"])
    assert (
        choice["token_ids"] == free["token_ids"][: len(choice["token_ids"])]
    )  # the completing token is kept
    chunks = stream(engine, **options)
    assert "".join(c["choices"][0]["text"] for c in chunks) == choice["text"]
    assert [t for c in chunks for t in c["choices"][0]["token_ids"]] == choice["token_ids"]
    assert chunks[-1]["choices"][0]["stop_reason"] == stop


def test_eos_stops_by_default_unless_ignored(engine: Engine) -> None:
    im_end = engine.tokenizer.convert_tokens_to_ids(IM_END)
    job = _prepare(engine.state, CompletionRequest(prompt=PROMPT))
    assert im_end in job.params.stop_token_ids
    ignored = _prepare(engine.state, CompletionRequest(prompt=PROMPT, ignore_eos=True))
    assert im_end not in ignored.params.stop_token_ids
    # As in vLLM: stopping at the tokenizer's EOS gives stop_reason None; its text is left out either way.
    out = _ChoiceOutput(engine.state, job, 0)
    hello = engine.tokenizer.encode("hello")
    for token in hello:
        out.add(token, -1.0, None)
    out.add(im_end, -0.5, "stop")
    assert out.choice(text=out.text(), start=0, with_prompt=True)["stop_reason"] is None
    assert out.text() == "hello"


def test_n_choices(engine: Engine) -> None:
    body = complete(engine, prompt=PROMPT, max_tokens=6, seed=3, n=2, return_token_ids=True)
    assert [c["index"] for c in body["choices"]] == [0, 1]
    assert body["choices"][0]["token_ids"] != body["choices"][1]["token_ids"]
    assert body["usage"]["completion_tokens"] == 12


# The edges of every sampling value the API takes (an outside fuzzer's finds among them): each is sampled,
# never a 500. 5e-324 is the smallest positive float64, 1e-40 and 1.4e-45 float32 subnormals.
EDGES = [
    {"top_p": 5e-324},
    {"top_p": 1e-40},
    {"top_p": 1.4e-45},
    {"top_p": 1.0},
    {"temperature": 5e-324},
    {"temperature": 1e-40},
    {"temperature": 5e-324, "top_p": 5e-324},
    {"temperature": 0, "top_p": 5e-324},
    {"temperature": 1.7976931348623157e308},
    {"seed": -(2**63)},
    {"seed": 2**64 - 1},
    {"max_tokens": 1},
    {"n": MAX_N, "max_tokens": 1},
]


@pytest.mark.parametrize("edge", EDGES, ids=[json.dumps(e) for e in EDGES])
@pytest.mark.parametrize("streamed", [False, True], ids=["whole", "streamed"])
def test_sampling_values_at_their_edges_are_sampled(
    engine: Engine, edge: dict[str, Any], streamed: bool
) -> None:
    body = {"prompt": PROMPT, "max_tokens": 3, "seed": 1, "return_token_ids": True, **edge}
    n, max_tokens = body.get("n", 1), body["max_tokens"]
    if streamed:
        chunks = stream(engine, **body)
        ids: dict[int, list[int]] = {}
        for chunk in chunks:
            for c in chunk["choices"]:
                ids.setdefault(c["index"], []).extend(c["token_ids"])
        assert sorted(ids) == list(range(n)) and all(len(t) == max_tokens for t in ids.values())
    else:
        choices = complete(engine, **body)["choices"]
        assert len(choices) == n and all(len(c["token_ids"]) == max_tokens for c in choices)


def test_a_temperature_near_0_is_greedy_over_http(engine: Engine) -> None:
    greedy = complete(engine, prompt=PROMPT, max_tokens=6, temperature=0, return_token_ids=True)
    cold = complete(
        engine, prompt=PROMPT, max_tokens=6, temperature=5e-324, logprobs=0, return_token_ids=True
    )
    assert cold["choices"][0]["token_ids"] == greedy["choices"][0]["token_ids"]
    assert cold["choices"][0]["logprobs"]["token_logprobs"] == [0.0] * 6


def test_max_tokens_at_and_past_the_context_limit_ends_with_length(engine: Engine) -> None:
    context = engine.state.max_model_len
    prompt = (PROMPT * (context // len(PROMPT) + 1))[: context - 2]
    for max_tokens in (2, 3, 2**63 - 1, None):
        (choice,) = complete(
            engine, prompt=prompt, max_tokens=max_tokens, temperature=0, return_token_ids=True
        )["choices"]
        assert len(choice["token_ids"]) == 2 and choice["finish_reason"] == "length", max_tokens


def test_tokens_as_token_ids(engine: Engine) -> None:
    body = complete(
        engine,
        prompt=PROMPT,
        max_tokens=4,
        temperature=0,
        logprobs=1,
        return_tokens_as_token_ids=True,
        return_token_ids=True,
    )
    choice = body["choices"][0]
    assert choice["logprobs"]["tokens"] == [f"token_id:{t}" for t in choice["token_ids"]]


def test_skip_special_tokens_false_keeps_control_tokens(engine: Engine) -> None:
    body = complete(
        engine, prompt=PROMPT, max_tokens=8, temperature=0, skip_special_tokens=False, return_token_ids=True
    )
    choice = body["choices"][0]
    assert choice["text"] == engine.tokenizer.decode(choice["token_ids"], skip_special_tokens=False)


@pytest.mark.parametrize("n", [1, 2])
def test_stream_matches_non_stream(engine: Engine, n: int) -> None:
    options = {
        "prompt": PROMPT,
        "max_tokens": 24,
        "seed": 17,
        "n": n,
        "logprobs": 0,
        "return_token_ids": True,
    }
    whole = complete(engine, **options)
    chunks = stream(engine, **options, stream_options={"include_usage": True})
    *token_chunks, usage = chunks
    assert usage["choices"] == [] and usage["usage"] == whole["usage"]
    assert all(c["object"] == "text_completion" and c["id"] == token_chunks[0]["id"] for c in chunks)
    for index, expected in enumerate(whole["choices"]):
        mine = [c["choices"][0] for c in token_chunks if c["choices"][0]["index"] == index]
        assert mine[0]["prompt_token_ids"] == PROMPT
        assert all(c["prompt_token_ids"] is None for c in mine[1:])
        assert "".join(c["text"] for c in mine) == expected["text"]
        assert [t for c in mine for t in c["token_ids"]] == expected["token_ids"]
        assert [lp for c in mine for lp in c["logprobs"]["token_logprobs"]] == expected["logprobs"][
            "token_logprobs"
        ]
        assert [s for c in mine for s in c["logprobs"]["text_offset"]] == expected["logprobs"]["text_offset"]
        assert [c["finish_reason"] for c in mine] == [None] * (len(mine) - 1) + [expected["finish_reason"]]


def test_stream_with_stop_token_and_without_usage(engine: Engine) -> None:
    free = complete(engine, prompt=PROMPT, max_tokens=30, seed=8, return_token_ids=True)["choices"][0]
    stop = free["token_ids"][3]
    options = {
        "prompt": PROMPT,
        "max_tokens": 30,
        "seed": 8,
        "stop_token_ids": [stop],
        "return_token_ids": True,
    }
    whole = complete(engine, **options)["choices"][0]
    chunks = stream(engine, **options)
    assert all(c["choices"] for c in chunks)  # no usage chunk unless asked for
    last = chunks[-1]["choices"][0]
    assert last["finish_reason"] == "stop" and last["stop_reason"] == stop and last["token_ids"] == [stop]
    assert "".join(c["choices"][0]["text"] for c in chunks) == whole["text"]


def test_client_disconnect_stops_generation(engine: Engine) -> None:
    before = engine.state.aborted
    payload = {"model": "tiny", "prompt": PROMPT, "max_tokens": 1500, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{engine.url}/v1/completions", json=payload, timeout=60) as response:
        lines = response.iter_lines()
        received = 0
        for line in lines:
            received += line.startswith("data: ")
            if received == 3:
                break
    deadline = time.monotonic() + 20
    while engine.state.aborted == before:
        assert time.monotonic() < deadline, "generation kept running after the client left"
        time.sleep(0.05)
    assert (
        complete(engine, prompt=PROMPT, max_tokens=2, temperature=0)["choices"][0]["finish_reason"]
        == "length"
    )


def test_event_loop_stays_responsive_during_generation(engine: Engine) -> None:
    """/health answers while a completion is being generated: the model runs on the scheduler's thread, not
    on the event loop. A forward pre-hook holds that thread inside the completion's first forward pass until
    /health has answered, so "still generating" is a fact here, not a bet on timing."""
    generating, release = threading.Event(), threading.Event()

    def hold(module: torch.nn.Module, args: tuple[Any, ...]) -> None:
        generating.set()
        release.wait(timeout=60)  # bounded: a failing test must not hang the engine

    handle = engine.state.model.register_forward_pre_hook(hold)
    result: dict[str, Any] = {}
    worker = threading.Thread(
        target=lambda: result.update(
            complete(engine, prompt=PROMPT, max_tokens=40, temperature=0, ignore_eos=True)
        )
    )
    try:
        worker.start()
        assert generating.wait(timeout=30), "the completion never reached the model"
        assert httpx.get(f"{engine.url}/health", timeout=10).status_code == 200
        assert worker.is_alive()  # held in the model, it cannot have finished
    finally:
        release.set()
        worker.join(timeout=60)
        handle.remove()
    assert result["usage"]["completion_tokens"] == 40


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"prompt": [1, "a"]}, "prompt"),
        ({"prompt": [1, 2.5]}, "prompt"),
        ({"prompt": PROMPT, "max_tokens": "many"}, "max_tokens"),
        ({"prompt": PROMPT, "temperature": "hot"}, "temperature"),
        ({"prompt": PROMPT, "n": True}, "n"),
        ({"prompt": PROMPT, "stream": "yes"}, "stream"),
        ({}, "prompt"),
        ({"prompt": []}, "prompt"),
        ({"prompt": ""}, "prompt"),
        ({"prompt": [1] * 2048}, "prompt"),
        ({"prompt": [1] * 3000}, "prompt"),
        ({"prompt": [10**6]}, "prompt"),
        ({"prompt": [-1]}, "prompt"),
        ({"prompt": PROMPT, "max_tokens": 0}, "max_tokens"),
        ({"prompt": PROMPT, "n": 0}, "n"),
        ({"prompt": PROMPT, "temperature": -0.5}, "temperature"),
        ({"prompt": PROMPT, "top_p": 0}, "top_p"),
        ({"prompt": PROMPT, "top_p": -5e-324}, "top_p"),
        ({"prompt": PROMPT, "top_p": 1.0000000000000002}, "top_p"),
        ({"prompt": PROMPT, "n": MAX_N + 1}, "n"),
        ({"prompt": PROMPT, "seed": 2**64}, "seed"),
        ({"prompt": PROMPT, "seed": -(2**63) - 1}, "seed"),
        ({"prompt": PROMPT, "logprobs": -1}, "logprobs"),
        ({"prompt": PROMPT, "stop_token_ids": [10**6]}, "stop_token_ids"),
    ],
)
def test_bad_requests_are_400(engine: Engine, body: dict[str, Any], param: str) -> None:
    response = post(engine, **body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "BadRequestError" and error["code"] == 400 and error["param"] == param
    assert isinstance(error["message"], str) and error["message"]


@pytest.mark.parametrize("value", ["NaN", "Infinity", "-Infinity"])
@pytest.mark.parametrize("param", ["temperature", "top_p"])
def test_non_finite_sampling_values_are_400_naming_them(engine: Engine, param: str, value: str) -> None:
    """Python's JSON reader (FastAPI's) takes NaN and Infinity; a NaN temperature would reach
    torch.multinomial as a NaN distribution."""
    content = f'{{"prompt": {PROMPT}, "{param}": {value}}}'.encode()
    r = httpx.post(
        f"{engine.url}/v1/completions", content=content, headers={"content-type": "application/json"}
    )
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_malformed_json_is_400(engine: Engine) -> None:
    response = httpx.post(
        f"{engine.url}/v1/completions", content=b"{not json", headers={"content-type": "application/json"}
    )
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["type"] == "BadRequestError" and error["param"] is None


def test_load_weights_swaps_the_served_model_and_back(
    engine: Engine, tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    other = init_tiny(tmp_path_factory.mktemp("tiny-other") / "tiny", seed=1)
    body = {"prompt": PROMPT, "max_tokens": 12, "temperature": 0, "return_token_ids": True}
    before = complete(engine, **body)["choices"][0]["token_ids"]
    r = httpx.post(f"{engine.url}/v1/inharness/load_weights", json={"path": str(other)}, timeout=60)
    assert r.status_code == 200 and r.json()["loaded"] == str(other)
    swapped = complete(engine, **body)["choices"][0]
    expected = AutoModelForCausalLM.from_pretrained(other).eval()
    logits = expected(torch.tensor([PROMPT])).logits[0, -1]
    assert swapped["token_ids"][0] == int(torch.argmax(logits)) and swapped["token_ids"] != before
    r = httpx.post(f"{engine.url}/v1/inharness/load_weights", json={"path": str(tiny_model_dir)}, timeout=60)
    assert r.status_code == 200
    assert complete(engine, **body)["choices"][0]["token_ids"] == before
    bad = httpx.post(f"{engine.url}/v1/inharness/load_weights", json={"path": "/nonexistent"}, timeout=60)
    assert bad.status_code == 400 and "cannot load weights" in bad.json()["error"]["message"]
    assert complete(engine, **body)["choices"][0]["token_ids"] == before


def test_prefix_cache_over_http_and_cleared_by_load_weights(
    engine: Engine, tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    stats = engine.state.scheduler.stats
    system = list(range(500, 560))
    body = {"max_tokens": 10, "temperature": 0, "logprobs": 0, "return_token_ids": True}
    complete(engine, prompt=[*system, 1, 2], **body)
    before = stats.cached_tokens
    prompt = [*system, 3, 4, 5]
    choice = complete(engine, prompt=prompt, **body)["choices"][0]
    assert stats.cached_tokens - before == len(system)
    expected = recomputed_logprobs(engine, prompt, choice["token_ids"], 0)
    assert choice["logprobs"]["token_logprobs"] == pytest.approx(expected, abs=1e-4)

    other = init_tiny(tmp_path_factory.mktemp("tiny-other") / "tiny", seed=2)
    try:
        r = httpx.post(f"{engine.url}/v1/inharness/load_weights", json={"path": str(other)}, timeout=60)
        assert r.status_code == 200
        before = stats.cached_tokens
        swapped = complete(engine, prompt=prompt, **body)["choices"][0]
        assert stats.cached_tokens == before  # nothing computed by the old weights is reused
        new_model = AutoModelForCausalLM.from_pretrained(other).eval()
        with torch.no_grad():
            logits = new_model(torch.tensor([prompt + swapped["token_ids"]])).logits[0]
        logp = torch.log_softmax(logits, dim=-1)
        fresh = [logp[len(prompt) - 1 + i, t].item() for i, t in enumerate(swapped["token_ids"])]
        assert swapped["logprobs"]["token_logprobs"] == pytest.approx(fresh, abs=1e-4)
    finally:
        httpx.post(f"{engine.url}/v1/inharness/load_weights", json={"path": str(tiny_model_dir)}, timeout=60)


def concurrently(*calls: Any) -> list[Any]:
    """Run the callables at once on threads; their results in order."""
    results: list[Any] = [None] * len(calls)

    def run(i: int) -> None:
        results[i] = calls[i]()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(calls))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    return results


def test_concurrent_requests_are_batched_and_give_the_sequential_results(engine: Engine) -> None:
    bodies = [
        {"prompt": PROMPT, "max_tokens": 60, "temperature": 0},
        {"prompt": [7] * 40 + PROMPT, "max_tokens": 25, "temperature": 0},
        {"prompt": PROMPT[:3], "max_tokens": 45, "seed": 21},
        {"prompt": PROMPT * 4, "max_tokens": 30, "seed": 5, "n": 2, "temperature": 0.8, "top_p": 0.9},
        {"prompt": [99, 98, 97], "max_tokens": 50, "seed": 6, "ignore_eos": True},
    ]
    options = {"logprobs": 0, "return_token_ids": True}
    sequential = [complete(engine, **body, **options)["choices"] for body in bodies]
    steps = engine.state.scheduler.stats.batch_sizes.copy()
    together = concurrently(
        *[lambda body=body: complete(engine, **body, **options)["choices"] for body in bodies]
    )
    batched = engine.state.scheduler.stats.batch_sizes - steps
    assert max(batched) > 1, batched
    for alone, mixed in zip(sequential, together, strict=True):
        assert [c["token_ids"] for c in mixed] == [c["token_ids"] for c in alone]
        assert [c["finish_reason"] for c in mixed] == [c["finish_reason"] for c in alone]
        for a, m in zip(alone, mixed, strict=True):
            assert m["logprobs"]["token_logprobs"] == pytest.approx(a["logprobs"]["token_logprobs"], abs=1e-4)


def test_stream_and_disconnect_beside_other_requests(engine: Engine) -> None:
    aborted = engine.state.aborted
    body = {
        "prompt": PROMPT,
        "max_tokens": 120,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    alone = complete(engine, **body)["choices"][0]["token_ids"]

    def leave_early() -> int:
        payload = {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 1500, "temperature": 0, "stream": True}
        received = 0
        with httpx.stream("POST", f"{engine.url}/v1/completions", json=payload, timeout=60) as response:
            for line in response.iter_lines():
                received += line.startswith("data: ")
                if received == 3:
                    break
        return received

    streamed, left, whole = concurrently(
        lambda: stream(engine, **body),
        leave_early,
        lambda: complete(engine, **body)["choices"][0]["token_ids"],
    )
    assert left == 3 and whole == alone
    assert [t for c in streamed for t in c["choices"][0]["token_ids"]] == alone
    deadline = time.monotonic() + 20
    while engine.state.aborted == aborted:
        assert time.monotonic() < deadline, "generation kept running after the client left"
        time.sleep(0.05)


def test_engine_cli_refuses_fewer_than_one_thread(capsys: pytest.CaptureFixture[str]) -> None:
    from inharness.cli import main

    with pytest.raises(SystemExit) as exited:
        main(["engine", "--model", "unused", "--threads", "0"])
    assert exited.value.code == 2
    assert "--threads: must be at least 1" in capsys.readouterr().err

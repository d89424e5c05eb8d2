"""A minimal engine for benchmarks: answers vLLM-style `/v1/completions` at once with fixed token ids,
and OpenAI Chat Completions (`/v1/chat/completions`) at once with a fixed text, for a proxy that
speaks only that (LiteLLM).

It stands in for an inference engine so that what the gateway benchmark measures is the proxy's own
cost, not the model's. It is a benchmark tool, named as such, never used by tests or the product.
Run: python bench/fast_engine.py --port P --reply-ids 1,2,3 [--reply-text 'The answer is 5.']
"""

import argparse
import time

import orjson
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route


def build(reply: list[int], text: str = "The answer is 5.") -> Starlette:
    async def completions(request: Request) -> Response:
        body = orjson.loads(await request.body())
        prompt = body["prompt"]
        n = int(body.get("n", 1))
        ids = reply[: int(body.get("max_tokens", len(reply)))]
        lps = [-0.5] * len(ids)
        finish = "stop" if len(ids) == len(reply) else "length"
        choices = [
            {
                "index": i,
                "text": "",
                "token_ids": ids,
                "prompt_token_ids": prompt,
                "finish_reason": finish,
                "stop_reason": None,
                "logprobs": {"tokens": [], "token_logprobs": lps, "top_logprobs": None, "text_offset": []},
            }
            for i in range(n)
        ]
        head = {
            "id": "cmpl-bench",
            "object": "text_completion",
            "created": int(time.time()),
            "model": "bench",
        }
        if body.get("stream"):

            async def events():  # one chunk per choice, then the end marker
                for c in choices:
                    yield b"data: " + orjson.dumps({**head, "choices": [c]}) + b"\n\n"
                yield b"data: [DONE]\n\n"

            return StreamingResponse(events(), media_type="text/event-stream")
        usage = {
            "prompt_tokens": len(prompt),
            "completion_tokens": len(ids) * n,
            "total_tokens": len(prompt) + len(ids) * n,
        }
        return Response(
            orjson.dumps({**head, "choices": choices, "usage": usage}), media_type="application/json"
        )

    async def chat(request: Request) -> Response:
        body = orjson.loads(await request.body())
        prompt_tokens = sum(len(str(m.get("content") or "")) // 4 for m in body.get("messages", []))
        message = {"role": "assistant", "content": text}
        answer = {
            "id": "chatcmpl-bench",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": body.get("model", "bench"),
            "choices": [{"index": 0, "message": message, "finish_reason": "stop", "logprobs": None}],
            "usage": {
                "prompt_tokens": prompt_tokens,
                "completion_tokens": len(reply),
                "total_tokens": prompt_tokens + len(reply),
            },
        }
        return Response(orjson.dumps(answer), media_type="application/json")

    async def models(_: Request) -> Response:
        return Response(
            orjson.dumps(
                {"object": "list", "data": [{"id": "bench", "object": "model", "max_model_len": 2048}]}
            )
        )

    async def health(_: Request) -> Response:
        return Response(b"")

    return Starlette(
        routes=[
            Route("/v1/completions", completions, methods=["POST"]),
            Route("/v1/chat/completions", chat, methods=["POST"]),
            Route("/v1/models", models),
            Route("/health", health),
        ]
    )


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--reply-ids", required=True)
    p.add_argument("--reply-text", default="The answer is 5.", help="the Chat Completions answer")
    a = p.parse_args()
    app = build([int(x) for x in a.reply_ids.split(",")], a.reply_text)
    uvicorn.run(
        app,
        host="127.0.0.1",
        port=a.port,
        log_level="warning",
        access_log=False,
        loop="uvloop",
        http="httptools",
    )

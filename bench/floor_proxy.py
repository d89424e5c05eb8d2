"""The floor of a Python proxy on the gateway's own stack, for `bench/gateway.py`: uvicorn (uvloop,
httptools, no access log), a FastAPI route, the body parsed with orjson, one aiohttp request to the
engine's Chat Completions endpoint, its answer returned as it came. Nothing else: no key, no template,
no tokenising, no record. What it costs per call is what any gateway written on this stack pays before
doing its own work, so the gateway's cost above it is the part its design can still win back.

A benchmark tool, named as such, never used by tests or the product.
Run: python bench/floor_proxy.py --port P --engine URL
"""

import argparse
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import aiohttp
import orjson
import uvicorn
from fastapi import FastAPI, Request, Response


def build(engine: str) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async with aiohttp.ClientSession() as session:
            app.state.session = session
            yield

    app = FastAPI(lifespan=lifespan)

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        body = orjson.loads(await request.body())
        session: aiohttp.ClientSession = request.app.state.session
        headers = {"content-type": "application/json"}
        async with session.post(
            f"{engine}/v1/chat/completions", data=orjson.dumps(body), headers=headers
        ) as r:
            return Response(await r.read(), status_code=r.status, media_type="application/json")

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    return app


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--engine", required=True)
    args = ap.parse_args()
    uvicorn.run(
        build(args.engine.rstrip("/")),
        host="127.0.0.1",
        port=args.port,
        log_level="warning",
        access_log=False,
        loop="uvloop",
        http="httptools",
    )


if __name__ == "__main__":
    main()

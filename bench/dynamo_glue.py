#!/usr/bin/env python3
"""The bench's glue in front of Dynamo's selection service (policies dynamo-*, issue 43).

Dynamo's router does the routing: its selection service (`python -m dynamo.select_service`,
from the `ai-dynamo-runtime` wheel, a process of its own) holds the workers' KV index (from
their vLLM-format ZMQ events, or its approximate mode) and their booked load, and picks the
worker. This proxy only carries requests to and from it, and decides nothing itself:

1. reads the request body and asks a worker for its token ids (`POST /tokenize` with the
   body unchanged, the workers taken in turn: any worker tokenizes the same);
2. `POST /select_and_reserve {selection_id, token_ids}` to the selection service, which picks
   the worker and books the request's load there;
3. forwards the unchanged request to the endpoint it named and streams the answer back;
4. reports `prefill_complete` at the answer's first body byte (the first token) and frees the
   reservation (`DELETE /reservations/{id}`) once the answer ended or the client went away.

A failed tokenize or selection answers the client with the error (no fallback of ours).
Run with the venv that has ai-dynamo-runtime and aiohttp (mk/bench.mk, build/dynamo-venv).

Usage: dynamo_glue.py --port P --select http://127.0.0.1:S --workers URL[,URL...]
"""

import argparse
import asyncio
import itertools
import json
import time
import uuid

import aiohttp
from aiohttp import web

# The glue's own page (not forwarded): what the summary() below says so far.
STATS_PATH = "/_glue/stats"
# Hop-by-hop and length headers aiohttp sets itself on the way out.
SKIP = {"connection", "keep-alive", "transfer-encoding", "content-length", "content-encoding", "host"}


class Glue:
    def __init__(self, select, workers, stats=None):
        self.select = select.rstrip("/")
        self.stats = stats
        # Per routed request, wall ms: body read to worker named (tokenize + select), and the
        # tokenize call alone.
        self.pick_ms, self.tokenize_ms = [], []
        self.workers = [w.rstrip("/") for w in workers]
        self.turn = itertools.cycle(self.workers)
        self.session = None
        self.tasks = set()

    async def start(self, _app):
        self.session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, ttl_dns_cache=None),
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=5), auto_decompress=False)

    async def stop(self, _app):
        if self.tasks:
            await asyncio.gather(*self.tasks, return_exceptions=True)
        await self.session.close()
        if self.stats:
            with open(self.stats, "w") as f:
                json.dump(self.summary(), f)

    def summary(self):
        def q(v):
            v = sorted(v)
            return {f"p{p}": round(v[min(len(v) - 1, int(p / 100 * len(v)))], 3) for p in (50, 90, 99)} if v else {}
        return {"routed": len(self.pick_ms), "pick_ms": q(self.pick_ms), "tokenize_ms": q(self.tokenize_ms)}

    async def stats_page(self, _request):
        return web.json_response(self.summary())

    def spawn(self, coro):
        t = asyncio.ensure_future(coro)
        self.tasks.add(t)
        t.add_done_callback(self.tasks.discard)
        return t

    async def call(self, method, path):
        try:
            async with self.session.request(method, self.select + path) as r:
                await r.read()
        except aiohttp.ClientError:
            pass

    async def lifecycle_end(self, sid, prefill):
        if prefill is not None:
            await prefill
        await self.call("DELETE", f"/reservations/{sid}")

    async def handle(self, request):
        body = await request.read()
        t0 = time.perf_counter()
        headers = {k: v for k, v in request.headers.items() if k.lower() not in SKIP}
        if request.method != "POST" or not request.path.startswith("/v1/"):
            # /v1/models, /health, metrics: not routed, any worker answers.
            return await self.forward(request, self.workers[0], body, headers)
        async with self.session.post(next(self.turn) + "/tokenize", data=body,
                                     headers={"content-type": "application/json"}) as r:
            got = await r.read()
            if r.status != 200:
                return web.Response(status=r.status, body=got, content_type="application/json")
        self.tokenize_ms.append(1e3 * (time.perf_counter() - t0))
        sid = uuid.uuid4().hex
        async with self.session.post(self.select + "/select_and_reserve", data=select_body(sid, got),
                                     headers={"content-type": "application/json"}) as r:
            pick = await r.json(content_type=None)
            if r.status != 200:
                return web.json_response(pick, status=r.status)
        self.pick_ms.append(1e3 * (time.perf_counter() - t0))
        return await self.forward(request, pick["endpoint"].rstrip("/"), body, headers, sid)

    async def forward(self, request, worker, body, headers, sid=None):
        prefill = None
        try:
            async with self.session.request(request.method, worker + request.path_qs, data=body,
                                            headers=headers) as up:
                resp = web.StreamResponse(status=up.status, headers={
                    k: v for k, v in up.headers.items() if k.lower() not in SKIP})
                await resp.prepare(request)
                async for chunk in up.content.iter_any():
                    if sid is not None and prefill is None:
                        prefill = self.spawn(self.call("POST", f"/reservations/{sid}/prefill_complete"))
                    await resp.write(chunk)
                await resp.write_eof()
                return resp
        finally:
            if sid is not None:
                self.spawn(self.lifecycle_end(sid, prefill))


def select_body(sid, tokenized):
    """The select_and_reserve request for the token ids of a /tokenize answer. The ids are
    copied as the worker wrote them (a flat list of integers), not parsed and printed again:
    at 8k tokens that was most of this glue's CPU."""
    i = tokenized.find(b'"tokens"')
    start = tokenized.find(b"[", i) if i >= 0 else -1
    end = tokenized.find(b"]", start) if start >= 0 else -1
    if end < 0:
        ids = json.dumps(json.loads(tokenized)["tokens"]).encode()
    else:
        ids = tokenized[start:end + 1]
    return b'{"selection_id":"' + sid.encode() + b'","token_ids":' + ids + b"}"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--select", required=True, help="the selection service's URL")
    ap.add_argument("--workers", required=True, help="the workers' URLs (tokenize), comma-separated")
    ap.add_argument("--stats", help="at exit, write here the wall time from request to worker named "
                    "(tokenize + selection) per routed request, p50/p90/p99 ms (JSON)")
    a = ap.parse_args()
    try:
        import uvloop
        uvloop.install()
    except ImportError:
        pass
    glue = Glue(a.select, a.workers.split(","), a.stats)
    app = web.Application(client_max_size=64 << 20)
    app.on_startup.append(glue.start)
    app.on_cleanup.append(glue.stop)
    app.router.add_get(STATS_PATH, glue.stats_page)
    app.router.add_route("*", "/{tail:.*}", glue.handle)
    web.run_app(app, host=a.host, port=a.port, access_log=None, print=None)


if __name__ == "__main__":
    main()

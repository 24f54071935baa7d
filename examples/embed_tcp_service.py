"""Embedding: an asyncio TCP service that forwards each request to an actor mesh.

    python examples/embed_tcp_service.py            # serve, answer 5 demo clients, exit
    python examples/embed_tcp_service.py --serve    # keep serving on 127.0.0.1:8765

The service owns its event loop (here uvloop if installed); the runtime
simply joins it. Each line a client sends is scored by one of the pool's
actors (``choose`` spreads the load) and the answer is written back.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib

from actors import Actor, current_rank, endpoint, this_host


class Scorer(Actor):
    @endpoint
    async def score(self, text: str) -> str:
        digest = hashlib.sha256(text.encode()).hexdigest()[:8]
        return f"worker {current_rank().rank} scored {text!r}: {digest}"


def make_handler(pool: Scorer):
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while line := await reader.readline():
            answer = await pool.score.choose(line.decode().strip())
            writer.write(answer.encode() + b"\n")
            await writer.drain()
        writer.close()

    return handle


async def client(port: int, text: str) -> str:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(text.encode() + b"\n")
    await writer.drain()
    answer = await reader.readline()
    writer.close()
    await writer.wait_closed()
    return answer.decode().strip()


async def main(serve_forever: bool, port: int) -> None:
    procs = this_host().spawn_procs(per_host={"procs": 2}, name="scorers")
    pool = procs.spawn("scorer", Scorer)
    server = await asyncio.start_server(make_handler(pool), "127.0.0.1", port)
    bound = server.sockets[0].getsockname()[1]
    print(f"serving on 127.0.0.1:{bound}", flush=True)
    async with server:
        if serve_forever:
            await server.serve_forever()
        else:
            answers = await asyncio.gather(*(client(bound, f"request {i}") for i in range(5)))
            for answer in answers:
                print(answer)
    await procs.stop()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--serve", action="store_true", help="keep serving until Ctrl-C")
    parser.add_argument("--port", type=int, default=0, help="TCP port (default: any free one; 8765 with --serve)")
    args = parser.parse_args()
    try:
        import uvloop

        run = uvloop.run
    except ImportError:
        run = asyncio.run
    run(main(args.serve, args.port or (8765 if args.serve else 0)))

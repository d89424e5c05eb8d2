"""Harness start-up with and without spec.local.preload, side by side: N attempts of a script that
does what examples/calc/harness.py does before its first model call (import openai, build a client),
run one after another as the local rollout backend starts them: exec'd (`python script.py`) or forked
from a preload process that imported openai once (`Zygote`). CPU seconds are the children's, from
getrusage(RUSAGE_CHILDREN) deltas (the preload process's own, its import included, count once it is
reaped); wall seconds are start to exit code.

    .venv/bin/python bench/harness_start.py [--attempts 20]
"""

import argparse
import asyncio
import os
import resource
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

from inharness.operator.rollouts.local import Zygote

SCRIPT = "import openai\nopenai.OpenAI(api_key='x', base_url='http://127.0.0.1:9/v1')\n"


def children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


async def execd(work: Path, n: int) -> None:
    for i in range(n):
        with (work / f"x{i}.out").open("wb") as out:
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "start.py", cwd=work, stdout=out, stderr=out, start_new_session=True
            )
        assert await proc.wait() == 0


async def forked(work: Path, n: int) -> None:
    zygote = Zygote(["openai"], work, work / "preload.log")
    await zygote.start()
    try:
        for i in range(n):
            out = work / f"f{i}.out"
            _, exited = await zygote.spawn(["start.py"], dict(os.environ), work, out, out)
            assert await exited == 0
    finally:
        await zygote.close()


async def measure(run: Callable[[Path, int], Awaitable[None]], work: Path, n: int) -> tuple[float, float]:
    cpu, wall = children_cpu(), time.monotonic()
    await run(work, n)
    return (children_cpu() - cpu) / n, (time.monotonic() - wall) / n


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--attempts", type=int, default=20)
    n = parser.parse_args().attempts
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        (work / "start.py").write_text(SCRIPT)
        await execd(work, 1)  # bytecode compiled, page cache warm for both
        rows = {"exec": await measure(execd, work, n), "preload": await measure(forked, work, n)}
    print(f"harness start-up (import openai, build a client), {n} attempts each, {os.cpu_count()} CPUs")
    print(f"{'launcher':>10} {'CPU s/attempt':>14} {'wall s/attempt':>15}")
    for name, (cpu, wall) in rows.items():
        print(f"{name:>10} {cpu:>14.3f} {wall:>15.3f}")
    (e_cpu, e_wall), (p_cpu, p_wall) = rows["exec"], rows["preload"]
    print(f"{'ratio':>10} {p_cpu / e_cpu:>14.3f} {p_wall / e_wall:>15.3f}   (preload / exec)")


if __name__ == "__main__":
    asyncio.run(main())

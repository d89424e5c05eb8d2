"""`make demo-gateway`: a tiny model behind the built-in engine and the gateway, one real multi-turn
tool-calling conversation through them with the official `openai` client, and what was recorded.

Everything is made here: the model is `inharness model init-tiny` plus a few seconds of supervised
warm-up on one calculator trace, so that greedy decoding really calls the tool.
"""

import ast
import json
import operator
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from inharness.procs import ServerProcess, free_port

CALC_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression.",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string"}},
            "required": ["expression"],
        },
    },
}
SYSTEM = "You are a careful assistant. Use the calculator tool for arithmetic."
QUESTION = "What is 2+3?"
FINAL = "The answer is 5."
CALC_CONVERSATION: dict[str, Any] = {
    "tools": [CALC_TOOL],
    "messages": [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": QUESTION},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": "call_0",
                    "type": "function",
                    "function": {"name": "calculator", "arguments": '{"expression": "2+3"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_0", "content": "5"},
        {"role": "assistant", "content": FINAL},
    ],
}
WARMUP_STEPS = 60
ADMIN = "demo-admin-token"

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}


def calculator(expression: str) -> str:
    """The harness's tool: + - * / on numbers, nothing else."""

    def ev(node: ast.AST) -> float:
        if isinstance(node, ast.Constant) and isinstance(node.value, int | float):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.left), ev(node.right))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -ev(node.operand)
        raise ValueError(f"unsupported expression: {expression!r}")

    try:
        value = ev(ast.parse(expression, mode="eval").body)
    except (ValueError, SyntaxError, ZeroDivisionError) as exc:
        return f"error: {exc}"
    return str(int(value)) if float(value).is_integer() else str(value)


def harness(base_url: str, api_key: str) -> list[dict[str, Any]]:
    """What an agent harness does: ask, run the tools the model calls, ask again, until an answer."""
    import openai

    client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": QUESTION},
    ]
    for _turn in range(4):
        reply = client.chat.completions.create(
            model="my-agent-model", messages=messages, tools=[CALC_TOOL], temperature=0, max_tokens=64
        )
        msg = reply.choices[0].message
        messages.append(msg.model_dump(exclude_none=True))
        if not msg.tool_calls:
            break
        for call in msg.tool_calls:
            args = json.loads(call.function.arguments)
            messages.append(
                {"role": "tool", "tool_call_id": call.id, "content": calculator(args["expression"])}
            )
    return messages


def _show(tok: Any, ids: list[int], limit: int = 160) -> str:
    text = tok.decode(ids, skip_special_tokens=False)
    text = text.replace("\n", "\\n")
    return text if len(text) <= limit else "..." + text[-limit:]


def main() -> int:
    from inharness.engine.tiny import init_tiny
    from inharness.trainer.sft import sft

    work = Path(".demo")
    work.mkdir(exist_ok=True)
    t0 = time.time()
    print("1. tiny model: init-tiny + supervised warm-up on one calculator trace")
    base = init_tiny(work / "tiny", seed=0)
    model = work / "tiny-calc"
    stats = sft(base, [CALC_CONVERSATION], out_dir=model, steps=WARMUP_STEPS)
    print(f"   loss {stats['loss_first']:.3f} -> {stats['loss_last']:.3f} in {time.time() - t0:.1f}s")

    engine, gateway = _servers(work, model)
    print("2. engine and gateway on 127.0.0.1")
    engine.start()
    gateway.start()
    print(f"   engine  {engine.url}\n   gateway {gateway.url}")
    try:
        calls, export, reward = _one_attempt(gateway.url)
        _show_calls(model, calls, reward)
        print(f"5. export: {len(export)} finished rollout(s); first has {len(export[0]['calls'])} calls")
        print(f"done in {time.time() - t0:.1f}s; logs in {work}/")
    finally:
        gateway.stop()
        engine.stop()
    return 0


def _servers(work: Path, model: Path) -> tuple[ServerProcess, ServerProcess]:
    """The engine serving ``model`` and a gateway in front of it with a fresh store (not started)."""
    eport, gport = free_port(), free_port()
    engine = ServerProcess.inharness(
        ["engine", "--model", str(model), "--port", str(eport)],
        port=eport,
        log=work / "engine.log",
        health="/health",
    )
    db = work / "gateway.db"
    db.unlink(missing_ok=True)
    argv = ["gateway", "--model", str(model), "--engine", engine.url, "--store", f"sqlite:///{db}"]
    argv += ["--port", str(gport), "--admin-token", ADMIN]
    gateway = ServerProcess.inharness(argv, port=gport, log=work / "gateway.log", health="/healthz")
    return engine, gateway


def _one_attempt(gateway_url: str) -> tuple[list[dict[str, Any]], list[dict[str, Any]], float]:
    """One rollout, claimed and run by the harness, completed with its reward: (its recorded calls,
    the export of finished rollouts, the reward)."""
    with httpx.Client(base_url=gateway_url, headers={"Authorization": f"Bearer {ADMIN}"}, timeout=60) as c:
        c.post("/api/v1/rollouts", json={"tasks": [{"question": QUESTION, "answer": "5"}]}).raise_for_status()
        attempt = c.post("/api/v1/attempts/claim", json={"lease_seconds": 300}).json()["attempt"]
        print(f"3. harness conversation on attempt {attempt['id']} (it sees only a base URL and a key)")
        messages = harness(f"{gateway_url}/v1", attempt["token"])
        for m in messages:
            shown = m.get("content") or json.dumps([tc["function"] for tc in m.get("tool_calls", [])])
            print(f"   {m['role']:>9}: {shown}")
        answer = messages[-1].get("content") or ""
        reward = 1.0 if "5" in answer else 0.0
        c.post(f"/api/v1/attempts/{attempt['id']}/complete", json={"status": "succeeded", "reward": reward})
        calls = c.get(f"/api/v1/attempts/{attempt['id']}/calls").json()["calls"]
        export = [json.loads(x) for x in c.get("/api/v1/export/rollouts").text.splitlines()]
    return calls, export, reward


def _show_calls(model: Path, calls: list[dict[str, Any]], reward: float) -> None:
    """What the gateway recorded of each call, and whether each prompt extends the call before it
    token-exactly."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    print(f"4. recorded: {len(calls)} calls, reward {reward}")
    prev: dict[str, Any] | None = None
    for call in calls:
        lp = call["response_logprobs"]
        print(
            f"   call {call['id']}: version {call['model_version']}, {len(call['prompt_ids'])} prompt + "
            f"{len(call['response_ids'])} response tokens, mean logprob {sum(lp) / len(lp):.3f}, "
            f"parent {call['parent_call_id']}, prefix_reused {call['prefix_reused']}, "
            f"mismatch {call['prefix_mismatch']}"
        )
        print(f"      response: {_show(tok, call['response_ids'])}")
        if prev is not None:
            n = len(prev["prompt_ids"]) + len(prev["response_ids"])
            exact = call["prompt_ids"][:n] == prev["prompt_ids"] + prev["response_ids"]
            print(f"      prompt starts with call {prev['id']}'s prompt+response token-exactly: {exact}")
            print(f"      new tokens after it: {_show(tok, call['prompt_ids'][n:])}")
        prev = call


if __name__ == "__main__":
    sys.exit(main())

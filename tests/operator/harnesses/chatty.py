"""A multi-turn harness for the chaos test: `turns` Chat Completions calls, each extending the last
(its reply and one more user turn), with the standard library only so that 50 of them start fast.

Each answer it received is appended to `$CHAOS_ANSWERS/<attempt id>.jsonl` before it goes on: the
record of what the harness got, which the test holds against what the gateway recorded. Like the
official SDKs, it tries a failed request twice more after a short wait. With several gateway replicas
(`$CHAOS_GATEWAYS`, their base URLs), it talks to the one its attempt id picks, as a load balancer with
sticky connections would; each answer's line names that replica's port."""

import json
import os
import time
import urllib.error
import urllib.request
import zlib
from pathlib import Path

task = json.loads(Path(os.environ["INHARNESS_TASK_FILE"]).read_text())
attempt = os.environ["INHARNESS_ATTEMPT_ID"]
replicas = os.environ["CHAOS_GATEWAYS"].split()
gateway = replicas[zlib.crc32(attempt.encode()) % len(replicas)]
url = gateway + "/v1/chat/completions"
headers = {"Authorization": f"Bearer {os.environ['OPENAI_API_KEY']}", "Content-Type": "application/json"}
answers = Path(os.environ["CHAOS_ANSWERS"]) / f"{attempt}.jsonl"


def ask(messages: list[dict[str, str]]) -> dict:
    body = json.dumps({"model": os.environ["OPENAI_MODEL"], "messages": messages, "max_tokens": 6}).encode()
    for tries_left in (2, 1, 0):
        try:
            request = urllib.request.Request(url, data=body, headers=headers, method="POST")
            with urllib.request.urlopen(request, timeout=30) as r:
                return json.loads(r.read())
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            if not tries_left:
                raise
            time.sleep(0.5)
    raise AssertionError("unreachable")


messages = [{"role": "user", "content": task["question"]}]
for turn in range(task["turns"]):
    reply = ask(messages)
    with answers.open("a") as out:
        out.write(json.dumps({"id": reply["id"], "turn": turn, "via": gateway.rpartition(":")[2]}) + "\n")
    messages.append({"role": "assistant", "content": reply["choices"][0]["message"]["content"] or ""})
    messages.append({"role": "user", "content": f"And after step {turn + 1}?"})
Path(os.environ["INHARNESS_RESULT_FILE"]).write_text(json.dumps({"reward": 1.0}))

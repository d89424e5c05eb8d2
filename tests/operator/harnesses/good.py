"""A well-behaved harness: asks the policy through the gateway with the official `openai` client,
configured only by the environment (as an unmodified harness is), and writes its reward."""

import json
import os
from pathlib import Path

import openai

task = json.loads(Path(os.environ["INHARNESS_TASK_FILE"]).read_text())
base_url = os.environ["OPENAI_BASE_URL"]
client = openai.OpenAI(base_url=base_url, api_key=os.environ["OPENAI_API_KEY"], max_retries=0, timeout=30)
reply = client.chat.completions.create(
    model=os.environ["OPENAI_MODEL"],
    messages=[{"role": "user", "content": task["question"]}],
    max_tokens=4,
    temperature=0,
)
result = {"reward": task.get("reward", 1.0), "answer": reply.choices[0].message.content, "base_url": base_url}
Path(os.environ["INHARNESS_RESULT_FILE"]).write_text(json.dumps(result))

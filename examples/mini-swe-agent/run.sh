#!/bin/sh
# One attempt of mini-SWE-agent, unmodified: its `mini` CLI on the task, in a fresh workspace beside the
# attempt's result file, talking to the gateway through LiteLLM's OpenAI provider (OPENAI_BASE_URL,
# OPENAI_API_KEY and OPENAI_MODEL come from `inharness run` or the operator). It writes its trajectory
# (traj.json) as it would against OpenAI. The agent gets the task's text only: the task's JSON (which
# names the expected content) and the result file's path are taken out of its environment. Its own
# documented step limit ends an agent that never submits; the spec's timeoutSeconds ends one that hangs.
# The task's `files` (family.py) are written into the workspace first.
# Whatever it did, grade.py then reads the workspace for the reward.
set -eu
here=$(cd "$(dirname "$0")" && pwd)
mini=${MINI_SWE_AGENT_BIN:-$here/../../.cache/harnesses/mini-swe-agent/bin/mini}
result=$INHARNESS_RESULT_FILE
attempt=$(dirname "$result")
mkdir -p "$attempt/workspace" "$attempt/mswea-config"
text=$(python3 -c 'import json, os; print(json.loads(os.environ["INHARNESS_TASK"])["task"])')
python3 -c '
import json, os, pathlib, sys
for name, content in json.loads(os.environ["INHARNESS_TASK"]).get("files", {}).items():
    (pathlib.Path(sys.argv[1]) / name).write_text(content)
' "$attempt/workspace"
cd "$attempt/workspace"
status=0
env -u INHARNESS_TASK -u INHARNESS_RESULT_FILE MSWEA_GLOBAL_CONFIG_DIR="$attempt/mswea-config" \
  "$mini" -m "openai/$OPENAI_MODEL" -t "$text" -y --exit-immediately -o "$attempt/traj.json" \
  -c mini.yaml -c agent.step_limit="${MINI_STEP_LIMIT:-4}" </dev/null || status=$?
test -s "$attempt/traj.json"  # no trajectory: mini did not run (a broken install), not a 0 reward
[ "$status" = 0 ] || echo "mini exited with code $status; grading the workspace as it is" >&2
python3 "$here/grade.py" "$attempt/workspace" >"$result"

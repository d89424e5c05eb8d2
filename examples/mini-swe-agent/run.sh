#!/bin/sh
# One attempt of mini-SWE-agent, unmodified: its `mini` CLI on the task, in a fresh workspace beside the
# attempt's result file, talking to the gateway through LiteLLM's OpenAI provider (OPENAI_BASE_URL,
# OPENAI_API_KEY and OPENAI_MODEL come from `inharness run` or the operator). It writes its trajectory
# (traj.json) as it would against OpenAI; the reward is whether the task's file holds what it asked for.
set -eu
here=$(cd "$(dirname "$0")" && pwd)
mini=${MINI_SWE_AGENT_BIN:-$here/../../.cache/harnesses/mini-swe-agent/bin/mini}
attempt=$(dirname "$INHARNESS_RESULT_FILE")
mkdir -p "$attempt/workspace" "$attempt/mswea-config"
cd "$attempt/workspace"
task() { python3 -c 'import json, os, sys; print(json.loads(os.environ["INHARNESS_TASK"])[sys.argv[1]])' "$1"; }
MSWEA_GLOBAL_CONFIG_DIR="$attempt/mswea-config" \
  "$mini" -m "openai/$OPENAI_MODEL" -t "$(task task)" -y --exit-immediately -o "$attempt/traj.json" </dev/null
test -s "$attempt/traj.json"
reward=0
[ "$(cat "$(task file)" 2>/dev/null)" = "$(task content)" ] && reward=1
printf '{"reward": %s, "trajectory": "%s"}\n' "$reward" "$attempt/traj.json" >"$INHARNESS_RESULT_FILE"

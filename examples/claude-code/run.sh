#!/bin/sh
# One attempt of Claude Code, unmodified: `claude -p` on the task in a fresh workspace beside the
# attempt's result file, with a fresh CLAUDE_CONFIG_DIR, its Anthropic endpoint the gateway
# (ANTHROPIC_BASE_URL: the gateway's base URL without /v1, as Anthropic's SDK appends /v1/messages) and
# the attempt's key as ANTHROPIC_API_KEY. It prints its JSON result (claude.json) as it would against
# Anthropic; the reward is whether the task's file holds what it asked for.
set -eu
here=$(cd "$(dirname "$0")" && pwd)
claude=${CLAUDE_CODE_BIN:-$here/../../.cache/harnesses/claude-code/node_modules/.bin/claude}
attempt=$(dirname "$INHARNESS_RESULT_FILE")
mkdir -p "$attempt/workspace" "$attempt/claude-config"
cd "$attempt/workspace"
task() { python3 -c 'import json, os, sys; print(json.loads(os.environ["INHARNESS_TASK"])[sys.argv[1]])' "$1"; }
ANTHROPIC_BASE_URL=${INHARNESS_GATEWAY_URL%/v1} CLAUDE_CONFIG_DIR="$attempt/claude-config" \
  "$claude" -p "$(task task)" --output-format json --model "$ANTHROPIC_MODEL" \
  ${CLAUDE_CODE_ARGS:-} </dev/null >"$attempt/claude.json"
python3 -c 'import json, sys; r = json.load(open(sys.argv[1])); sys.exit(r.get("is_error") is not False)' "$attempt/claude.json"
reward=0
[ "$(cat "$(task file)" 2>/dev/null)" = "$(task content)" ] && reward=1
printf '{"reward": %s}\n' "$reward" >"$INHARNESS_RESULT_FILE"

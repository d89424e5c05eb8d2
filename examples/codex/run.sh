#!/bin/sh
# One attempt of Codex CLI, unmodified: `codex exec` on the task in a fresh workspace beside the
# attempt's result file, with a fresh CODEX_HOME whose config.toml (this folder's, base_url set to
# $OPENAI_BASE_URL) makes the gateway its only model provider. It writes its last message
# (last-message.txt) and its JSONL events (events.jsonl) as it would against OpenAI; the reward is
# whether the task's file holds what it asked for.
set -eu
here=$(cd "$(dirname "$0")" && pwd)
codex=${CODEX_BIN:-$here/../../.cache/harnesses/codex/node_modules/.bin/codex}
attempt=$(dirname "$INHARNESS_RESULT_FILE")
mkdir -p "$attempt/workspace" "$attempt/codex-home"
sed "s#^base_url = .*#base_url = \"$OPENAI_BASE_URL\"#" "$here/config.toml" >"$attempt/codex-home/config.toml"
task() { python3 -c 'import json, os, sys; print(json.loads(os.environ["INHARNESS_TASK"])[sys.argv[1]])' "$1"; }
CODEX_HOME="$attempt/codex-home" "$codex" exec --strict-config --skip-git-repo-check --ephemeral --json --color never \
  -m "$OPENAI_MODEL" -C "$attempt/workspace" -o "$attempt/last-message.txt" "$(task task)" \
  </dev/null >"$attempt/events.jsonl"
test -e "$attempt/last-message.txt"
reward=0
[ "$(cat "$attempt/workspace/$(task file)" 2>/dev/null)" = "$(task content)" ] && reward=1
printf '{"reward": %s}\n' "$reward" >"$INHARNESS_RESULT_FILE"

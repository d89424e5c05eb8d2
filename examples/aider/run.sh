#!/bin/sh
# One attempt of Aider, unmodified: `aider --message` on the task in a fresh workspace beside the
# attempt's result file, through LiteLLM's OpenAI provider: Aider reads OPENAI_API_BASE and OPENAI_API_KEY
# itself, OPENAI_MODEL names the model (all three come from `inharness run` or the operator). Aider edits in its "whole" format: it writes
# the file the reply names. HOME is the attempt's folder, so that Aider's caches and analytics state
# stay there; no git, no update check, no analytics, no network. Whatever Aider did (it exits 0 even
# when its model layer aborted the stream), the reward is whether the task's file holds its content.
set -eu
here=$(cd "$(dirname "$0")" && pwd)
aider=${AIDER_BIN:-$here/../../.cache/harnesses/aider/bin/aider}
attempt=$(dirname "$INHARNESS_RESULT_FILE")
mkdir -p "$attempt/workspace"
task() { python3 -c 'import json, os, sys; print(json.loads(os.environ["INHARNESS_TASK"])[sys.argv[1]])' "$1"; }
file=$(task file)
# The served model's metadata, as Aider's docs say for a model LiteLLM's table lacks: without it Aider
# downloads LiteLLM's whole price table on every start (and waits for it offline).
printf '{"openai/%s": {"max_input_tokens": 65536, "max_output_tokens": 4096, "input_cost_per_token": 0, "output_cost_per_token": 0, "litellm_provider": "openai", "mode": "chat"}}\n' \
  "$OPENAI_MODEL" >"$attempt/model-metadata.json"
cd "$attempt/workspace"
HOME="$attempt" "$aider" --model "openai/$OPENAI_MODEL" --edit-format whole --map-tokens 0 --no-git --yes-always \
  --no-check-update --no-show-release-notes --analytics-disable --no-show-model-warnings --no-pretty \
  --no-fancy-input --no-detect-urls --no-suggest-shell-commands --no-auto-lint \
  --model-metadata-file "$attempt/model-metadata.json" \
  --chat-history-file "$attempt/chat.md" --llm-history-file "$attempt/llm.log" \
  --message "$(task task)" "$file" </dev/null >"$attempt/aider.out" 2>&1
reward=0
[ "$(cat "$file" 2>/dev/null)" = "$(task content)" ] && reward=1
printf '{"reward": %s}\n' "$reward" >"$INHARNESS_RESULT_FILE"

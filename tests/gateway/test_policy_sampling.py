"""The gateway samples at the policy's settings (`--temperature`, `--max-tokens`: a TrainingRun's
spec.generation), not at what a harness asks: the trainer scores the samples at the run's temperature,
so a harness's own temperature would make every recorded log-prob the wrong quantity."""

from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import ADMIN
from gwhelpers import calls_of, harness_client, new_attempt
from testsupport import Server, gateway_server

# Not the calc trace the tool model was warmed on: at the harness's 1.5 its next tokens are far from sure.
UNTRAINED = [{"role": "user", "content": "Name three colours of the sea at night, and why."}]


@pytest.fixture(scope="module")
def greedy_gateway(
    engine: Server, tool_model: Path, tmp_path_factory: pytest.TempPathFactory, log_dir: Path
) -> Iterator[Server]:
    db = tmp_path_factory.mktemp("policy-gw") / "gateway.db"
    extra = ["--temperature", "0", "--max-tokens", "3"]
    server = gateway_server(tool_model, [engine.url], db, log_dir, admin_token=ADMIN, extra=extra).start()
    yield server
    server.stop()


def test_every_call_is_sampled_at_the_policys_temperature_and_token_limit(greedy_gateway: Server) -> None:
    attempt = new_attempt(greedy_gateway)
    client = harness_client(greedy_gateway, attempt["token"])
    answers = [
        client.chat.completions.create(model="m", messages=UNTRAINED, temperature=1.5, max_tokens=50, seed=k)
        for k in range(3)
    ]
    assert all(a.usage.completion_tokens == 3 for a in answers)
    calls = calls_of(greedy_gateway, attempt["id"])
    # Three seeds at the harness's 1.5 would not give one answer three times: greedy decoding does.
    assert len(calls) == 3 and len({tuple(c["response_ids"]) for c in calls}) == 1
    assert all(c["finish_reason"] == "length" and c["request"]["temperature"] == 1.5 for c in calls)

"""The trainer's last progress report and the reward of recent steps, kept by the gateway so that
whoever watches the run (the operator, a user with the admin token) asks one place.

Kept in the store (one row, `to_json`): every gateway process on it answers the same board, and a
restarted gateway still has it.
"""

import time
from typing import Any

from inharness.gateway import schema

HISTORY = 100


class ProgressBoard:
    def __init__(self) -> None:
        self.last: schema.ProgressReport | None = None
        self.updated_at: float | None = None
        self.ray_nodes: int | None = None
        self.ray_nodes_wanted: int | None = None
        self._rewards: dict[int, float] = {}

    def record(self, report: schema.ProgressReport) -> None:
        """Keep the report; a resumed trainer reporting an earlier step drops the steps after it. The
        Ray counts come from whichever report carries them; a `starting` report (step unknown yet)
        changes nothing else."""
        if report.ray_nodes is not None:
            self.ray_nodes, self.ray_nodes_wanted = report.ray_nodes, report.ray_nodes_wanted
        if report.state == "starting":
            self.updated_at = time.time()
            return
        self._rewards = {s: r for s, r in self._rewards.items() if s <= report.step}
        if report.reward_mean is not None and report.step > 0:
            self._rewards[report.step] = report.reward_mean
        for old in sorted(self._rewards)[:-HISTORY]:
            del self._rewards[old]
        self.last, self.updated_at = report, time.time()

    def to_json(self) -> dict[str, Any]:
        return {
            "last": self.last.model_dump(mode="json") if self.last else None,
            "updated_at": self.updated_at,
            "ray_nodes": self.ray_nodes,
            "ray_nodes_wanted": self.ray_nodes_wanted,
            "rewards": sorted(self._rewards.items()),
        }

    @classmethod
    def from_json(cls, data: dict[str, Any] | None) -> "ProgressBoard":
        """The board `to_json` wrote (None: an empty board)."""
        board = cls()
        if data:
            board.last = schema.ProgressReport.model_validate(data["last"]) if data["last"] else None
            board.updated_at, board.ray_nodes = data["updated_at"], data["ray_nodes"]
            board.ray_nodes_wanted = data["ray_nodes_wanted"]
            board._rewards = {int(step): float(r) for step, r in data["rewards"]}
        return board

    def history(self) -> list[float]:
        return [self._rewards[s] for s in sorted(self._rewards)]

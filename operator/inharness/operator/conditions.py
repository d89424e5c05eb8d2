"""metav1.Condition lists as the API conventions want them: one entry per type, and
lastTransitionTime moves only when a condition's status changes (not its reason or message).

Conditions travel as their wire dicts (camelCase), the form they have in a status patch.
"""

from collections.abc import Iterable, Mapping
from datetime import UTC, datetime
from typing import Any, Literal

ConditionStatus = Literal["True", "False", "Unknown"]


def now_rfc3339() -> str:
    """Kubernetes' metav1.Time form: second precision, UTC, 'Z'."""
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def condition(type_: str, status: bool | ConditionStatus, reason: str, message: str = "") -> dict[str, Any]:
    """A condition without its times and generation; `merge` adds those."""
    value = status if isinstance(status, str) else ("True" if status else "False")
    return {"type": type_, "status": value, "reason": reason, "message": message}


def merge(
    previous: Iterable[Mapping[str, Any]] | None,
    wanted: Iterable[Mapping[str, Any]],
    *,
    generation: int,
    now: str,
) -> list[dict[str, Any]]:
    """The wanted conditions in their given order, each stamped with `generation`; a condition whose
    status is unchanged keeps its lastTransitionTime, a new or flipped one gets `now`."""
    before = {c.get("type"): c for c in previous or ()}
    out = []
    for c in wanted:
        old = before.get(c["type"])
        unchanged = old is not None and old.get("status") == c["status"] and old.get("lastTransitionTime")
        out.append(
            {
                **c,
                "lastTransitionTime": old["lastTransitionTime"] if unchanged else now,
                "observedGeneration": generation,
            }
        )
    return out


def find(conditions: Iterable[Mapping[str, Any]] | None, type_: str) -> Mapping[str, Any] | None:
    return next((c for c in conditions or () if c.get("type") == type_), None)

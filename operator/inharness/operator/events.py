"""Kubernetes Events about our objects, posted through our own API client.

kopf's `kopf.info`/`kopf.warn` only work inside kopf's per-object handler tasks; the resync loop
runs outside them, so both post here, the same way. A failed post is logged, never raised: an
event is for people watching, not part of converging.
"""

import logging
import os
import socket
from collections.abc import Mapping
from typing import Any

from inharness.operator.conditions import now_rfc3339
from inharness.operator.kube import EVENTS, KubeClient, KubeError

log = logging.getLogger("inharness.operator.events")

COMPONENT = "inharness-operator"


class EventRecorder:
    def __init__(self, kube: KubeClient, instance: str | None = None) -> None:
        self.kube = kube
        self.instance = instance or os.environ.get("POD_NAME") or socket.gethostname()

    async def info(self, obj: Mapping[str, Any], reason: str, message: str) -> None:
        await self.post(obj, "Normal", reason, message)

    async def warn(self, obj: Mapping[str, Any], reason: str, message: str) -> None:
        await self.post(obj, "Warning", reason, message)

    async def post(self, obj: Mapping[str, Any], type_: str, reason: str, message: str) -> None:
        meta = obj.get("metadata") or {}
        namespace = meta.get("namespace") or "default"
        now = now_rfc3339()
        event = {
            "apiVersion": "v1",
            "kind": "Event",
            "metadata": {"generateName": f"{meta.get('name', 'object')}.", "namespace": namespace},
            "involvedObject": {
                "apiVersion": obj.get("apiVersion"),
                "kind": obj.get("kind"),
                "name": meta.get("name"),
                "namespace": namespace,
                "uid": meta.get("uid"),
            },
            "type": type_,
            "reason": reason,
            "message": message[:1024],
            "source": {"component": COMPONENT},
            "reportingComponent": COMPONENT,
            "reportingInstance": self.instance,
            "action": "Reconcile",
            "firstTimestamp": now,
            "lastTimestamp": now,
            "count": 1,
        }
        try:
            await self.kube.create(EVENTS, event, namespace)
        except KubeError as exc:
            log.warning("event %s/%s on %s not posted: %s", type_, reason, meta.get("name"), exc)

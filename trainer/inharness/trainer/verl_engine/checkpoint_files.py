"""A verl checkpoint-engine backend that writes the actor's weights as a Hugging Face model directory.

verl moves weights from its training workers to its inference servers through a checkpoint engine
(NCCL, NIXL, ... between GPUs). inharness's CPU inference engine loads a model directory instead
(``POST /v1/inharness/load_weights``), so this backend, registered as ``inharness-files``, turns
``update_weights(global_steps=v)`` into ``<root>/v<v>/``: ``model.safetensors`` (every tensor gathered
to full size, written by rank 0), and the config, generation config and tokenizer of the base model.
The directory is written under a temporary name and renamed, so a reader never sees half of it.
"""

from __future__ import annotations

import shutil
from collections.abc import AsyncGenerator, Generator
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from verl.checkpoint_engine.base import CheckpointEngine, CheckpointEngineRegistry

BACKEND = "inharness-files"
_MODEL_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin")


def version_dir(root: str | Path, version: int) -> Path:
    return Path(root) / f"v{version}"


@CheckpointEngineRegistry.register(BACKEND)
class FileCheckpointEngine(CheckpointEngine):
    """``root``: where versions go; ``model_dir``: the base model, whose config and tokenizer each
    version carries; ``dtype``: the dtype weights are written in (the trainer's is float32)."""

    def __init__(
        self, *, is_master: bool, bucket_size: int, root: str, model_dir: str, dtype: str = "float32"
    ) -> None:
        self.is_master = is_master
        self.root = Path(root)
        self.model_dir = Path(model_dir)
        self.dtype = getattr(torch, dtype)

    def prepare(self) -> dict[str, Any]:
        return {}

    @classmethod
    def build_topology(cls, actor_wg_world_size: int, rollout_world_size: int, metadata: list[dict]) -> Any:
        return {}, {}

    def init_process_group(self, **kwargs: Any) -> None:
        return None

    def finalize(self) -> None:
        return None

    async def send_weights(
        self, weights: Generator[tuple[str, torch.Tensor], None, None], global_steps: int | None = None
    ) -> dict[str, float]:
        """Every rank walks the generator (gathering a sharded tensor is a collective); rank 0 keeps
        the full tensors and writes them."""
        if global_steps is None:
            raise ValueError(f"{BACKEND} needs global_steps: the version to write")
        tensors: dict[str, torch.Tensor] = {}
        for name, tensor in weights:
            if self.is_master:
                tensors[name] = tensor.detach().to("cpu", self.dtype).contiguous()
        if not self.is_master:
            return {}
        target = version_dir(self.root, global_steps)
        tmp = target.with_name(target.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        for item in self.model_dir.iterdir():
            if item.is_file() and item.name not in _MODEL_FILES and not item.name.endswith(".safetensors"):
                shutil.copy2(item, tmp / item.name)
        save_file(_untied(tensors), tmp / "model.safetensors", metadata={"format": "pt"})
        shutil.rmtree(target, ignore_errors=True)
        tmp.rename(target)
        return {"weights_bytes": float(sum(t.numel() * t.element_size() for t in tensors.values()))}

    async def receive_weights(self, global_steps: int | None = None) -> AsyncGenerator[Any, None]:
        raise NotImplementedError(f"{BACKEND} only writes; the engine loads the directory itself")
        yield  # an async generator, as the interface declares


def _untied(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """safetensors refuses tensors that share memory (tied embeddings): give each its own copy."""
    seen: set[int] = set()
    out = {}
    for name, t in tensors.items():
        ptr = t.untyped_storage().data_ptr()
        out[name] = t.clone() if ptr in seen else t
        seen.add(ptr)
    return out

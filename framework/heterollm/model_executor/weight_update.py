"""New weights for a running engine (`--dynamic_load_weight`): where they come from (a folder or a
.safetensors file on this host, or a safetensors payload sent over HTTP) and reading them as
(Hugging Face name, tensor) pairs, the names the models' `load_weights` takes."""
from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch


class WeightUpdateError(ValueError):
    """New weights that cannot be read or do not fit the model; `field` names what is wrong."""

    def __init__(self, field_name: str, message: str) -> None:
        self.field = field_name
        super().__init__(message)


@dataclass(frozen=True)
class WeightUpdate:
    """Exactly one of `path` (a folder of *.safetensors, or one file) and `payload` (a safetensors
    file's bytes). Every tensor it holds replaces the parameter of that name; parameters it does not
    name keep their values (a payload may carry only the layers that changed)."""

    path: str | None = None
    payload: bytes | None = None

    def __post_init__(self) -> None:
        if (self.path is None) == (self.payload is None):
            raise WeightUpdateError("path", "give exactly one of a path (a folder or a .safetensors file) and a "
                                            "safetensors payload")

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        from safetensors import SafetensorError
        from safetensors.torch import load

        if self.payload is not None:
            try:
                yield from load(self.payload).items()
            except (SafetensorError, ValueError) as exc:
                raise WeightUpdateError("body", f"the payload is not a safetensors file: {exc}") from None
            return
        for file in self._files():
            yield from _read(file)

    def _files(self) -> list[Path]:
        path = Path(self.path).expanduser()
        if path.is_file():
            return [path]
        files = sorted(path.glob("*.safetensors")) if path.is_dir() else []
        if not files:
            raise WeightUpdateError("path", f"{path} is neither a .safetensors file nor a folder holding some")
        return files


def _read(file: Path) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(file), framework="pt") as fh:
            for name in fh.keys():
                yield name, fh.get_tensor(name)
    except (SafetensorError, OSError, RuntimeError) as exc:
        raise WeightUpdateError("path", f"cannot read {file}: {exc}") from None

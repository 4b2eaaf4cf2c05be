"""What every pluggable component class declares."""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from heterollm.config import HeterollmConfig


class Component(ABC):
    """Base of attention backends, graph runners, communicators and executors.

    Which platforms a component serves is its backend descriptor's business (`Backend.runs_on`),
    not the class's: one class may serve several backends.
    """

    @classmethod
    @abstractmethod
    def validate(cls, config: HeterollmConfig) -> list[str]:
        """Reasons this component cannot serve `config` (empty: it can). Called once at launch."""

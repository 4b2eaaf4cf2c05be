"""What every pluggable component class declares."""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, ClassVar

if TYPE_CHECKING:
    from heterollm.config import HeterollmConfig


class Component(ABC):
    """Base of attention backends, graph runners, communicators and executors.

    `platforms` names the platforms (Platform.name) the class can run on; resolution only
    picks a component for a platform it lists.
    """

    platforms: ClassVar[tuple[str, ...]] = ()

    @classmethod
    @abstractmethod
    def validate(cls, config: HeterollmConfig) -> list[str]:
        """Reasons this component cannot serve `config` (empty: it can). Called once at launch."""

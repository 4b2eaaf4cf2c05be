"""The composed configuration and the index from every flag spelling to its field."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, Field
from pydantic.fields import FieldInfo

from heterollm.config.base import FlagGroup, flag_aliases
from heterollm.config.cache import KVCacheConfig, KVCacheStoreConfig, VmmConfig
from heterollm.config.execution import DiTConfig, ExecutionConfig, NPUConfig
from heterollm.config.fastdeploy import DeviceConfig, FastDeployConfig
from heterollm.config.parallel import DistributedConfig, EplbConfig, ParallelConfig, PDDisaggConfig
from heterollm.config.scheduling import ProfileConfig, SchedulerConfig, SpeculativeConfig
from heterollm.config.serving import ConfigJsonUtilsConfig, ModelConfig, ServerConfig


class HeterollmConfig(BaseModel):
    """Every launch flag, one attribute per flag group (`config.kv_cache.block_size`)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    json_utils: ConfigJsonUtilsConfig = Field(default_factory=ConfigJsonUtilsConfig)
    server: ServerConfig = Field(default_factory=ServerConfig)
    model: ModelConfig = Field(default_factory=ModelConfig)
    vmm: VmmConfig = Field(default_factory=VmmConfig)
    kv_cache: KVCacheConfig = Field(default_factory=KVCacheConfig)
    kv_cache_store: KVCacheStoreConfig = Field(default_factory=KVCacheStoreConfig)
    scheduler: SchedulerConfig = Field(default_factory=SchedulerConfig)
    parallel: ParallelConfig = Field(default_factory=ParallelConfig)
    eplb: EplbConfig = Field(default_factory=EplbConfig)
    distributed: DistributedConfig = Field(default_factory=DistributedConfig)
    pd: PDDisaggConfig = Field(default_factory=PDDisaggConfig)
    speculative: SpeculativeConfig = Field(default_factory=SpeculativeConfig)
    profile: ProfileConfig = Field(default_factory=ProfileConfig)
    execution: ExecutionConfig = Field(default_factory=ExecutionConfig)
    npu: NPUConfig = Field(default_factory=NPUConfig)
    dit: DiTConfig = Field(default_factory=DiTConfig)
    fastdeploy: FastDeployConfig = Field(default_factory=FastDeployConfig)
    device: DeviceConfig = Field(default_factory=DeviceConfig)

    def flat(self) -> dict[str, Any]:
        """All flags as one {flag: value} mapping (the JSON dump format)."""
        out: dict[str, Any] = {}
        for group_name in type(self).model_fields:
            out.update(getattr(self, group_name).model_dump(mode="json"))
        return out


@dataclass(frozen=True)
class FlagSpec:
    """Where one flag lives and what it is."""

    name: str
    group: str
    group_cls: type[FlagGroup]
    field: FieldInfo

    @property
    def is_bool(self) -> bool:
        return self.field.annotation is bool

    @property
    def default(self) -> Any:
        return self.field.get_default(call_default_factory=True)


def build_index(groups: dict[str, type[FlagGroup]]) -> tuple[dict[str, FlagSpec], dict[str, str]]:
    """Map flag names to specs, and every alias spelling to its canonical flag name."""
    specs: dict[str, FlagSpec] = {}
    aliases: dict[str, str] = {}
    for group_name, cls in groups.items():
        for name, info in cls.model_fields.items():
            if name in specs:
                raise RuntimeError(f"flag {name!r} declared in both {specs[name].group} and {group_name}")
            specs[name] = FlagSpec(name, group_name, cls, info)
            for alias in flag_aliases(info):
                aliases[alias] = name
    return specs, aliases


CONFIG_GROUPS: dict[str, type[FlagGroup]] = {
    name: info.annotation for name, info in HeterollmConfig.model_fields.items()
}
FLAG_SPECS, FLAG_ALIASES = build_index(CONFIG_GROUPS)

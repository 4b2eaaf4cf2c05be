"""The composed configuration: the core's flag groups plus those of the installed backends, and the
index from every flag spelling to its field.

The core's groups are fields of `HeterollmConfig`. Each installed backend descriptor may add groups
of its own (`Backend.flags`); `current_schema()` composes them into one pydantic model, a subclass
of HeterollmConfig, so `config.npu.enable_fused_mc2` exists exactly when heterollm-npu is installed.
The core keeps only `FOREIGN_FLAGS`, the names of the flags our own device wheels own, so that
setting one without its wheel fails naming the distribution to install.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, create_model
from pydantic.fields import FieldInfo

from heterollm.config.base import FlagGroup, flag_aliases
from heterollm.config.cache import KVCacheConfig, KVCacheStoreConfig
from heterollm.config.execution import DiTConfig, ExecutionConfig
from heterollm.config.fastdeploy import DeviceConfig, FastDeployConfig
from heterollm.config.parallel import DistributedConfig, EplbConfig, ParallelConfig, PDDisaggConfig
from heterollm.config.scheduling import ProfileConfig, SchedulerConfig, SpeculativeConfig
from heterollm.config.serving import ConfigJsonUtilsConfig, ModelConfig, ServerConfig


class HeterollmConfig(BaseModel):
    """Every launch flag, one attribute per flag group (`config.kv_cache.block_size`). The class
    in use is `current_schema().model`, which adds the installed backends' groups."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    json_utils: ConfigJsonUtilsConfig = Field(default_factory=ConfigJsonUtilsConfig)
    server: ServerConfig = Field(default_factory=ServerConfig)
    model: ModelConfig = Field(default_factory=ModelConfig)
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
    dit: DiTConfig = Field(default_factory=DiTConfig)
    fastdeploy: FastDeployConfig = Field(default_factory=FastDeployConfig)
    device: DeviceConfig = Field(default_factory=DeviceConfig)

    def flat(self) -> dict[str, Any]:
        """All flags as one {flag: value} mapping (the JSON dump format)."""
        out: dict[str, Any] = {}
        for group_name in type(self).model_fields:
            out.update(getattr(self, group_name).model_dump(mode="json"))
        return out

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        # the composed class is made at run time: a worker process rebuilds it from its own
        # (identical) installed backends
        return (_rebuild, (self.model_dump(mode="json"),))


def _rebuild(data: dict[str, Any]) -> HeterollmConfig:
    return current_schema().model.model_validate(data)


CORE_GROUPS: dict[str, type[FlagGroup]] = {
    name: info.annotation for name, info in HeterollmConfig.model_fields.items()
}

FOREIGN_FLAGS: dict[str, str] = {
    **dict.fromkeys(
        "enable_vmm_weights enable_rolling_load rolling_load_num_cached_layers rolling_load_num_rolling_slots "
        "enable_vmm_kvcache enable_shared_kv_cache vmm_elastic vmm_memory_reserve_bytes vmm_startup_timeout_ms "
        "npu_kernel_backend enable_fused_mc2 enable_dspark_native_sas communication_backend "
        "enable_multi_stream_parallel micro_batch_num rank_tablefile enable_graph_double_buffer "
        "acl_graph_decode_batch_size_limit block_draft_graph_warmup_max_kv_len".split(), "heterollm-npu"),
    **dict.fromkeys("enable_prefill_piecewise_graph enable_graph_vmm_pool flashinfer_workspace_buffer_size "
                    "enable_custom_all_reduce".split(), "heterollm-cuda"),
}
"""Flags of the published tables that live in our own device wheels -> the distribution that owns
them. Only consulted for a flag no installed group declares."""


@dataclass(frozen=True)
class FlagSpec:
    """Where one flag lives and what it is."""

    name: str
    group: str
    group_cls: type[FlagGroup]
    field: FieldInfo
    owner: str = ""
    """The distribution whose backend declares the flag; "" for the core's flags."""
    backend: str = ""
    """That backend's name (Backend.name); "" for the core's flags."""

    @property
    def is_bool(self) -> bool:
        return self.field.annotation is bool

    @property
    def default(self) -> Any:
        return self.field.get_default(call_default_factory=True)


@dataclass(frozen=True)
class BackendGroup:
    """A flag group an installed backend adds."""

    cls: type[FlagGroup]
    owner: str
    """Its distribution."""
    backend: str
    """Its Backend.name."""


def build_index(groups: Mapping[str, type[FlagGroup]],
                owners: Mapping[str, BackendGroup] | None = None) -> tuple[dict[str, FlagSpec], dict[str, str]]:
    """Map flag names to specs, and every alias spelling to its canonical flag name."""
    specs: dict[str, FlagSpec] = {}
    aliases: dict[str, str] = {}
    for group_name, cls in groups.items():
        owner = (owners or {}).get(group_name)
        for name, info in cls.model_fields.items():
            if name in specs:
                raise RuntimeError(f"flag {name!r} declared in both {specs[name].group} and {group_name}")
            specs[name] = FlagSpec(name, group_name, cls, info, owner.owner if owner else "",
                                   owner.backend if owner else "")
            for alias in flag_aliases(info):
                aliases[alias] = name
    return specs, aliases


@dataclass(frozen=True)
class ConfigSchema:
    """The config class and flag index for one set of installed backends."""

    model: type[HeterollmConfig]
    groups: dict[str, type[FlagGroup]]
    specs: dict[str, FlagSpec]
    aliases: dict[str, str]
    problems: tuple[str, ...] = ()
    """Backend groups that could not join (a clash with a core flag or another backend's), one line each."""


def build_schema(backend_groups: Mapping[str, BackendGroup]) -> ConfigSchema:
    """Compose the core's groups with `backend_groups` (config attribute -> group). A backend group
    whose attribute or flags clash with what is already there is left out and reported."""
    groups: dict[str, type[FlagGroup]] = dict(CORE_GROUPS)
    owners: dict[str, BackendGroup] = {}
    problems = []
    for attr, bg in backend_groups.items():
        taken = build_index(groups, owners)[0]
        clash = [n for n in bg.cls.model_fields if n in taken]
        if attr in groups or clash:
            what = f"flags {', '.join(clash)} are" if clash else f"group name {attr!r} is"
            problems.append(f"flag group {attr!r} of {bg.owner} is ignored: its {what} already declared")
            continue
        groups[attr] = bg.cls
        owners[attr] = bg
    extra = {attr: (bg.cls, Field(default_factory=bg.cls)) for attr, bg in owners.items()}
    model = create_model("HeterollmConfig", __base__=HeterollmConfig, __module__=__name__, **extra) if extra \
        else HeterollmConfig
    specs, aliases = build_index(groups, owners)
    return ConfigSchema(model, groups, specs, aliases, tuple(problems))


_SCHEMA: ConfigSchema | None = None


def current_schema(refresh: bool = False) -> ConfigSchema:
    """The schema of the installed backends (their descriptors are read through the plugin
    registry, once per process; `refresh` re-reads them)."""
    global _SCHEMA
    if _SCHEMA is None or refresh:
        from heterollm.plugins.registry import get_registry  # the registry reads the installed wheels

        _SCHEMA = build_schema(schema_groups(get_registry(refresh=refresh)))
    return _SCHEMA


def schema_groups(registry: Any) -> dict[str, BackendGroup]:
    """The flag groups of a plugin registry's healthy backends."""
    return {attr: BackendGroup(cls, b.dist, b.name)
            for b in registry.backends if b.error is None for attr, cls in b.flag_groups.items()}


def __getattr__(name: str) -> Any:
    """`FLAG_SPECS`, `FLAG_ALIASES` and `CONFIG_GROUPS` of the installed backends' schema."""
    if name == "FLAG_SPECS":
        return current_schema().specs
    if name == "FLAG_ALIASES":
        return current_schema().aliases
    if name == "CONFIG_GROUPS":
        return current_schema().groups
    raise AttributeError(name)

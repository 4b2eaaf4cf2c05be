"""The `heterollm` command: serve, route, generate, backends, models, config.

Every config or launch error is one line on stderr, `heterollm: error: ...`, and exit code 2;
never a traceback.
"""
from __future__ import annotations

import json
import logging
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from heterollm.config import ConfigError, LoadedConfig, dump_config, load_config
from heterollm.config.base import FlagGroup
from heterollm.config.loader import FlagTable
from heterollm.entrypoints.generate import GenerateFlags
from heterollm.entrypoints.route import RouteFlags
from heterollm.entrypoints.serve import ServeFlags

EXIT_USAGE = 2


@dataclass
class Command:
    help: str
    run: Callable[[LoadedConfig], int]
    extra_groups: dict[str, type[FlagGroup]] = field(default_factory=dict)
    needs_model: bool = True
    takes_flags: bool = True


def _fail(message: str) -> int:
    print(f"heterollm: error: {message}", file=sys.stderr)
    return EXIT_USAGE


def _configure_logging(level: str = "INFO") -> None:
    logging.basicConfig(level=getattr(logging, level, logging.INFO), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def _cmd_config(loaded: LoadedConfig) -> int:
    """The effective config with each value's source, after the same platform, component and flag
    checks a launch runs (a LaunchError exits 2 like `serve` would)."""
    from heterollm.plugins import resolve

    selection = resolve(loaded.config)
    out = {"config": loaded.describe(), "selection": selection.as_dict()}
    print(json.dumps(out, indent=2, ensure_ascii=False))
    return 0


def _cmd_backends(_: LoadedConfig | None) -> int:
    from heterollm.entrypoints.backends import print_backends
    return print_backends()


def _cmd_models(_: LoadedConfig | None) -> int:
    from heterollm.entrypoints.backends import print_models
    return print_models()


def _worker_node(loaded: LoadedConfig) -> bool:
    """A node other than 0 of a multi-node job runs only its tensor-parallel ranks."""
    return loaded.config.distributed.node_rank > 0


def _cmd_serve(loaded: LoadedConfig) -> int:
    from heterollm.distributed.executor import run_node_workers
    from heterollm.entrypoints.serve import run_serve
    _configure_logging()
    return run_node_workers(loaded.config) if _worker_node(loaded) else run_serve(loaded)


def _cmd_route(loaded: LoadedConfig) -> int:
    from heterollm.entrypoints.route import run_route
    _configure_logging()
    return run_route(loaded)


def _cmd_generate(loaded: LoadedConfig) -> int:
    from heterollm.distributed.executor import run_node_workers
    from heterollm.entrypoints.generate import run_generate
    _configure_logging()
    return run_node_workers(loaded.config) if _worker_node(loaded) else run_generate(loaded)


COMMANDS: dict[str, Command] = {
    "serve": Command("run the OpenAI-compatible HTTP server", _cmd_serve, extra_groups={"serve": ServeFlags}),
    "route": Command("route OpenAI requests to the least-loaded registered instance (etcd, HTTP or --instances), "
                     "through a PREFILL then a DECODE instance when there are both",
                     _cmd_route, extra_groups={"route": RouteFlags}, needs_model=False),
    "generate": Command("generate text for a prompt, offline, streaming to the terminal", _cmd_generate,
                        extra_groups={"generate": GenerateFlags}),
    "backends": Command("list discovered platforms and components, with origin and usability", _cmd_backends,
                        needs_model=False, takes_flags=False),
    "models": Command("list registered model architectures, with family and origin", _cmd_models,
                      needs_model=False, takes_flags=False),
    "config": Command("print the effective config as JSON, with each value's source", _cmd_config),
}


def usage() -> str:
    lines = ["usage: heterollm <command> --model MODEL [--flag=value ...]", "", "commands:"]
    lines += [f"  {name:<10} {cmd.help}" for name, cmd in COMMANDS.items()]
    lines += ["", "Flags follow xLLM (gflags style; FastDeploy spellings are aliases). Only --model is required.",
              "Precedence: command line > --config_json_file > defaults. Full reference: docs/flags.md"]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(usage())
        return 0 if argv else EXIT_USAGE
    name, rest = argv[0], argv[1:]
    command = COMMANDS.get(name)
    if command is None:
        return _fail(f"unknown command {name!r}; commands: {', '.join(COMMANDS)}")
    if any(a in ("-h", "--help") for a in rest):
        print(usage())
        return 0
    from heterollm.plugins import LaunchError
    try:
        if not command.takes_flags:
            if rest:
                return _fail(f"`heterollm {name}` takes no flags, got {rest[0]!r}")
            return command.run(None)
        loaded = load_config(rest, table=FlagTable(command.extra_groups))
        if command.needs_model and not loaded.config.model.model:
            return _fail("--model is required (a model folder, a GGUF file, or the alias `smollm2`)")
        if loaded.config.json_utils.enable_dump_config_json:
            path = dump_config(loaded.config, loaded.config.json_utils.dump_config_json_file)
            print(f"heterollm: wrote effective config to {path}", file=sys.stderr)
        return command.run(loaded)
    except (ConfigError, LaunchError) as exc:
        return _fail(str(exc))
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())

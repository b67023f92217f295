"""What the root command hands to every subcommand: lazily loaded config and store."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer

from slurmft.config import Config, load_config

if TYPE_CHECKING:
    # The store (SQLAlchemy, Alembic) is loaded by the commands that use it, not by every
    # `slurmft` start: `slurmft --version` and the node agent never touch it.
    from slurmft.db import Database


@dataclass
class CliState:
    config_file: Path | None = None
    overrides: list[str] = field(default_factory=list)
    _config: Config | None = None

    @property
    def config(self) -> Config:
        if self._config is None:
            self._config = load_config(config_file=self.config_file, overrides=self.overrides)
        return self._config

    def database(self) -> Database:
        from slurmft.db import Database

        return Database.from_config(self.config)


def state(ctx: typer.Context) -> CliState:
    obj = ctx.find_root().obj
    if not isinstance(obj, CliState):  # a subcommand app invoked on its own (tests)
        obj = CliState()
        ctx.find_root().obj = obj
    return obj


def echo_json(data: Any) -> None:
    import json  # by the commands that print JSON, not by every `slurmft` start

    typer.echo(json.dumps(data, indent=2, sort_keys=True, default=str))

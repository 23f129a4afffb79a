"""What ``flwr`` is told: the SuperLink connection in ``$FLWR_HOME/config.toml`` and the
``--run-config`` overrides that carry a :class:`~fedhier.settings.run_config.RunConfig` to the
ServerApp.
"""

from __future__ import annotations

import json
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from fedhier.common.errors import ConfigError
from fedhier.engines.deployment.ports import HOST
from fedhier.settings.run_config import RunConfig

#: The name of the SuperLink connection in ``$FLWR_HOME/config.toml`` (``flwr run APP NAME``).
CONNECTION = "fedhier-local"
#: RunConfig fields that never go to the ServerApp (it sets ``engine`` itself).
NOT_PASSED = ("engine",)


def app_config_keys(app: Path) -> dict[str, Any]:
    """``[tool.flwr.app.config]`` of the Flower app at ``app`` (the keys flwr run accepts)."""
    pyproject = app / "pyproject.toml"
    try:
        data = tomllib.loads(pyproject.read_text())
        return dict(data["tool"]["flwr"]["app"]["config"])
    except (OSError, KeyError, tomllib.TOMLDecodeError):
        raise ConfigError(f"{app} is not a Flower app (no [tool.flwr.app.config] in "
                          f"{pyproject}); pass --app with the fedhier source tree") from None


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    return json.dumps(str(value))  # a JSON string is a valid TOML basic string


def run_config_overrides(cfg: RunConfig, app: Path) -> dict[str, Any]:
    """The ``--run-config`` overrides for ``cfg``: every key the app declares.

    A non-default value for a RunConfig key the app does not declare cannot reach the
    ServerApp (Flower rejects unknown keys): that is a ConfigError.
    """
    declared = app_config_keys(app)
    defaults = RunConfig().to_run_config()
    overrides: dict[str, Any] = {}
    for key, value in cfg.to_run_config().items():
        if key in NOT_PASSED:
            continue
        if key == "periods" and len(cfg.periods) == 2:
            value = ""  # two-level: local-period / global-period say it all
        if key == "groups" and "," not in str(value):
            value = int(value)
        if key in declared:
            overrides[key] = value
        elif value != defaults[key] and not (key == "periods" and value == ""):
            raise ConfigError(
                f"--{key} cannot be passed to the Flower app: '{key}' is not declared in "
                f"[tool.flwr.app.config] of {app / 'pyproject.toml'}")
    return overrides


def write_run_config(path: Path, overrides: Mapping[str, Any]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(f"{k} = {_toml_value(v)}\n" for k, v in overrides.items()))
    return path


def connection_toml(name: str, port: int, root_certificates: Path | None) -> str:
    """A ``$FLWR_HOME/config.toml`` with one SuperLink connection (made the default)."""
    lines = ["[superlink]", f'default = "{name}"', "", f"[superlink.{name}]",
             f'address = "{HOST}:{port}"']
    if root_certificates is None:
        lines.append("insecure = true")
    else:
        lines.append(f"root-certificates = {json.dumps(str(root_certificates))}")
    return "\n".join(lines) + "\n"

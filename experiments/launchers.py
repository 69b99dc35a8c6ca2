"""Before a grid starts: is the Hydra launcher it names usable here? A clear error instead of Hydra's.

Owns `check_launcher(overrides)`: the `hydra/launcher=NAME` plugin must import and, for Ray, a cluster must answer;
else `LauncherError` naming what to install or run. Knows nothing about cells or the store.
"""

from __future__ import annotations

import importlib.util
import os
import socket
import sys

PLUGINS = {
    "local": ("hydra_plugins.hydra_submitit_launcher", "submitit", "hydra-submitit-launcher"),
    "slurm": ("hydra_plugins.hydra_submitit_launcher", "submitit", "hydra-submitit-launcher"),
    "submitit_local": ("hydra_plugins.hydra_submitit_launcher", "submitit", "hydra-submitit-launcher"),
    "submitit_slurm": ("hydra_plugins.hydra_submitit_launcher", "submitit", "hydra-submitit-launcher"),
    "ray_cluster": ("hydra_plugins.hydra_ray_launcher", "ray", "hydra-ray-launcher and ray"),
    "ray": ("hydra_plugins.hydra_ray_launcher", "ray", "hydra-ray-launcher and ray"),
    "joblib": ("hydra_plugins.hydra_joblib_launcher", "experiments", "hydra-joblib-launcher"),
}
"""hydra/launcher name -> (plugin module, specdec extra, what the extra installs)."""
DEFAULT_RAY_ADDRESS = "127.0.0.1:6379"
"""Where conf/hydra/launcher/ray_cluster.yaml connects without RAY_ADDRESS or an override."""


class LauncherError(RuntimeError):
    """A launcher that cannot run here, with what to install or start."""


def _installed(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def _override(overrides: list[str], key: str) -> str | None:
    values = [o.split("=", 1)[1] for o in overrides if o.lstrip("+~").split("=", 1)[0] == key and "=" in o]
    return values[-1] if values else None


def check_launcher(overrides: list[str]) -> None:
    """Raise LauncherError if the `hydra/launcher=NAME` among `overrides` cannot run here; None = fine
    (no launcher named: Hydra's basic launcher, always there)."""
    name = _override(overrides, "hydra/launcher")
    if name is None or name == "basic" or name not in PLUGINS:
        return  # Hydra itself names an unknown launcher, with the list of known ones
    module, extra, what = PLUGINS[name]
    if not _installed(module):
        raise LauncherError(f"hydra/launcher={name} needs the {what} plugin, which is not installed: "
                            f"pip install 'specdec[{extra}]'")
    if name in ("ray_cluster", "ray"):
        default = os.environ.get("RAY_ADDRESS", DEFAULT_RAY_ADDRESS if name == "ray_cluster" else None)
        address = _override(overrides, "hydra.launcher.ray.init.address") or default
        if address in (None, "null", "auto", "local"):
            return  # ray.init starts or finds a cluster on this machine itself
        host, _, port = address.removeprefix("ray://").rpartition(":")
        try:
            socket.create_connection((host, int(port)), timeout=3).close()
        except (OSError, ValueError) as err:
            raise LauncherError(
                f"no Ray cluster answers at {address} ({type(err).__name__}: {err}): start one with "
                f"`ray start --head --node-ip-address={host or '127.0.0.1'} --port={port or 6379}` on the head node "
                f"(then `ray start --address={address}` on each worker), or pass "
                f"hydra.launcher.ray.init.address=HEAD_IP:PORT") from None


def main(argv: list[str] | None = None) -> int:
    try:
        check_launcher(sys.argv[1:] if argv is None else argv)
    except LauncherError as err:
        print(f"experiments.launchers: error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The options of `dlenv lab` and `dlenv tensorboard`, declared once (dlenv.options.config registers the commands;
the CLI and the invoke tasks are generated from these classes as from every other).

They live beside config.py because that module is at its size limit. No torch and no Jupyter here:
`dlenv --help` and `invoke --list` import this module.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass
from typing import Any

from dlenv.options.declare import opt
from dlenv.options.values import parse_str

#: where the servers listen by default: every address inside the image (a container's loopback is its
#: own, so `docker run -p 8888:8888` can reach nothing else), only this machine's loopback elsewhere
HOST_HELP = ("address to listen on: auto is 0.0.0.0 in the dlenv image (reach it with docker run -p) and "
             "127.0.0.1 elsewhere (reach it through an SSH tunnel); or an IP address")


def host_or_auto(v: Any) -> str:
    """'auto' or an IP address ('0.0.0.0', '127.0.0.1', '::'). Raises ValueError with the reason."""
    s = parse_str(v).strip()
    if s == "auto":
        return s
    try:
        return str(ipaddress.ip_address(s))
    except ValueError:
        raise ValueError("expected auto or an IP address such as 0.0.0.0 or 127.0.0.1") from None


@dataclass(frozen=True)
class LabConfig:
    """Options of `lab`."""

    port: int = opt(8888, "port to listen on (publish the same one: docker run -p 8888:8888)", min=1, max=65535)
    host: str = opt("auto", HOST_HELP, parse=host_or_auto)
    root: str = opt(".", "the folder the lab opens (the working folder: /root/workspace in the image)")


@dataclass(frozen=True)
class TensorboardConfig:
    """Options of `tensorboard`."""

    log_dir: str = opt("runs", "folder of runs whose event files TensorBoard serves (train --tensorboard "
                               "writes them)")
    port: int = opt(6006, "port to listen on (publish the same one: docker run -p 6006:6006)", min=1, max=65535)
    host: str = opt("auto", HOST_HELP, parse=host_or_auto)


@dataclass(frozen=True)
class MlflowConfig:
    """Options of `mlflow`."""

    store: str = opt("mlflow.db", "the local store train --mlflow writes (a SQLite file in the working folder)")
    port: int = opt(5000, "port to listen on (publish the same one: docker run -p 5000:5000)", min=1, max=65535)
    host: str = opt("auto", HOST_HELP, parse=host_or_auto)

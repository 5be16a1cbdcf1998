"""Every control message of both planes (afd/engine/messages.py, afd/runtime/messages.py) is a frozen dataclass
that some receiver handles: a ``case`` pattern or an ``isinstance`` names it in afd's code. A message
defined and sent but handled nowhere would reach a receiver's default case (UnhandledMessage) in a run."""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
from pathlib import Path

import pytest

from afd.engine import messages as replica_plane
from afd.runtime import messages as rank_plane

ROOT = Path(__file__).resolve().parent.parent / "afd"
PAYLOADS = {"ReadyReport", "RunnerStats", "NewRequest", "Request"}  # carried inside messages (or a base), never sent alone


def messages(module) -> list[type]:
    return [c for name, c in vars(module).items() if inspect.isclass(c) and dataclasses.is_dataclass(c)
            and c.__module__ == module.__name__ and name not in PAYLOADS]


@functools.cache
def handled_names() -> frozenset[str]:
    """Class names in a ``case`` pattern or an ``isinstance`` call anywhere in afd."""
    names: set[str] = set()
    for path in ROOT.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.MatchClass):
                names.add(ast.unparse(node.cls).split(".")[-1])
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "isinstance" and len(node.args) == 2:
                target = node.args[1]
                for elt in target.elts if isinstance(target, ast.Tuple) else [target]:
                    names.add(ast.unparse(elt).split(".")[-1])
    return frozenset(names)


@pytest.mark.parametrize("cls", messages(replica_plane) + messages(rank_plane), ids=lambda c: c.__name__)
def test_every_message_is_frozen_and_handled(cls):
    assert cls.__dataclass_params__.frozen, f"{cls.__name__} is not frozen"
    assert cls.__name__ in handled_names(), f"no receiver handles {cls.__name__} (no case pattern or isinstance names it)"


def test_the_check_sees_a_message_nobody_handles():
    """Canary: a name only defined is reported as unhandled."""
    assert "NoSuchMessage" not in handled_names() and "StopServing" in handled_names()

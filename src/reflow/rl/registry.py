"""Name -> factory tables of the extension points (scorers, policy objectives, weight transports).

A config names an implementation by a registered name or as `package.module:Name`; the second form
imports the module, so it works in a process that never ran the user's `register_*` call (a flow run
started by a deployment, say). Names are resolved once, on the driver, where the parameter objects are
built; what travels to Ray actors is the built object itself, whose class the actor imports by module.
"""
from __future__ import annotations

import re
from collections.abc import Callable
from typing import Generic, TypeVar

from reflow.rl.rewards import load_callable

F = TypeVar("F", bound=Callable[..., object])

_NAME = re.compile(r"^[A-Za-z_][\w.-]*$")
_SPEC = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_][\w.]*$")


def spec_problem(value: str, field: str, what: str) -> str | None:
    """Why `value` cannot name a `what` (config validation, before anything is imported), or None."""
    if _NAME.match(value) or _SPEC.match(value):
        return None
    return (f"{field}={value!r} names no {what}: give a registered name or 'package.module:Name' "
            f"(e.g. 'my_project.rl:My{what.title().replace(' ', '')}')")


class Registry(Generic[F]):
    """Factories of one extension point by name; `resolve` also takes `package.module:Name`."""

    def __init__(self, what: str, hint: str):
        self.what, self.hint = what, hint  # hint: how a user adds one (named in errors)
        self._table: dict[str, F] = {}

    def register(self, name: str, factory: F) -> F:
        """Make `factory` reachable as `name`; registering another factory under a taken name is an error."""
        if not _NAME.match(name):
            raise ValueError(f"{self.what} name {name!r}: use letters, digits, '_', '.', '-'")
        if self._table.get(name, factory) is not factory:
            raise ValueError(f"a {self.what} named {name!r} is registered already ({self._table[name]!r})")
        self._table[name] = factory
        return factory

    def names(self) -> list[str]:
        return sorted(self._table)

    def __contains__(self, name: object) -> bool:
        return name in self._table

    def resolve(self, value: str, field: str) -> F:
        """The factory registered as `value`, or the object `package.module:Name` names; errors name `field`."""
        if value in self._table:
            return self._table[value]
        if not _SPEC.match(value):
            raise ValueError(f"{field}={value!r} is not a registered {self.what} ({', '.join(self.names())}) nor "
                             f"'package.module:Name': {self.hint}")
        return load_callable(value, field, "a class or function")  # type: ignore[no-any-return]

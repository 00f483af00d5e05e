"""attrs validators that more than one record of the core uses."""

from __future__ import annotations

from typing import Any

import attrs

__all__ = ["int_at_least"]


def int_at_least(floor: int) -> Any:
    """An attrs validator: the field is an ``int`` (not a ``bool``) of at
    least ``floor``, or construction raises ``ValueError`` naming the field,
    the bound and the value."""

    def check(_: object, attribute: attrs.Attribute[int], value: object) -> None:
        # bool is an int subclass, but True as a count is surely a mistake.
        if isinstance(value, bool) or not isinstance(value, int) or value < floor:
            raise ValueError(f"{attribute.name} must be an int >= {floor}, got {value!r}")

    return check

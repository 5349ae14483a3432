"""The options of ``rdma-cni scheduler-extender``, built from the fields of :class:`Settings`, as one.

Each option is declared on its field (:func:`rdma_cni.extender.settings.option`):
its flag, how its value is checked and its help. The parser sets each
field under the field's own name and with the field's default, so a flag
cannot be dropped on its way to the settings, nor its default written twice.
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

from rdma_cni.extender.settings import Settings, flag_of
from rdma_cni.shared.podrequest import parse_request

__all__ = ["parser", "settings"]


def parser(cls: type[Any] = Settings) -> argparse.ArgumentParser:
    """The subcommand's options: one per field of ``cls`` declared with ``option()``.

    Raises TypeError for a field declared with neither ``option()`` nor ``internal()``.
    """
    p = argparse.ArgumentParser(
        prog="rdma-cni scheduler-extender",
        description="kube-scheduler extender placing RDMA pods on nodes whose published state fits them.",
    )
    for field in dataclasses.fields(cls):
        flag = flag_of(field)
        if flag is None:
            continue
        kwargs: dict[str, Any] = {"dest": field.name, "help": flag.help}
        if flag.action == "append":
            # argparse would say None (see below): the field's default, as a list of names.
            kwargs["help"] = flag.help.replace("%(default)s", ",".join(sorted(field.default)) or "none")
        if flag.action is not None:
            kwargs["action"] = flag.action
        if flag.type is not None:
            kwargs["type"] = flag.type
        if flag.choices is not None:
            kwargs["choices"] = flag.choices
        if flag.required:
            kwargs["required"] = True
        # A repeatable flag gathers into a fresh list: the field's default stands when it is not given.
        kwargs["default"] = None if flag.action == "append" else field.default
        name = flag.flag or "--" + field.name.replace("_", "-")
        if flag.action != "store_false" and flag.choices is None:
            kwargs["metavar"] = name[2:].upper().replace("-", "_")  # the flag's name, not the field's
        p.add_argument(name, **kwargs)
    return p


def settings(argv: list[str], cls: type[Any] = Settings) -> Any:
    """The options of ``argv`` as settings (argparse exits with code 2 on a bad one).

    Every option sets the field it is declared on; fields without one keep their default.
    """
    args = parser(cls).parse_args(argv)
    given = {}
    for field in dataclasses.fields(cls):
        flag = flag_of(field)
        if flag is None:
            continue
        value = getattr(args, field.name)
        if flag.collect is not None:
            value = field.default if value is None else flag.collect(value)
        given[field.name] = value
    if given.get("networks") and given.get("default_request", 0) is None:
        # A network selected without a request gets one VF of no rate, as the plugin's default.
        given["default_request"] = parse_request("[{}]", "--default-request")
    return cls(**given)

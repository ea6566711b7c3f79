"""One declaration per setting: a dataclass field and the docstring under it, from which the flag,
its type, default and help, the YAML key and the value checks are all derived (the way Megatron's
`megatron/training/argument_utils.py` `ArgumentGroupFactory` builds flags from a config
dataclass; this is a small equivalent that imports neither torch nor Megatron, and that leaves
every flag's default `None` so a flag overrides the YAML only when it is given).

    @dataclass
    class CaptureSettings(Section):
        page_tokens: int = setting(65536, low=1)
        \"\"\"Rows per page of captured state.

        More for readers of the code: only the first paragraph is the flag's help.\"\"\"

A field's key is its name (or `key=`): the YAML `longstraw:` key, and the flag
`--longstraw-<key with dashes>`. The field's type annotation gives the flag's type and the check
of a YAML value (int, float, bool, str, an `enum.StrEnum`, `X | None`, `tuple[int, ...]`,
`tuple[str, ...]`); `setting(...)` adds what the annotation cannot say: `choices`, `low` (the
smallest value allowed), `metavar`, `const` (the value of the bare flag) and `flag=False` for a
YAML-only key. `Section.__post_init__` checks every field that way, with one message form naming
the key and the flag.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import enum
import functools
import inspect
import math
import textwrap
import types
import typing

FLAG_PREFIX = "--longstraw-"


def setting(default=dataclasses.MISSING, *, key: str | None = None, choices=None, low=None,
            metavar: str | None = None, const=None, flag: bool = True, default_factory=None):
    """A dataclass field declared as a setting (module docstring); `default_factory` for mutable
    defaults."""
    meta = {"key": key, "choices": choices, "low": low, "metavar": metavar, "const": const,
            "flag": flag}
    if default_factory is not None:
        return dataclasses.field(default_factory=default_factory, metadata={"setting": meta})
    return dataclasses.field(default=default, metadata={"setting": meta})


@dataclasses.dataclass(frozen=True)
class Setting:
    """One setting as the flag generator and the checks see it."""

    section: str
    """The section's attribute on the config (`capture`, `loss`, ...)."""
    name: str
    """The field's attribute name in its section."""
    key: str
    """The YAML key (and the flag, with dashes)."""
    kind: type
    """int, float, bool, str, an enum class, or tuple (then `item` is the element type)."""
    optional: bool
    """None is allowed."""
    item: type | None
    default: object
    doc: str
    choices: tuple | None
    low: float | None
    metavar: str | None
    const: object
    flag: bool

    @property
    def option(self) -> str:
        return FLAG_PREFIX + self.key.replace("_", "-")

    @property
    def dest(self) -> str:
        return "longstraw_" + self.key

    @property
    def help(self) -> str:
        """The docstring's first paragraph, on one line (the rest is for readers of the code)."""
        return " ".join(self.doc.split("\n\n")[0].split())

    def where(self) -> str:
        return f"{self.option}, YAML longstraw.{self.key}" if self.flag else \
            f"YAML longstraw.{self.key}"


def field_docstrings(cls: type) -> dict[str, str]:
    """Attribute name -> the string literal right under its annotated assignment in `cls`'s
    body (the convention Megatron's configs and ours follow)."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body
    docs = {}
    for node, after in zip(body, body[1:]):
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
                and isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant)
                and isinstance(after.value.value, str)):
            docs[node.target.id] = inspect.cleandoc(after.value.value)
    return docs


def _kind(annotation) -> tuple[type, bool, type | None]:
    """(kind, optional, item) of a field's resolved annotation."""
    optional = False
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        optional = len(args) < len(typing.get_args(annotation))
        if len(args) != 1:
            raise TypeError(f"a setting has one type (or it or None), got {annotation}")
        annotation = args[0]
    if typing.get_origin(annotation) is tuple:
        item = typing.get_args(annotation)[0]
        return tuple, optional, item
    if annotation in (int, float, bool, str) or (isinstance(annotation, type)
                                                 and issubclass(annotation, enum.Enum)):
        return annotation, optional, None
    raise TypeError(f"unsupported setting type {annotation}")


@functools.cache
def section_settings(cls: type, section: str = "") -> tuple[Setting, ...]:
    """The settings of a section class, in declaration order."""
    hints = typing.get_type_hints(cls)
    docs = field_docstrings(cls)
    out = []
    for f in dataclasses.fields(cls):
        meta = f.metadata.get("setting")
        if meta is None:
            continue
        if f.name not in docs:
            raise TypeError(f"{cls.__name__}.{f.name} has no docstring: a setting says what it "
                            "does under its field")
        kind, optional, item = _kind(hints[f.name])
        choices = meta["choices"]
        if choices is None and isinstance(kind, type) and issubclass(kind, enum.Enum):
            choices = tuple(m.value for m in kind)
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        out.append(Setting(section, f.name, meta["key"] or f.name, kind, optional, item, default,
                           docs[f.name], tuple(choices) if choices is not None else None,
                           meta["low"], meta["metavar"], meta["const"], meta["flag"]))
    return tuple(out)


def _describe(s: Setting) -> str:
    what = {int: "an integer", float: "a number", bool: "true or false", str: "text",
            tuple: f"a list of {'integers' if s.item is int else 'strings'}"}.get(
        s.kind, "one of the choices")
    if s.choices is not None:
        what = f"one of {list(s.choices)}"
    elif s.low is not None:
        what += f" >= {s.low:g}"
    return what + (" or null" if s.optional else "")


def check_value(s: Setting, value):
    """`value` checked (and converted: an enum from its string, a tuple from a list) against `s`;
    ValueError naming the key and the flag otherwise."""
    def bad(hint: str = ""):
        return ValueError(f"longstraw {s.key} must be {_describe(s)}, got {value!r} "
                          f"({s.where()}){hint}.")

    if value is None:
        if s.optional:
            return None
        raise bad()
    if s.kind is tuple:
        if isinstance(value, s.item):   # one id / pattern given as a scalar
            value = (value,)
        if isinstance(value, (str, bytes)) or not isinstance(value, (list, tuple)):
            raise bad()
        if not all(isinstance(v, s.item) and not isinstance(v, bool) for v in value):
            raise bad()
        return tuple(value)
    if s.kind is bool:
        if not isinstance(value, bool):
            raise bad()
        return value
    if s.kind is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise bad()
    elif s.kind is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)) \
                or not math.isfinite(value):
            hint = (" (YAML reads a number without a dot, like 1e-6, as text: write 1.0e-6)"
                    if isinstance(value, str) else "")
            raise bad(hint)
    elif s.kind is str or issubclass(s.kind, enum.Enum):
        if not isinstance(value, str):
            raise bad()
    if s.choices is not None and value not in s.choices:
        raise bad()
    if s.low is not None and value < s.low:
        raise bad()
    return s.kind(value) if isinstance(s.kind, type) and issubclass(s.kind, enum.Enum) else value


class Section:
    """Base of a config section: every setting field is checked (and converted) when the section
    is made."""

    def __post_init__(self) -> None:
        for s in section_settings(type(self)):
            setattr(self, s.name, check_value(s, getattr(self, s.name)))


def add_flags(parser: argparse.ArgumentParser, settings, title: str,
              choices: dict[str, object] | None = None, description: str | None = None):
    """One argument group `title` with a flag per setting (default None: a flag wins over the
    YAML only when given). `choices` replaces a setting's choices for argparse only (the launcher
    passes kernels/select.py's spec-aware list, a wing above this one)."""
    group = parser.add_argument_group(title, description)
    for s in settings:
        if not s.flag:
            continue
        kwargs: dict = {"default": None, "help": s.help.replace("%", "%%"), "dest": s.dest}
        if s.kind is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        else:
            kind = s.item if s.kind is tuple else s.kind
            options = (choices or {}).get(s.key, s.choices)
            if kind in (int, float) or (s.kind is str and options is None):
                kwargs["type"] = kind   # (choices and lists of words take argparse's own text)
            if s.kind is tuple:
                kwargs["nargs"] = "*" if s.item is int else "+"
            if s.const is not None:
                kwargs.update(nargs="?", const=s.const)
            if options is not None:
                kwargs["choices"] = options
            if s.metavar is not None:
                kwargs["metavar"] = s.metavar
        group.add_argument(s.option, **kwargs)
    return group

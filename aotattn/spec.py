"""Declarative descriptions of kernels, shared by every layer.

A family's rules module describes each of its kernels with a :class:`KernelSpec`: where
the Triton source lives, the runtime arguments in the order the compiled kernel takes
them, the compile-time axes (*functionals*) and the tuning space. The operators build a
:class:`LaunchPlan` from a spec; the launcher, the build and the tuner read the same spec.
Nothing here names a family.
"""

from __future__ import annotations

import functools
import itertools
import json
import string
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

# Keys of a configuration that are launch options rather than constexpr arguments.
LAUNCH_OPTIONS = ("num_warps", "num_stages")
# What a kernel's source is written in (KernelSpec.language).
LANGUAGES = ("triton", "gluon")


def _frozen(mapping: Mapping[str, Any]) -> tuple[tuple[str, Any], ...]:
    return tuple(sorted(mapping.items()))


# How a functional is compiled: the divisibility its ``aligned`` integer arguments are
# hinted with (its ``aligned`` pointers are 16-byte aligned in both hinted variants), or
# None for no hints. ``aligned8``: rows of 16 bytes at 16 bits (strides and sizes that are
# multiples of 8 elements), the vector width of Hopper's loads.
VARIANTS: dict[str, int | None] = {"aligned": 16, "aligned8": 8, "generic": None}


@dataclass(frozen=True)
class Arg:
    """One runtime argument of a kernel.

    ``type`` is a Triton signature type; ``{name}`` placeholders are filled from the
    functional (``"*{dtype}"`` becomes ``"*bf16"``). ``aligned``: the kernel's aligned
    variants assume this pointer 16-byte aligned, or this integer divisible by the
    variant's unit (:data:`VARIANTS`; 16 is what Triton's JIT would have specialized on).
    """

    name: str
    type: str
    aligned: bool = False

    def signature(self, functional: Mapping[str, Any]) -> str:
        return self.type.format(**functional)


@dataclass(frozen=True)
class Functional:
    """A full assignment of a kernel's compile-time axes, hashable and ordered."""

    items: tuple[tuple[str, Any], ...]

    @classmethod
    def of(cls, mapping: Mapping[str, Any]) -> "Functional":
        return cls(_frozen(mapping))

    def as_dict(self) -> dict[str, Any]:
        return dict(self.items)

    def __getitem__(self, key: str) -> Any:
        for k, v in self.items:
            if k == key:
                return v
        raise KeyError(key)

    def __str__(self) -> str:
        return ",".join(f"{k}={v}" for k, v in self.items)

    def matches(self, where: str | Mapping[str, str] | None, defaults: Iterable[tuple[str, Any]] = ()) -> bool:
        """Whether every axis ``where`` names that this functional has holds that value.

        ``where``: ``"dtype=bf16 BLOCK_D=128"``, or its :func:`parse_where` mapping (which
        callers build first, to refuse axes and values no kernel has). ``defaults``: the
        table's ``axis_defaults``, the values of the axes a functional leaves out.
        """
        if not where:
            return True
        wanted = where if not isinstance(where, str) else dict(t.partition("=")[::2] for t in where.split())
        values = {**{k: str(v) for k, v in defaults}, **{k: str(v) for k, v in self.items}}
        return all(values[axis] == value for axis, value in wanted.items() if axis in values)


def parse_where(where: str | None, tables: Sequence["_Table"]) -> dict[str, str]:
    """A ``--where`` filter (``"dtype=bf16 BLOCK_D=128"``) checked against the axes of
    ``tables``: each axis must be an axis of one of them and each value one of its choices.
    An axis that some of the tables lack does not filter those (see :meth:`Functional.matches`).

    Raises ValueError naming what is wrong and the valid axes or values.
    """
    choices: dict[str, list[str]] = {}
    for table in tables:
        for axis, values in table.functionals:
            known = choices.setdefault(axis, [])
            known += [str(v) for v in values if str(v) not in known]
    names = ", ".join(t.qualname for t in tables)
    parsed: dict[str, str] = {}
    for token in (where or "").split():
        axis, eq, value = token.partition("=")
        if not eq or not axis or not value:
            raise ValueError(f"--where: expected axis=value, got {token!r} (e.g. \"dtype=bf16 BLOCK_D=128\")")
        if axis not in choices:
            raise ValueError(f"--where: {names} has no axis {axis!r} (axes: {', '.join(choices) or 'none'})")
        if value not in choices[axis]:
            raise ValueError(f"--where: {axis}={value} is not a choice ({axis}: {', '.join(choices[axis])})")
        if axis in parsed:
            raise ValueError(f"--where: axis {axis} given twice")
        parsed[axis] = value
    return parsed


@dataclass(frozen=True)
class Config:
    """One tuned configuration: constexpr knobs (block sizes, ...) plus launch options.

    Operator-level tables hold other choices (``backend=split``) in the same form.
    """

    items: tuple[tuple[str, Any], ...]

    @classmethod
    def of(cls, mapping: Mapping[str, Any] | None = None, **kwargs: Any) -> "Config":
        merged = dict(mapping or {}, **kwargs)
        return cls(_frozen(merged))

    def as_dict(self) -> dict[str, Any]:
        return dict(self.items)

    def __getitem__(self, key: str) -> Any:
        for k, v in self.items:
            if k == key:
                return v
        raise KeyError(key)

    @property
    def constexprs(self) -> dict[str, int]:
        return {k: v for k, v in self.items if k not in LAUNCH_OPTIONS}

    @property
    def num_warps(self) -> int:
        return self.as_dict().get("num_warps", 4)

    @property
    def num_stages(self) -> int:
        return self.as_dict().get("num_stages", 2)

    def __str__(self) -> str:
        return ",".join(f"{k}={v}" for k, v in self.items)


class _Table:
    """What every spec with a tuning table has: a name, functionals to enumerate and check."""

    family: str
    name: str
    functionals: tuple[tuple[str, tuple[Any, ...]], ...]
    disabled: Callable[[Mapping[str, Any]], bool] | None
    knob_defaults: tuple[tuple[str, Any], ...]
    # axes a functional leaves out at this value (:meth:`canonical_functional`): an axis
    # added later keeps every file, recorded cell and caller's functional valid
    axis_defaults: tuple[tuple[str, Any], ...] = ()

    def canonical(self, config: Config) -> Config:
        """``config`` without the knobs that are at their default (``knob_defaults``: knobs
        a configuration may leave out, see :class:`KernelSpec`)."""
        defaults = dict(self.knob_defaults)
        if not any(k in defaults and defaults[k] == v for k, v in config.items):
            return config
        return Config(tuple((k, v) for k, v in config.items if not (k in defaults and defaults[k] == v)))

    def canonical_functional(self, functional: Mapping[str, Any] | Functional) -> Functional:
        """``functional`` without the axes at their ``axis_defaults`` value: the form the
        database's blocks, headers and cell names use, so that an axis added to a table
        later leaves every existing functional (and file) as it was."""
        values = functional.as_dict() if isinstance(functional, Functional) else dict(functional)
        for axis, default in self.axis_defaults:
            if axis in values and values[axis] == default:
                del values[axis]
        return Functional.of(values)

    @property
    def qualname(self) -> str:
        return f"{self.family}.{self.name}"

    def runs_on(self, arch: str) -> bool:
        """Whether this table applies on ``arch``: a kernel limited to some architectures
        (``KernelSpec.archs``, a Gluon kernel's) has no table and no image elsewhere."""
        archs = getattr(self, "archs", None)
        return archs is None or arch in archs

    @property
    def axes(self) -> tuple[str, ...]:
        return tuple(name for name, _ in self.functionals)

    def check_functional(self, functional: Mapping[str, Any]) -> None:
        choices = dict(self.functionals)
        functional = {**dict(self.axis_defaults), **functional}
        if set(functional) != set(choices):
            raise ValueError(f"{self.qualname}: functional axes {sorted(functional)} != {sorted(choices)}")
        for axis, value in functional.items():  # of the choice's type: 0 is not False, nor 1 True
            if not any(value == c and type(value) is type(c) for c in choices[axis]):
                raise ValueError(f"{self.qualname}: {axis}={value!r} is not one of {choices[axis]}")
        if self.disabled is not None and self.disabled(functional):
            raise ValueError(f"{self.qualname}: functional {dict(functional)} is disabled")

    def enumerate_functionals(self) -> Iterator[Functional]:
        names = self.axes
        for values in itertools.product(*(choices for _, choices in self.functionals)):
            f = dict(zip(names, values))
            if self.disabled is None or not self.disabled(f):
                yield self.canonical_functional(f)


@dataclass(frozen=True)
class ChosenBy:
    """A kernel that runs only where an operator table chooses it (a backward backend's
    kernels): the build compiles its configurations only in the cells where the operator
    table ``operator`` says ``knob=value`` for one of ``functionals(kernel functional)``.
    Both tables are keyed alike."""

    operator: str  # the operator table's qualname
    knob: str
    value: Any
    functionals: Callable[[Mapping[str, Any]], list[dict[str, Any]]] = field(compare=False)


@dataclass(frozen=True)
class KernelSpec(_Table):
    """Everything the build, the runtime and the tuner need to know about one kernel.

    Attributes:
        family: the kernel family (a directory under ``aotattn/families``).
        name: the kernel's name inside its family.
        module: dotted path of the module holding the ``@triton.jit`` function.
        function: the function's name in that module.
        arguments: runtime (non-constexpr) arguments, in order.
        functionals: compile-time axes and their choices, in order.
        tuning_space: tuning knobs (constexprs, ``num_warps``, ``num_stages``) and choices.
        derive: values computed from a functional (the dot precision from the dtype, an
            argument's element type); constexprs unless an argument type names them.
        disabled: a predicate on a functional that is never built (an impossible or
            unsupported combination).
        tuning_keys: the run-time sizes a tuning table is indexed by, with their buckets
            (at most two: table rows, then columns).
        fallback: the functional to look up when a table has no block for this one (for
            example a padded-head functional's unpadded twin), or None.
        variant_of: the :data:`VARIANTS` name each functional is built as (alignment
            hints on the ``aligned`` arguments); the operators run a hinted functional only
            for inputs that satisfy its hints. None: every functional is built generic.
        chosen_by: the operator table whose choice runs this kernel (:class:`ChosenBy`);
            the build compiles it only where that choice is made. None: wherever its
            own table says.
        knob_defaults: knobs of the tuning space a configuration may leave out (added
            after tables were written), with the value a configuration without them
            means. A configuration is kept in its canonical form (:meth:`canonical`): a
            knob at its default is left out, so tables, image keys and names of the
            configurations written before the knob existed stay what they were.
        axis_defaults: functional axes added after tables were written, with the value a
            functional without them means (:meth:`canonical_functional`); the kernel
            still receives them as constexprs.
        table_axes: functional axes that key the tuning table and nothing else: a class of
            calls whose best configuration differs while the kernel's code does not (the
            ws backward's wide key/value groups). The kernel does not receive them, and
            one image serves every value (:meth:`compiled_functional`). Each has an
            ``axis_defaults`` entry, the value a compiled functional stands for.
    """

    family: str
    name: str
    module: str
    function: str
    arguments: tuple[Arg, ...]
    functionals: tuple[tuple[str, tuple[Any, ...]], ...]
    tuning_space: tuple[tuple[str, tuple[int, ...]], ...]
    derive: Callable[[Mapping[str, Any]], dict[str, Any]] | None = field(default=None, compare=False)
    disabled: Callable[[Mapping[str, Any]], bool] | None = field(default=None, compare=False)
    tuning_keys: tuple[tuple[str, tuple[int, ...]], ...] = ()
    fallback: Callable[[Mapping[str, Any]], dict[str, Any] | None] | None = field(default=None, compare=False)
    variant_of: Callable[[Mapping[str, Any]], str] | None = field(default=None, compare=False)
    chosen_by: ChosenBy | None = None
    knob_defaults: tuple[tuple[str, Any], ...] = ()
    axis_defaults: tuple[tuple[str, Any], ...] = ()  # see _Table
    language: str = "triton"
    archs: tuple[str, ...] | None = None
    table_axes: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.language not in LANGUAGES:
            raise ValueError(f"{self.qualname}: language {self.language!r} is none of {', '.join(LANGUAGES)}")
        undefaulted = [axis for axis in self.table_axes if axis not in dict(self.axis_defaults)]
        if undefaulted:
            raise ValueError(f"{self.qualname}: table axes {undefaulted} need an axis_defaults value")

    def compiled_functional(self, functional: Functional) -> Functional:
        """``functional`` as it is compiled, keyed in images and launched: without its
        ``table_axes`` (the same kernel serves each of their values)."""
        if not self.table_axes or not any(axis in self.table_axes for axis, _ in functional.items):
            return functional  # the common case, on every plan: no table axis
        return Functional(tuple(item for item in functional.items if item[0] not in self.table_axes))

    @functools.cached_property
    def argument_names(self) -> tuple[str, ...]:
        return tuple(arg.name for arg in self.arguments)

    @functools.cached_property
    def stride_groups(self) -> dict[str, tuple[str, ...]]:
        """The stride arguments by tensor: ``{"q": ("stride_qz", "stride_qh", "stride_qm"), ...}``.

        A stride argument is named ``stride_<tensor><axis>`` with a one-letter axis."""
        groups: dict[str, list[str]] = {}
        for name in self.argument_names:
            if name.startswith("stride_"):
                groups.setdefault(name[len("stride_"):-1], []).append(name)
        return {tensor: tuple(names) for tensor, names in groups.items()}

    def strides(self, tensor: str, values: Sequence[int]) -> dict[str, int]:
        """``values`` bound to the stride arguments of ``tensor``, in declaration order."""
        names = self.stride_groups.get(tensor)
        if names is None or len(names) != len(values):
            raise TypeError(f"{self.qualname}: {len(values)} strides for {tensor!r}, but the kernel declares "
                            f"{names or 'none'}")
        return dict(zip(names, values))

    def bind(self, **values: Any) -> tuple[Any, ...]:
        """The runtime arguments in the compiled kernel's order, from their names.

        Every declared argument must be named once and nothing else: a missing or an
        unknown name raises, so a swapped or forgotten argument is an error, never a
        kernel reading the wrong stride.
        """
        try:
            args = tuple(map(values.__getitem__, self.argument_names))
        except KeyError:
            missing = [name for name in self.argument_names if name not in values]
            raise TypeError(f"{self.qualname}: missing kernel arguments {missing}") from None
        if len(values) != len(args):
            unknown = sorted(set(values) - set(self.argument_names))
            raise TypeError(f"{self.qualname}: unknown kernel arguments {unknown}")
        return args

    def variant(self, functional: Functional) -> str:
        """How this functional is compiled: a :data:`VARIANTS` name."""
        if self.variant_of is None:
            return "generic"
        name = self.variant_of(functional.as_dict())
        if name not in VARIANTS:
            raise ValueError(f"{self.qualname}: variant {name!r} is none of {', '.join(VARIANTS)}")
        return name

    @functools.cached_property
    def type_axes(self) -> frozenset[str]:
        """Values that only fill argument types (``dtype`` in ``*{dtype}``), not constexprs."""
        return frozenset(field for arg in self.arguments
                         for _, field, _, _ in string.Formatter().parse(arg.type) if field)

    def _values(self, functional: Functional) -> dict[str, Any]:
        values = {**dict(self.axis_defaults), **functional.as_dict()}  # a constexpr at its default too
        for axis in self.table_axes:  # not the kernel's
            del values[axis]
        if self.derive is not None:
            values.update(self.derive(values))
        return values

    @property
    def declaration(self) -> str:
        """What of this declaration an image's binary and its launch depend on beyond the
        kernel's source (argument types and order, alignment hints, the knobs and axes a
        configuration or functional may leave out), as text: an archive records it in its
        source hash, so one built under another declaration is refused, not launched with
        this one's argument layout."""
        return json.dumps({"function": self.function, "language": self.language,
                           "arguments": [[a.name, a.type, a.aligned] for a in self.arguments],
                           "knob_defaults": [[k, repr(v)] for k, v in self.knob_defaults],
                           "axis_defaults": [[k, repr(v)] for k, v in self.axis_defaults],
                           "table_axes": list(self.table_axes)}, sort_keys=True)

    def signature(self, functional: Functional) -> dict[str, str]:
        """Triton signature of the runtime arguments, in order."""
        values = self._values(functional)
        return {arg.name: arg.signature(values) for arg in self.arguments}

    def constexprs(self, functional: Functional, config: Config) -> dict[str, Any]:
        """All constexpr arguments of one compiled variant."""
        values = {k: v for k, v in self._values(functional).items() if k not in self.type_axes}
        knobs = {name for name, _ in self.tuning_space}
        values.update({k: v for k, v in self.knob_defaults if k not in LAUNCH_OPTIONS})
        values.update({k: v for k, v in config.constexprs.items() if k in knobs})
        return values


@dataclass(frozen=True)
class OperatorSpec(_Table):
    """An operator-level choice made from a tuning table (e.g. the backward backend).

    It has the table-facing attributes of :class:`KernelSpec` (``family``, ``name``,
    ``functionals``, ``tuning_space``, ``tuning_keys``, ``fallback``) and no kernel.
    """

    family: str
    name: str
    functionals: tuple[tuple[str, tuple[Any, ...]], ...]
    tuning_space: tuple[tuple[str, tuple[Any, ...]], ...]
    tuning_keys: tuple[tuple[str, tuple[int, ...]], ...] = ()
    fallback: Callable[[Mapping[str, Any]], dict[str, Any] | None] | None = field(default=None, compare=False)
    disabled: Callable[[Mapping[str, Any]], bool] | None = field(default=None, compare=False)
    knob_defaults: tuple[tuple[str, Any], ...] = ()
    axis_defaults: tuple[tuple[str, Any], ...] = ()  # see _Table


@dataclass(frozen=True)
class LaunchPlan:
    """A kernel launch decided down to the last constexpr: what the launcher executes."""

    kernel: KernelSpec
    functional: Functional
    config: Config
    grid: tuple[int, int, int]
    args: tuple[Any, ...]

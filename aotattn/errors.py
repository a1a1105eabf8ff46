"""The root of the errors aotattn raises for its users.

Each layer raises its own subclass, with a message of one line that says what is wrong
and what to do: :class:`aotattn.tuning.TuningError` (a tuning file or lookup),
:class:`aotattn.runtime.images.ImageError` (an image archive, or a kernel missing from
one) and :class:`aotattn.runtime.driver.DriverError` (a CUDA driver call). ``except
AotattnError`` catches all of them; the command line prints them as one line. Argument
checks at the public boundary stay plain ``ValueError``/``TypeError``, as PyTorch's do.
"""

from __future__ import annotations


class AotattnError(Exception):
    """Base of the errors aotattn's layers raise (tuning, images, driver)."""


class AotattnWarning(UserWarning):
    """Base of the warnings aotattn issues (for example a kernel compiled at run time
    because its image is missing); filter them with ``warnings.filterwarnings``."""


def type_name(value: object) -> str:
    """The type of ``value`` as a message names it: ``float`` for a builtin, else with its
    module (``numpy.bool``, ``torch.Tensor``), where the bare name could read as a builtin's
    ("causal: expected a bool, got bool")."""
    kind = type(value)
    return kind.__name__ if kind.__module__ == "builtins" else f"{kind.__module__}.{kind.__qualname__}"

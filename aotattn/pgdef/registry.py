"""Applications and their task kinds: what a worker can run, and how one attempt runs.

An application is an :class:`App` object in an importable module; each task kind is a
subcategory with a handler::

    app = App("toy")

    @app.task("square", device="cpu")
    def square(payload: dict, ctx: TaskContext) -> dict:
        return {"y": payload["x"] ** 2}

Workers load applications by ``"module"`` or ``"module:attribute"`` (default attribute
``app``), so the same spec works in every worker process and on an offline GPU host.
"""

from __future__ import annotations

import importlib
import time
import traceback
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Literal

from aotattn.pgdef.errors import ConfigError, PayloadError
from aotattn.pgdef.model import Category, Outcome, Task, TaskContext, storable_json, storable_text

Handler = Callable[[dict[str, Any], TaskContext], Any]
Validator = Callable[[dict[str, Any]], None]
DEVICES = ("cpu", "gpu")
MAX_ERROR_CHARS = 4000


@dataclass(frozen=True)
class TaskKind:
    """A category and how to run its tasks.

    ``device="gpu"``: runs only in a worker that owns one GPU (one process per GPU, with
    ``CUDA_VISIBLE_DEVICES`` set to it); ``"cpu"``: runs in CPU workers. ``validate`` (optional)
    raises :class:`PayloadError` for a payload the handler cannot take; it runs at dispatch
    (when the dispatcher has the app) and before every attempt. ``max_attempts`` is the
    default for tasks dispatched to this kind.
    """

    category: Category
    handler: Handler
    device: Literal["cpu", "gpu"] = "cpu"
    max_attempts: int = 3
    validate: Validator | None = None
    description: str = ""


class App:
    """A named application: a set of task kinds, one per subcategory."""

    def __init__(self, name: str, description: str = ""):
        self.name = Category(name).app
        self.description = description
        self.kinds: dict[str, TaskKind] = {}

    def add(self, subcategory: str, handler: Handler, *, device: Literal["cpu", "gpu"] = "cpu",
            max_attempts: int = 3, validate: Validator | None = None, description: str = "") -> TaskKind:
        """Register ``handler`` for tasks of category ``<name>,<subcategory>``."""
        category = Category(self.name, subcategory)
        if device not in DEVICES:
            raise ConfigError(f"device: expected one of {DEVICES}, got {device!r}")
        if not isinstance(max_attempts, int) or max_attempts < 1:
            raise ConfigError(f"max_attempts: expected an integer >= 1, got {max_attempts!r}")
        if not callable(handler):
            raise ConfigError(f"handler for {category}: expected a callable, got {type(handler).__name__}")
        if str(category) in self.kinds:
            raise ConfigError(f"task kind {category} is registered twice")
        kind = TaskKind(category, handler, device, max_attempts, validate,
                        description or (handler.__doc__ or "").strip().split("\n")[0])
        self.kinds[str(category)] = kind
        return kind

    def task(self, subcategory: str = "", **options: Any) -> Callable[[Handler], Handler]:
        """Decorator form of :meth:`add`."""
        def register(handler: Handler) -> Handler:
            self.add(subcategory, handler, **options)
            return handler
        return register

    def __repr__(self) -> str:
        return f"App({self.name!r}, kinds={sorted(self.kinds)})"


def load_app(spec: str | App) -> App:
    """The App named by ``"package.module"`` or ``"package.module:attribute"`` (default ``app``)."""
    if isinstance(spec, App):
        return spec
    module_name, _, attribute = spec.partition(":")
    try:
        module = importlib.import_module(module_name)
    # TypeError and ValueError: a relative (".foo") or empty (":app") name, reported as an internal error
    except (ImportError, TypeError, ValueError) as exc:
        raise ConfigError(f"cannot import application module {module_name!r} ({exc}); "
                          "expected --app package.module[:attribute]") from exc
    app = getattr(module, attribute or "app", None)
    if not isinstance(app, App):
        raise ConfigError(f"{module_name} has no pgdef App named {attribute or 'app'!r}; "
                          "expected --app package.module[:attribute]")
    return app


def kinds_of(apps: Iterable[str | App]) -> dict[str, TaskKind]:
    """Every task kind of ``apps`` by category string; two apps with one name are an error."""
    kinds: dict[str, TaskKind] = {}
    names: set[str] = set()
    for spec in apps:
        app = load_app(spec)
        if app.name in names:
            raise ConfigError(f"application {app.name!r} is loaded twice")
        names.add(app.name)
        kinds.update(app.kinds)
    return kinds


def format_error(exc: BaseException) -> str:
    """``Type: message`` and the innermost frames, cut to MAX_ERROR_CHARS."""
    head = f"{type(exc).__name__}: {exc}"
    frames = traceback.format_tb(exc.__traceback__)[-3:]
    text = storable_text(head + ("\n" + "".join(frames).rstrip() if frames else ""))
    return text if len(text) <= MAX_ERROR_CHARS else text[:MAX_ERROR_CHARS - 15] + "\n... (cut)"


def run_attempt(kind: TaskKind, task: Task, ctx: TaskContext) -> Outcome:
    """Run one attempt of ``task``: validate, call the handler, check its output is JSON.

    Never raises for the handler's errors: they come back as an Outcome with the error text;
    :class:`PayloadError` and output that JSON cannot carry are permanent (retrying repeats them).
    """
    start = time.perf_counter()

    def failed(exc: BaseException, permanent: bool) -> Outcome:
        return Outcome(task.id, task.attempt, ok=False, error=format_error(exc), permanent=permanent,
                       elapsed_s=time.perf_counter() - start)

    try:
        if kind.validate is not None:
            kind.validate(task.payload)
        output = kind.handler(task.payload, ctx)
    except PayloadError as exc:
        return failed(exc, permanent=True)
    except (Exception, SystemExit) as exc:  # the handler's bug or a transient failure: recorded, retried
        # (a handler's sys.exit() is its failure, not the worker's: it exited the worker
        # silently, leaving the task running until its lease expired)
        return failed(exc, permanent=False)
    try:
        storable_json(output)
    except (TypeError, ValueError) as exc:
        return failed(TypeError(f"handler output is not JSON: {exc}"), permanent=True)
    return Outcome(task.id, task.attempt, ok=True, output=output, elapsed_s=time.perf_counter() - start)

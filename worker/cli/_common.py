"""What several commands share: their exit codes, the two consoles, and an expected failure
(:class:`InputError`, a gateway's error) as one red line and exit 1."""

from __future__ import annotations

import signal
import tempfile
import threading
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

import typer
from pydantic import ValidationError
from rich.console import Console

from worker.cli._output import cli_console, plain
from worker.errors import SiftError, validation_message

if TYPE_CHECKING:
    from worker.settings import Settings

EXIT_ERROR = 1
EXIT_USAGE = 2  # typer's own, for a bad option value or a bad combination of options
EXIT_ITEMS_FAILED = 3
EXIT_INTERRUPTED = 130  # 128 + SIGINT, as a shell reports Ctrl-C
EXIT_TERMINATED = 143  # 128 + SIGTERM: `sift ingest`, a wait for Redis, stopped as by a Ctrl-C
# In the data folder of a running `sift up`: the URL of the Redis it uses, so `sift status`
# finds it without SIFT_REDIS_URL (removed when the stack stops)
STACK_REDIS_FILE = "redis-url"
DEV_KEY_FILE = "dev-api-key.json"  # in the data folder: the development key and its secret
# the option that sets each setting, where a server command (`sift up`, `gateway`, `worker`)
# has one
SETTING_OPTIONS = {
    "gateway_port": "--port",
    "worker_metrics_port": "--metrics-port",
    "data_dir": "--data-dir",
    "worker_concurrency": "--concurrency",
    "worker_pool": "--pool",
    "worker_processes": "--processes",
    "log_level": "--loglevel",
}


class Signals:
    """Whether a SIGTERM stopped the command: it is taken as a Ctrl-C is (a
    ``KeyboardInterrupt`` in the main thread), told as "terminated", and exits 143."""

    def __init__(self) -> None:
        self.terminated = False

    @property
    def code(self) -> int:
        return EXIT_TERMINATED if self.terminated else EXIT_INTERRUPTED

    @property
    def word(self) -> str:
        return "terminated" if self.terminated else "interrupted"


@contextmanager
def sigterm_as_ctrl_c() -> Iterator[Signals]:
    """SIGTERM (a ``kill``, a supervisor, a CI step's timeout) stops a command as a Ctrl-C
    does (``sift ingest``: no request sent after it, the ones in flight waited for, what is
    known indexed and the line to resume from said; a second one leaves at once). Its default
    killed the command at once, saying nothing. A command run off the main thread (a test's
    runner in a thread) cannot take signals, and keeps the default."""
    signals = Signals()
    if threading.current_thread() is not threading.main_thread():
        yield signals
        return

    def on_term(signum: int, frame: object) -> None:
        signals.terminated = True
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, on_term)
    try:
        yield signals
    except typer.Exit as exc:  # a Ctrl-C's exit, by a SIGTERM: its own status
        if exc.exit_code == EXIT_INTERRUPTED and signals.terminated:
            raise typer.Exit(EXIT_TERMINATED) from None
        raise
    finally:
        signal.signal(signal.SIGTERM, previous)


def cli_settings(*, options: Mapping[str, str] | None = None, **overrides: Any) -> Settings:
    """The settings with ``overrides``, or one red line naming the bad one and exit 2: a bad
    setting is a usage error, for a client command as for ``sift worker`` and typer's own bad
    options. A bad override an option gave (``options``: each setting's option, such as
    :data:`SETTING_OPTIONS`) is a usage error naming the option, not its variable."""
    from worker.settings import load_settings

    try:
        return load_settings(**overrides)
    except SiftError as error:
        given = {field: name for field, name in (options or {}).items() if field in overrides}
        if (named := option_error(error, given)) is not None:
            raise named from None
        stop(plain(error.message))


def stop(message: str, code: int = EXIT_USAGE) -> NoReturn:
    """End the command with ``error: message`` on stderr, unwrapped (never cut mid-path), and
    exit ``code``: 2 for what the user must change (a setting, an option), 1 for what
    failed."""
    _err().print(f"[bold red]error:[/] {message}", soft_wrap=True)
    raise typer.Exit(code) from None


def setting_help(help: str, variable: str) -> str:
    """``help`` with the default an option takes from the setting ``variable``, as typer
    shows its own: ``the gateway's [default: 8080, SIFT_GATEWAY_PORT]``. The value is the
    Settings field's own default, not the environment's (a help text is the same on every
    machine); the option's default is ``None`` in the code so that the setting is read, and
    typer showed no default, or the variable's name alone, where the README promised one.

    >>> print(setting_help("the gateway's", "SIFT_GATEWAY_PORT"))  # escaped: rich markup
    the gateway's \\[default: 8080, SIFT_GATEWAY_PORT]
    """
    from rich.markup import escape

    from worker.settings import Settings

    field = Settings.model_fields[variable.removeprefix("SIFT_").lower()]
    value = field.get_default(call_default_factory=True)
    return escape(f"{help} [default: {value}, {variable}]")


def stack_redis_url(data_dir: Path) -> str | None:
    """The Redis of the ``sift up`` stack on ``data_dir``, if one runs there (or was
    killed before it could remove its file: then nothing answers at that URL)."""
    try:
        return (data_dir / STACK_REDIS_FILE).read_text().strip() or None
    except OSError:
        return None


def option_error(error: SiftError, options: Mapping[str, str]) -> typer.BadParameter | None:
    """The usage error (exit 2) naming the option that gave a setting ``error`` refuses
    (``options``: each setting an option gave, and that option's name), not its variable;
    None when the settings' error is none of theirs."""
    cause = error.__cause__
    for problem in cause.errors() if isinstance(cause, ValidationError) else []:
        field = str(problem["loc"][0]) if problem["loc"] else ""
        if field in options:
            message = validation_message(problem["msg"])
            return typer.BadParameter(message, param_hint=f"'{options[field]}'")
    return None


def why_unwritable(path: Path, *, make_folders: bool = False, in_place: bool = False) -> str | None:
    """Why a command could not write its output file ``path``, checked before any work is
    done (None: it can): a folder, a path under a file, a place this user may not write.
    ``make_folders`` creates the missing ones (else a typo's folder is not left behind);
    ``in_place``: the command writes an existing file itself, not a new one renamed over
    it, so that file is opened to append (nothing in it changes), not only its folder tried.
    """
    if path.is_dir():
        return "it is a folder"
    try:
        if make_folders:
            path.parent.mkdir(parents=True, exist_ok=True)
        if in_place and path.exists():
            with path.open("ab"):
                pass
        else:
            trial = f".{path.name}."
            with tempfile.NamedTemporaryFile(dir=path.parent, prefix=trial, suffix=".check"):
                pass
    except OSError as exc:
        # a file where a folder should be: "Not a directory" or "File exists", naming neither
        blocker = next((p for p in path.parents if p.exists() and not p.is_dir()), None)
        return f"{blocker} is a file, not a folder" if blocker else str(exc.strerror or exc)
    return None


def a_folder(value: str) -> Path:
    """A ``--data-dir`` option's folder, refused when empty as ``SIFT_DATA_DIR=""`` is
    (``Settings._a_folder``): typer made ``""`` ``Path(".")``, so ``sift up --data-dir ""``
    kept its stack (Redis's AOF, the logs, the dev key) in the working directory."""
    if not value.strip():
        raise typer.BadParameter("is empty: give a folder, or leave the option out for the default")
    return Path(value)


class InputError(Exception):
    """A bad line in an input file; the message names the file, the line and the field."""


def _out() -> Console:
    return cli_console()


def _err() -> Console:
    return cli_console(stderr=True)


@contextmanager
def _expected_errors() -> Iterator[None]:
    """Turn expected failures into one red line on stderr and exit code 1."""
    from worker.cli._http import GatewayError  # httpx: the client commands', not `sift gateway`'s

    try:
        yield
    except (GatewayError, InputError) as exc:
        stop(plain(exc), EXIT_ERROR)


def one_of(choices: tuple[str, ...]) -> Callable[[str | None], str | None]:
    """A typer callback: an option's value if it is one of ``choices``, else a usage error
    naming the option (exit 2), checked before the command runs.

    >>> one_of(("fts", "vector"))("fts")
    'fts'
    """

    def check(value: str | None) -> str | None:
        if value is not None and value not in choices:
            raise typer.BadParameter(f"one of {', '.join(choices)} is required, not {value!r}")
        return value

    return check

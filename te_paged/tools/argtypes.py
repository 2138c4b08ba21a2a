"""argparse types and checks for ``te-paged``: a bad value is one line naming the flag and the
accepted range, exit status 2 (argparse's convention), before any work starts."""

from __future__ import annotations

import argparse
import math
import os
import sys
from pathlib import Path

__all__ = [
    "MEGATRON_ALIASES",
    "OneLineParser",
    "check_output",
    "given",
    "integer",
    "knob",
    "open_output",
    "real",
]

#: The Megatron names ``te-paged``'s stash and pipeline knobs also answer to, so a Megatron
#: command line's values can be pasted as they are.
MEGATRON_ALIASES: dict[str, tuple[str, ...]] = {
    "--capacity-factor": ("--moe-expert-rank-capacity-factor",),
    "--buffer-factor-cuda": ("--moe-paged-stash-buffer-size-factor-cuda",),
    "--buffer-factor-cpu": ("--moe-paged-stash-buffer-size-factor-cpu",),
    "--page-size": ("--moe-paged-stash-page-size",),
    "--pipeline-parallel": ("--pipeline-model-parallel-size",),
    "--virtual-stages": (
        "--virtual-pipeline-model-parallel-size",
        "--num-virtual-stages-per-pipeline-rank",
    ),
    "--microbatches": ("--num-microbatches",),
    "--microbatch-group-size": ("--microbatch-group-size-per-virtual-pipeline-stage",),
}


def given(args: argparse.Namespace, names) -> list[str]:
    """The flags among ``names`` (attribute names, or ``(name, flag)`` pairs) that were given: a
    value other than None (a default nothing set) or a switch's False; 0 and 0.0 are values."""
    pairs = [(n, f"--{n.replace('_', '-')}") if isinstance(n, str) else n for n in names]
    values = [(flag, getattr(args, name, None)) for name, flag in pairs]
    return [flag for flag, value in values if value is not None and value is not False]


def knob(g, flag: str, **kw) -> argparse.Action:
    """Add ``flag`` (and its Megatron aliases) parsed into the attribute of its own name."""
    return g.add_argument(flag, *MEGATRON_ALIASES[flag], dest=flag[2:].replace("-", "_"), **kw)


class OneLineParser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose errors are one line (``te-paged ab: error: ...``), status 2."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def integer(minimum: int, maximum: int | None = None):
    """An argparse type: an int in ``[minimum, maximum]``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < minimum or (maximum is not None and value > maximum):
            upper = f" and <= {maximum}" if maximum is not None else ""
            raise argparse.ArgumentTypeError(f"must be >= {minimum}{upper}, got {value}")
        return value

    parse.__name__ = "integer"
    return parse


def token_schedule(text: str) -> int | tuple[tuple[int, ...], ...]:
    """An argparse type: tokens per rank, one count (``512``) or a variable-length schedule:
    steps separated by commas, a step's microbatches by ``+`` (``256,1024,512``: one microbatch
    a step; ``256+256,512+128``: two)."""
    if "," not in text and "+" not in text:
        return integer(1)(text)
    steps = []
    for step in text.split(","):
        try:
            sizes = tuple(int(n) for n in step.split("+"))
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected token counts like 256,1024 (steps) or 256+128 (a step's "
                f"microbatches), got {text!r}"
            ) from None
        if not sizes or min(sizes) < 1:
            raise argparse.ArgumentTypeError(f"token counts must be >= 1, got {text!r}")
        steps.append(sizes)
    return tuple(steps)


def real(minimum: float = -math.inf, maximum: float = math.inf, *, strict_min: bool = False,
         strict_max: bool = False):  # fmt: skip
    """An argparse type: a finite float in the given range (``nan``/``inf`` refused)."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        low_bad = value < minimum or (strict_min and value == minimum)
        high_bad = value > maximum or (strict_max and value == maximum)
        if not math.isfinite(value) or low_bad or high_bad:
            parts = []
            if minimum != -math.inf:
                parts.append(f"{'>' if strict_min else '>='} {minimum:g}")
            if maximum != math.inf:
                parts.append(f"{'<' if strict_max else '<='} {maximum:g}")
            bound = " and ".join(parts) or "finite"
            raise argparse.ArgumentTypeError(f"must be a finite number {bound}, got {text}")
        return value

    parse.__name__ = "real"
    return parse


#: The largest factor a flag takes (capacity, buffer, headroom): a thousand balanced cases is
#: no budget, and past this a size computed from it can overflow (``1e308`` did).
FACTOR_MAX = 1000.0


def factor(minimum: float = 0.0, *, strict_min: bool = True):
    """An argparse type for a factor: :func:`real` up to :data:`FACTOR_MAX`."""
    return real(minimum, FACTOR_MAX, strict_min=strict_min)


def check_output(flag: str, path: Path | None, force: bool, *, directory: bool = False) -> None:
    """Refuse, before the run, an output the run could not write or would overwrite silently.

    Raises ``ValueError`` naming ``flag``. A directory must exist or be creatable and be
    writable; a file's directory must exist and be writable, and the file must not exist
    unless ``force``.
    """
    if path is None:
        return
    if directory:
        probe = path
        while not probe.exists():
            probe = probe.parent
        if not probe.is_dir() or not os.access(probe, os.W_OK):
            raise ValueError(f"{flag} {path}: {probe} is not a writable directory")
        return
    if path.is_symlink():  # lstat: a link (dangling or not) is never followed
        raise ValueError(
            f"{flag} {path}: is a symbolic link; give the path of the file itself (te-paged "
            "writes only through a path that is not a link)"
        )
    if path.is_dir():
        raise ValueError(f"{flag} {path}: is a directory, not a file")
    parent = path.parent if str(path.parent) else Path(".")
    if not parent.is_dir():
        raise ValueError(f"{flag} {path}: the directory {parent} does not exist")
    if not os.access(parent, os.W_OK):
        raise ValueError(f"{flag} {path}: the directory {parent} is not writable")
    if path.exists() and not force:
        raise ValueError(f"{flag} {path}: exists; pass --force to overwrite it")


def fail(prog: str, message: str, status: int = 2) -> int:
    """Print ``prog: error: message`` as one line; return ``status``."""
    print(f"{prog}: error: {message}", file=sys.stderr)
    return status


def open_output(flag: str, path: Path, force: bool, mode: str = "w"):
    """Open ``path`` to write, never through a symbolic link (``O_NOFOLLOW``: a link put there
    after :func:`check_output` ran is refused too) and, without ``force``, only if it does not
    exist yet (``O_EXCL``). Raises ``ValueError`` naming ``flag``."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | (os.O_TRUNC if force else os.O_EXCL)
    try:
        fd = os.open(path, flags, 0o644)
    except FileExistsError:
        raise ValueError(f"{flag} {path}: exists; pass --force to overwrite it") from None
    except OSError as e:
        if path.is_symlink():
            raise ValueError(f"{flag} {path}: is a symbolic link; not written through") from None
        raise ValueError(f"{flag} {path}: cannot be written ({e.strerror})") from None
    return os.fdopen(fd, mode)

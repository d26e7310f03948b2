"""A command line Hydra cannot compose is refused with a record, like every other bad input.

Hydra composes the config before memopt runs; when that fails (an unknown key without ``+``, an
unknown option of a config group, a value of the wrong type) it prints its error and exits 1, and the
run directory gets no ``summary.json``. Here the same composition is tried first for a single run
(a sweep's values are lists Hydra expands itself; each job is then checked by the gate, ``memopt.gate``):
a failure writes a ``refused`` summary into the directory the run would have used and exits 2. A run
directory that cannot be written is refused here too, in one line on stderr (nothing can be recorded).
A field set under a node the command leaves null (a strategy it does not select) is named with its fix, in
a single run and in every job of a sweep (OmegaConf fails on it with a bare assertion and a traceback); a sweep
whose jobs do not compose is refused before any runs, naming the job.
"""
from __future__ import annotations

import difflib
import os
import sys
import time

from memopt.errors import EXIT_CODES

_HYDRA_FLAGS = ("-m", "--multirun", "-h", "--help", "--hydra-help", "-c", "--cfg", "-i", "--info", "--version",
                "-p", "--package", "--shell-completion", "-sc", "--config-path", "-cp", "--config-name", "-cn",
                "--config-dir", "-cd", "--experimental-rerun", "--resolve")


def refuse_uncomposable(argv: list[str]) -> None:
    flags = {a.split("=")[0] for a in argv if a.split("=")[0] in _HYDRA_FLAGS}
    if flags and flags <= {"-m", "--multirun"}:  # a sweep of memopt's own config (not -cn/-cp/--cfg...)
        _refuse_uncomposable_sweep(argv)
    if flags:  # sweeps, help and config printing: Hydra's own
        return
    job = [a for a in argv if not a.lstrip("+~").startswith("hydra.") and not a.lstrip("+~").startswith("hydra/")]
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from memopt.config import compose_config

    try:
        compose_config(job)
        _refuse_unwritable(_run_dir(argv))
    except (HydraException, OmegaConfBaseException, AssertionError) as e:
        null = _null_parent(job) if isinstance(e, AssertionError) else None
        if isinstance(e, AssertionError) and null is None:
            raise
        message = null or _message(e)
        hint = "" if null else _nearest_key(job)
        error = f"the command does not compose: {message}" + (f" ({hint})" if hint else "")
        run_dir = _run_dir(argv)
        where = (f"summary in {run_dir}/summary.json" if _write_refusal(run_dir, error)
                 else f"nothing written into {run_dir}: it holds a run, whose records stay as they are")
        print(f"memopt: configuration refused: {error}\nmemopt: {where}", file=sys.stderr)
        raise SystemExit(EXIT_CODES["refused"]) from None
    finally:
        from hydra.core.global_hydra import GlobalHydra

        GlobalHydra.instance().clear()


def _message(e: BaseException) -> str:
    """Hydra's error on one line, with its cause (the type a value failed to convert to), without the
    config search path and without the advice to add the key with '+' (the schema has no place for it)."""
    text = " ".join(str(e).split("Config search path:")[0].split())
    text = text.split(" To append to your config use")[0]
    cause = e.__cause__
    if cause is not None and str(cause).strip():
        text = f"{text}: {str(cause).splitlines()[0]}"
    return " ".join(text.split())


def _refuse_uncomposable_sweep(argv: list[str]) -> None:
    """A sweep's jobs composed before Hydra launches any, refused in memopt's words when one does not compose,
    naming the job and the fix (exit 2; nothing ran). Hydra composes a batch's jobs first too, and any failure ends
    the whole sweep there; it said so in its own words (exit 1, the advice to add the key with '+', which the
    schema refuses), or, for a field set under a null node (``_null_parent``), with OmegaConf's bare assertion and
    a traceback. Composed: every value of every argument once (job i takes each argument's value i, cycling), which
    finds a misspelt key or a value of the wrong type; where a field sits three keys deep
    (``strategy.zero2.bucket_mb``), whose node another argument's value may leave null, every job (up to 256)."""
    args = [a for a in argv if not a.startswith("-") and not a.lstrip("+~").startswith(("hydra.", "hydra/"))]
    if any(a.lstrip("+~").split("=", 1)[0] == "experiment" for a in args) or any("hydra.sweeper" in a for a in argv):
        return  # sweeper params (an experiment's, or given) add overrides to every job: its jobs are Hydra's to compose
    import itertools

    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    try:
        values = [_values(a) for a in args]
    except Exception:  # noqa: BLE001 - a sweep Hydra alone can expand (glob over a group, interval...): its own
        return
    deep = any("=" in a and not a.startswith(("+", "~")) and a.split("=", 1)[0].count(".") >= 2 for a in args)
    jobs = list(itertools.islice(itertools.product(*values), 257)) if deep else []
    if not deep or len(jobs) > 256:
        jobs = [tuple(v[i % len(v)] for v in values) for i in range(max(map(len, values), default=1))]
    from memopt.config import compose_config

    try:
        for job in map(list, jobs):
            try:
                compose_config(job)
            except AssertionError:
                null = _null_parent(job)
                if null is None:
                    raise
                why = null
            except (HydraException, OmegaConfBaseException) as e:
                hint = _nearest_key(job)
                why = _message(e) + (f" ({hint})" if hint else "")
            else:
                continue
            print(f"memopt: sweep refused, nothing ran: its job {' '.join(job)} does not compose: {why}", file=sys.stderr)
            raise SystemExit(EXIT_CODES["refused"]) from None
    finally:
        from hydra.core.global_hydra import GlobalHydra

        GlobalHydra.instance().clear()


def _values(arg: str) -> list[str]:
    """``key=a,b,c`` -> ``[key=a, key=b, key=c]``: a sweep's values as Hydra's own override parser expands them
    (commas inside [], {} or quotes, or escaped, stay one value; ``range()`` and ``choice()`` expanded)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    o = OverridesParser.create().parse_override(arg)
    if not o.is_sweep_override():
        return [arg]
    return [f"{o.get_key_element()}={v}" for v in o.sweep_string_iterator()]


def _null_parent(job: list[str]) -> str | None:
    """The overrides that set a field under a node this command leaves null (``strategy.zero2.bucket_mb=...``
    without ``+strategy=zero2``): OmegaConf fails on the first with a bare ``AssertionError`` ("Unexpected type for
    root: NoneType"). Found by composing the command's group choices alone (what decides which nodes are null) and
    walking every dotted key against that; all of them named."""
    from memopt.config import compose_config

    choices = [a for a in job if a.startswith(("+", "~")) or "." not in a.split("=", 1)[0]]
    try:
        node0 = compose_config(choices)
    except Exception:  # noqa: BLE001 - the choices themselves do not compose: Hydra's own error says why
        return None
    found = []
    for a in job:
        key = a.split("=", 1)[0]
        if "=" not in a or a.startswith(("+", "~")) or "." not in key:
            continue
        node, parts = node0, key.split(".")
        for i, part in enumerate(parts[:-1]):
            node = node.get(part) if hasattr(node, "get") else None
            if node is None:
                parent = ".".join(parts[:i + 1])
                fix = (f"select it with +strategy={parts[1]} (or add {parts[1]} to the +strategy list), or drop {key}"
                       if parts[0] == "strategy" and i == 1 else f"set {parent} first, or drop {key}")
                found.append(f"{a} sets a field of {parent}, which this command leaves null: {fix}")
                break
    return "; ".join(found) or None


def _nearest_key(job: list[str]) -> str:
    """'did you mean K?' for the first ``key=value`` whose key the default config lacks (what another framework calls
    it, ``FOREIGN_KEYS``, before the nearest spelling)."""
    from omegaconf import OmegaConf

    from memopt.config import FOREIGN_KEYS, compose_config

    try:
        keys = _dotted(OmegaConf.to_container(compose_config([a for a in job if a.startswith("+strategy=")])))
    except Exception:  # noqa: BLE001 - a hint only
        return ""
    for a in job:
        if "=" not in a or a.startswith(("+", "~")):
            continue
        key = a.split("=", 1)[0]
        if "/" in key or key in keys or any(k.startswith(key + ".") for k in keys):
            continue
        foreign = FOREIGN_KEYS.get(key.rsplit(".", 1)[-1])
        if foreign:
            return f"memopt's name for it: {foreign}"
        near = difflib.get_close_matches(key, sorted(keys), n=1)
        if near:
            return f"did you mean {near[0]}?"
    return ""


def _dotted(node, prefix: str = "") -> set[str]:
    out = set()
    if isinstance(node, dict):
        for k, v in node.items():
            out.add(f"{prefix}{k}")
            out |= _dotted(v, f"{prefix}{k}.")
    return out


def _run_dir(argv: list[str]) -> str:
    """``hydra.run.dir`` as given, or the default pattern of ``conf/train.yaml`` at this second."""
    for a in argv:
        if a.startswith("hydra.run.dir="):
            value = a.split("=", 1)[1]
            if "${" in value:
                from omegaconf import OmegaConf

                value = OmegaConf.create({"d": value}).d  # Hydra registered the now: resolver on import
            return value
    return os.path.join("outputs", "runs", time.strftime("%Y-%m-%d"), time.strftime("%H-%M-%S"))


def _refuse_unwritable(run_dir: str) -> None:
    """A run directory this process cannot write (a read-only file system, no permission) would fail in
    Hydra's log handler with its traceback, before memopt can say anything: say it in one line instead.
    Nothing can be recorded there, so the refusal is on stderr only."""
    probe = os.path.abspath(run_dir)
    while not os.path.exists(probe):
        probe = os.path.dirname(probe)
    if not os.access(probe, os.W_OK):
        print(f"memopt: configuration refused: the run directory {run_dir} cannot be written ({probe} is not "
              "writable: a read-only file system or no permission); no summary.json can be written there: give "
              "hydra.run.dir=<a writable directory>", file=sys.stderr)
        raise SystemExit(EXIT_CODES["refused"])


def _write_refusal(run_dir: str, error: str) -> bool:
    """The refused summary, unless the directory holds a run (its records stay): whether it was written."""
    from memopt import outcome
    from memopt.records import prior_records

    if prior_records(run_dir):
        return False
    return outcome.record(run_dir, {"status": "refused", "error": error})

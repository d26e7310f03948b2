"""Every failure path writes summary.json with its status, and the process exits with that status's
code (memopt.errors.EXIT_CODES): here the refusals before allocation (2); a crashing rank (1) is in
tests/distributed/test_launch.py."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from memopt.errors import EXIT_CODES
from tests.conftest import REPO, typed

QUICK = ["logger=none", "trainer.max_steps=2", "trainer.eval_every=0", "trainer.progress_bar=false",
         "trainer.micro_batch_size=2", "model.seq_len=32"]


def run(tmp_path, args, env_extra=None):
    d = tmp_path / "r"
    env = dict(os.environ, PYTHONPATH=REPO, WANDB_MODE="offline")
    env.pop("TRITON_INTERPRET", None)
    env.update(env_extra or {})
    p = subprocess.run([sys.executable, "-m", "memopt.train", f"hydra.run.dir={d}", *QUICK, *args], cwd=str(tmp_path),
                       env=env, capture_output=True, text=True, timeout=600)
    return p, json.loads((d / "summary.json").read_text())


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_cuda_without_a_gpu_is_refused_before_allocating(tmp_path):
    p, s = run(tmp_path, ["trainer.device=cuda"])
    assert p.returncode == EXIT_CODES["refused"] == 2
    assert s["status"] == "refused" and "trainer.device=cuda" in s["error"] and s["engine"] == "memopt"


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="flash_attn runs on CUDA")
@pytest.mark.slow  # 6 s on an AVX2 CPU; the same refusal stays in the default suite (tests/kernels/test_flash_strategy.py)
def test_flash_attn_on_cpu_without_the_interpreter_is_refused(tmp_path):
    p, s = run(tmp_path, ["+strategy=flash_attn"])
    assert p.returncode == 2, p.stderr[-2000:]
    assert s["status"] == "refused" and "flash_attn" in s["error"]


def test_an_empty_data_file_is_refused(tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    p, s = run(tmp_path, ["data=text_file", f"data.path={empty}"])
    assert p.returncode == 2 and s["status"] == "refused" and "empty" in s["error"]



@pytest.mark.parametrize("args, words", [
    (["trainer.max_step=5"], ["trainer.max_step", "did you mean trainer.max_steps?"]),
    # what a Lightning or DeepSpeed user types: memopt's way named, not the nearest spelling (it was trainer.resume)
    (["trainer.precision=bf16"], ["trainer.precision", "+strategy=bf16"]),
    (["trainer.gradient_accumulation_steps=4"], ["trainer.gradient_accumulation_steps", "trainer.grad_accum"]),
    # a key memopt had and replaced: its successor named, not the nearest spelling (strategy.auto.trials)
    (["+strategy=auto", "strategy.auto.trial_margin=0.1"], ["strategy.auto.trial_margin", "strategy.auto.trial_weight"]),
    (["model=gpt_huge"], ["model/gpt_huge", "gpt_tiny"]),
    (["trainer.max_steps=abc"], ["trainer.max_steps=abc", "Integer"]),
    # a field of a strategy the command does not select: OmegaConf's bare assertion and a traceback before
    (["strategy.zero2.overlap_comm=false"], ["strategy.zero2.overlap_comm=false", "+strategy=zero2"]),
    (["strategy.zero2.bucket_mb=5", "strategy.zero2.overlap_comm=false"],  # both named (dropping one still failed)
     ["strategy.zero2.bucket_mb=5 sets", "strategy.zero2.overlap_comm=false sets"]),
])
def test_a_command_hydra_cannot_compose_is_refused_with_a_record(tmp_path, args, words, capsys, monkeypatch):
    """Hydra's own composition errors exited 1 without summary.json; they are refusals (exit 2). The CLI's
    entry point runs in this process (``sys.argv``): the refusal comes before Hydra starts."""
    from memopt.train import main

    d = tmp_path / "r"
    monkeypatch.setattr(sys, "argv", ["memopt.train", f"hydra.run.dir={d}", *QUICK, *args])
    with pytest.raises(SystemExit) as e:
        main()
    err = capsys.readouterr().err
    assert e.value.code == EXIT_CODES["refused"], err[-2000:]
    s = json.loads((d / "summary.json").read_text())
    assert s["status"] == "refused" and all(w in s["error"] for w in words), s["error"]
    assert "Traceback" not in err and err.strip().splitlines()[-1].endswith("summary.json")


def test_a_sweep_whose_job_sets_a_field_of_a_strategy_it_does_not_select_is_refused_before_any_job(tmp_path, capsys,
                                                                                                    monkeypatch):
    """Hydra composes a sweep's jobs before running one; a field under a strategy one job does not select failed
    there with OmegaConf's bare assertion, a traceback and exit 1. Refused in memopt's words, naming that job."""
    from memopt.train import main

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["memopt.train", "-m", "+strategy=[bf16,zero2],zero3",
                                      "strategy.zero2.overlap_comm=false", *QUICK])
    with pytest.raises(SystemExit) as e:
        main()
    err = capsys.readouterr().err
    assert e.value.code == EXIT_CODES["refused"], err[-2000:]
    assert "Traceback" not in err and "its job +strategy=zero3 strategy.zero2.overlap_comm=false" in err, err
    assert not (tmp_path / "outputs").exists()  # nothing ran
    from memopt.cli_gate import _refuse_uncomposable_sweep

    # an experiment's sweeper params may select the strategy in every job: not this check's to judge
    _refuse_uncomposable_sweep(["-m", "experiment=vs_deepspeed", "strategy.zero2.overlap_comm=false"])


@pytest.mark.parametrize("args, words", [
    (["trainer.max_steps=2", "trainer.micro_batchsize=1,2"], ["trainer.micro_batchsize", "did you mean trainer.micro_batch_size?"]),
    (["trainer.max_stepz=2", "trainer.micro_batch_size=1,2"], ["trainer.max_stepz", "did you mean trainer.max_steps?"]),
    (["trainer.max_steps=2,abc"], ["trainer.max_steps=abc", "Integer"]),  # the second value only
])
def test_a_sweep_with_a_misspelt_key_or_a_bad_value_is_refused_before_any_job(tmp_path, args, words, capsys, monkeypatch):
    """Hydra ended such a sweep with its own error (exit 1, the advice to add the key with '+', which the schema
    refuses) and left a multirun.yaml; refused as a single run's is, naming the job and the nearest key, exit 2."""
    from memopt.train import main

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["memopt.train", "-m", *QUICK, *args])
    with pytest.raises(SystemExit) as e:
        main()
    err = capsys.readouterr().err
    assert e.value.code == EXIT_CODES["refused"], err[-2000:]
    assert "sweep refused, nothing ran" in err and all(w in err for w in words) and "Traceback" not in err, err
    assert "To append to your config" not in err and not (tmp_path / "outputs").exists()


def test_a_sweeps_values_split_where_hydra_splits_them():
    """Commas inside a list, a dict, quotes or escaped are one value; the job is composed with each value."""
    from memopt.cli_gate import _values

    assert _values("+strategy=[bf16,zero2],zero3") == ["+strategy=[bf16,zero2]", "+strategy=zero3"]
    assert _values("a='x,y',z") == ["a='x,y'", "a=z"] and _values("a={p:1,q:2},r") == ["a={p:1,q:2}", "a=r"]
    assert _values(r"a=x\,y,z") == [r"a=x\,y", "a=z"] and _values("a=") == ["a="] and _values("a=1,2,3")[2] == "a=3"


def test_a_key_added_with_plus_where_the_schema_has_none_is_refused_with_memopts_name_for_it():
    """``+trainer.gradient_accumulation_steps=4`` composes (the '+' adds the key) and is refused by the schema check,
    which names memopt's field for what another framework calls it, or the nearest field."""
    from memopt.config import ConfigError

    with pytest.raises(ConfigError, match=r"trainer.gradient_accumulation_steps is not a field .*trainer.grad_accum"):
        typed(["+trainer.gradient_accumulation_steps=4"])
    with pytest.raises(ConfigError, match=r"did you mean trainer.max_steps\?"):
        typed(["+trainer.max_stepz=4"])


def test_a_command_that_does_not_compose_leaves_a_directory_holding_a_run_as_it_was(tmp_path, capsys, monkeypatch):
    from memopt.train import main

    d = tmp_path / "r"
    d.mkdir()
    (d / "summary.json").write_text('{"status": "ok"}')  # a run's record
    monkeypatch.setattr(sys, "argv", ["memopt.train", f"hydra.run.dir={d}", "model=gpt_huge"])
    with pytest.raises(SystemExit) as e:
        main()
    assert e.value.code == EXIT_CODES["refused"]
    assert json.loads((d / "summary.json").read_text()) == {"status": "ok"}
    assert capsys.readouterr().err.strip().splitlines()[-1].endswith("whose records stay as they are")


@pytest.mark.parametrize("real", [True, False], ids=["read_only_dir", "simulated"])
def test_a_run_directory_that_cannot_be_written_is_refused_in_one_line(tmp_path, capsys, monkeypatch, real):
    """Hydra's file log handler failed on it with a 32-line traceback ("Unable to configure handler
    'file'"). Real: a directory without write permission (root writes through permission bits, so there the
    simulated case, os.access saying no, is the check)."""
    from memopt.train import main

    parent = tmp_path / "ro"
    parent.mkdir()
    if real:
        if os.geteuid() == 0:
            pytest.skip("root writes through permission bits; the simulated case checks the gate")
        parent.chmod(0o555)
    else:
        monkeypatch.setattr(os, "access", lambda path, mode: False)
    d = parent / "run"
    monkeypatch.setattr(sys, "argv", ["memopt.train", f"hydra.run.dir={d}", *QUICK])
    try:
        with pytest.raises(SystemExit) as e:
            main()
    finally:
        parent.chmod(0o755)
    err = capsys.readouterr().err
    assert e.value.code == EXIT_CODES["refused"], err[-2000:]
    assert "Traceback" not in err and f"the run directory {d} cannot be written" in err and not d.exists()


def test_an_out_of_memory_is_one_line_and_its_traceback_is_in_the_record(tmp_path, capfd):
    """A run over its device budget (preflight off, so the run itself crosses) exits 3 with one line naming the
    category that crossed, as a refusal does: no traceback on the terminal (it printed ~40 lines), the traceback
    kept in summary.json."""
    from tests.e2e.test_run_records import cli_run

    d = tmp_path / "r"
    code = cli_run(d, ["hardware.device_memory_gb=0.02", "trainer.preflight=false", "trainer.micro_batch_size=16",
                       "model.seq_len=64"])
    err = capfd.readouterr().err
    s = json.loads((d / "summary.json").read_text())
    assert code == EXIT_CODES["oom"] == 3 and s["status"] == "oom", err[-2000:]
    assert "Traceback" not in err and "crossed by" in err.strip().splitlines()[-1], err[-2000:]
    assert "DeviceBudgetExceeded" in s["traceback"]
